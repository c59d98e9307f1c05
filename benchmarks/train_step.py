"""Step time and tokens/s of `tiny-cpu` (the `cipher-train` default) with and without the monitor and the other
callbacks, side by side in one process: what watching a run costs.

    python benchmarks/train_step.py [--steps 30] [--rounds 3] [overrides a.b=c ...]

One trainer is built the way `cipher-train` builds it; the contenders alternate for `--rounds` rounds of `--steps`
optimizer steps (logging every `training.log_every` steps in both, so the log-row work is in both) and each keeps its
median step time. "bare": no monitor, no callbacks. "full": the monitor (stats into every log row, threat checks) and
the callbacks the run was built with (any optional loggers). Checkpoints and evaluations are timed elsewhere.
Goal (issue 7): the full set costs under 3%.
"""

import argparse
import statistics
import tempfile
import time

from cipher_nb.config import load_config
from cipher_nb.train import build_trainer


def timed_steps(trainer, watchers, n) -> float:
    "Seconds per optimizer step over `n` steps of `fit` with `watchers` = (monitor, callbacks)."
    trainer.monitor, trainer.callbacks = watchers
    trainer.cfg.training.max_steps = trainer.step + n
    t0 = time.perf_counter()
    trainer.fit(progress=False)
    return (time.perf_counter() - t0) / n


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    cfg = load_config(
        None,
        ["training.max_steps=100000", "training.eval_every=100000", "training.checkpoint_every=100000", *a.overrides],
    )
    with tempfile.TemporaryDirectory() as d:
        tr = build_trainer(cfg, d)
        tr.checkpoints = tr.eval_fn = tr.record = None  # checkpoints and evaluations are timed elsewhere
        with_all, with_none = (tr.monitor, list(tr.callbacks)), (None, [])
        timed_steps(tr, with_all, 5)  # warm-up: allocator, first log row
        times = {"bare": [], "full": []}
        for _ in range(a.rounds):
            times["bare"].append(timed_steps(tr, with_none, a.steps))
            times["full"].append(timed_steps(tr, with_all, a.steps))
    t = cfg.training
    tokens = t.batch_size * t.seq_len * t.grad_accum
    bare = statistics.median(times["bare"])
    print(f"tiny-cpu step ({tokens} tokens, log every {t.log_every}), median of {a.rounds} rounds x {a.steps} steps")
    print(f"{'contender':<10}{'ms/step':>10}{'tok/s':>10}{'x bare':>9}   monitor and callbacks")
    for name, ts in times.items():
        s = statistics.median(ts)
        names = ", ".join(type(c).__name__ for c in [with_all[0], *with_all[1]]) if name == "full" else "-"
        print(f"{name:<10}{1000 * s:>10.1f}{tokens / s:>10.0f}{s / bare:>9.3f}   {names}")
    over = statistics.median(times["full"]) / bare - 1
    print(f"overhead of the monitor and callbacks: {100 * over:+.1f}% (goal < 3%)")


if __name__ == "__main__":
    main()
