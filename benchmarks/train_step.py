"""Training-step benchmarks of `tiny-cpu` (the `cipher-train` default), each side by side in one process.

    python benchmarks/train_step.py [--bench monitor|compile|ac|clip|all] [--steps 30] [--rounds 3] [a.b=c ...]
    python benchmarks/train_step.py --bench versions --other ../old-checkout [--threads 2]
    python benchmarks/train_step.py --bench clip [--config examples/configs/tiny-cpu-90s.yaml] [--rounds 200]

monitor: step time and tokens/s with and without the callbacks that watch a run: what watching it costs. One
trainer is built the way `cipher-train` builds it; the contenders alternate for `--rounds` rounds of `--steps`
optimizer steps (logging every `training.log_every` steps in both, so the log-row work is in both) and each keeps its
median step time. "bare": only the callbacks that change what trains (`TRAINING`: the curriculum, the experts'
balancing, the boundary schedule, the weight average, the expert-parallel gradients). "full": every callback the run
was built with, so also the monitor (stats into every log row, threat checks), the utilization meter and any optional
loggers. Checkpoints and evaluations are timed elsewhere. Goal (issue 7): the watchers cost under 3%.

compile: warm step time eager vs `training.compile=true` (each block compiled; the compilation happens in warm-up
steps that are not timed), for tiny-cpu and for its dense variant (`model.moe.n_routed=0`), bare steps as above (an
MoE's bias moves as in a run), the contenders alternating as above. A model whose compilation fails is reported
with the error. Goal (issue 20): compiled <= 0.8x eager.

ac: peak memory of one forward and backward of tiny-cpu at 2,048 tokens per sequence (where activations dominate the
parameters), with `training.activation_checkpoint` none / selective / full, measured with torch's `MemTracker`
(activations = the tensors autograd saves plus those recomputed, temporaries = the rest), and its time. Goal (issue
20): full <= 0.5x the activation memory of none.

versions: this checkout's default step against another checkout's (`--other`, e.g. a `git worktree` of an older
commit), each in its own process on `--threads` torch threads, the processes taking turns for `--rounds` rounds.
Each builds the trainer its own `cipher-train` builds with no arguments and times `--steps` steps of the loop's work
(the train step, plus the log row every `training.log_every` steps) after 5 warm-up steps; it reports the median ms
per step, bytes per second and its process's peak RSS. Goal (issue 26): tokens/s at least 1.3x, peak RSS no higher.

clip: the gradient clip of one step of `--config`'s model (default tiny-cpu), on the gradients of a real step: torch's
`clip_grad_norm_` over every gradient and again over each clip group (`optim.clip_groups`, the routed experts by
default), which is how the trainer clipped before `clip_grads`, against `Trainer.clip` (`clip_grads`: one read and one
write of each gradient). The two alternate for `--rounds` rounds, each from the same saved gradients, on the torch
threads the process has; the median ms of each, and the median step of the same trainer for scale.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from cipher_nb.config.load import load_config
from cipher_nb.data.curriculum import Curriculum
from cipher_nb.model.lm import CipherModel
from cipher_nb.optim.ema import WeightAverage
from cipher_nb.optim.expert_parallel import ExpertParallel
from cipher_nb.optim.parallel import AC_MODES, apply_ac
from cipher_nb.train.builder import BoundarySchedule, MoEBalancing, build_trainer

QUIET = ["schedule.max_steps=100000", "training.eval_every=100000", "training.checkpoint_every=100000"]


# the callbacks that change what trains: a bare step keeps them, so that its model trains as a run's does
TRAINING = (Curriculum, MoEBalancing, BoundarySchedule, WeightAverage, ExpertParallel)


def training_callbacks(callbacks) -> list:
    "Those of `callbacks` that change what trains (`TRAINING`), in their order; the rest watch the run."
    return [cb for cb in callbacks if isinstance(cb, TRAINING)]


def timed_steps(trainer, callbacks, n) -> float:
    "Seconds per optimizer step over `n` steps of `fit` with `callbacks` in place of the trainer's."
    trainer.callbacks = list(callbacks)
    trainer.schedule.max_steps = trainer.cfg.schedule.max_steps = trainer.step + n  # the trainer's plan, read by fit
    t0 = time.perf_counter()
    trainer.fit(progress=False)
    return (time.perf_counter() - t0) / n


def bare_trainer(cfg, run_dir):
    "A trainer built as `cipher-train` builds it, without checkpoints, evaluations or a run record."
    tr = build_trainer(cfg, run_dir)
    tr.checkpoints = tr.eval_fn = None  # checkpoints and evaluations are timed elsewhere
    tr.callbacks = [cb for cb in tr.callbacks if cb is not tr.record]
    return tr


VERSION_CHILD = """
import json, resource, sys, tempfile, time, warnings
from cipher_nb.config.load import load_config
from cipher_nb.train.builder import build_trainer
warnings.simplefilter("ignore")
steps = int(sys.argv[1])
cfg = load_config(None, sys.argv[2:])
with tempfile.TemporaryDirectory() as d:
    tr = build_trainer(cfg, d, progress=False)
    window, t = [], cfg.training
    for _ in range(5):
        tr.train_step()
    t0 = time.perf_counter()
    for _ in range(steps):
        window.append(tr.train_step())
        if tr.due(t.log_every):
            tr.log_row(window, 1.0)
            window = []
    s = (time.perf_counter() - t0) / steps
rss = int(next(x for x in open("/proc/self/status") if x.startswith("VmHWM")).split()[1]) * 1024
print(json.dumps(dict(seconds=s, tokens=t.batch_size * t.seq_len * t.grad_accum, peak_rss=rss)))
"""


def version_step(root: Path, a) -> dict:
    "One timing of the default step by the checkout at `root`, in a fresh process."
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": str(a.threads)}
    cmd = [sys.executable, "-c", VERSION_CHILD, str(a.steps), *QUIET, *a.overrides]
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def git_rev(root: Path) -> str:
    r = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or str(root)


def bench_versions(a):
    if not a.other:
        raise SystemExit("--bench versions needs --other PATH: a checkout to compare with (git worktree add PATH REV)")
    roots = {"this": Path(__file__).resolve().parent.parent, "other": Path(a.other).resolve()}
    runs = {k: [] for k in roots}
    for r in range(a.rounds):
        for k in list(roots)[r % 2 :] + list(roots)[: r % 2]:  # the order alternates every round
            runs[k].append(version_step(roots[k], a))
    base = statistics.median(x["seconds"] for x in runs["other"])
    print(f"the default step, {a.threads} torch thread(s), median of {a.rounds} processes x {a.steps} steps")
    print(f"{'checkout':<24}{'ms/step':>9}{'bytes/s':>9}{'x other':>9}{'peak RSS MiB':>14}")
    for k, xs in runs.items():
        s = statistics.median(x["seconds"] for x in xs)
        rss = max(x["peak_rss"] for x in xs) / 2**20
        label = f"{k} ({git_rev(roots[k])})"
        print(f"{label:<24}{1000 * s:>9.1f}{xs[0]['tokens'] / s:>9.0f}{base / s:>9.2f}{rss:>14.0f}")


def bench_monitor(a):
    cfg = load_config(None, [*QUIET, *a.overrides])
    with tempfile.TemporaryDirectory() as d:
        tr = bare_trainer(cfg, d)
        with_all, bare = list(tr.callbacks), training_callbacks(tr.callbacks)
        timed_steps(tr, with_all, 5)  # warm-up: allocator, first log row
        times = {"bare": [], "full": []}
        for _ in range(a.rounds):
            times["bare"].append(timed_steps(tr, bare, a.steps))
            times["full"].append(timed_steps(tr, with_all, a.steps))
    t = cfg.training
    tokens = t.batch_size * t.seq_len * t.grad_accum
    base = statistics.median(times["bare"])
    print(f"tiny-cpu step ({tokens} tokens, log every {t.log_every}), median of {a.rounds} rounds x {a.steps} steps")
    print(f"{'contender':<10}{'ms/step':>10}{'tok/s':>10}{'x bare':>9}   callbacks")
    for name, ts in times.items():
        s = statistics.median(ts)
        names = ", ".join(type(c).__name__ for c in (with_all if name == "full" else bare)) or "-"
        print(f"{name:<10}{1000 * s:>10.1f}{tokens / s:>10.0f}{s / base:>9.3f}   {names}")
    over = statistics.median(times["full"]) / base - 1
    print(f"overhead of the watching callbacks: {100 * over:+.1f}% (goal < 3%)")


def bench_clip(a):
    cfg = load_config(a.config, [*QUIET, *a.overrides])
    with tempfile.TemporaryDirectory() as d:
        tr = bare_trainer(cfg, d)
        steps = []
        for _ in range(20):  # warm-up, then the step's own time for scale
            t0 = time.perf_counter()
            tr.train_step()
            steps.append(time.perf_counter() - t0)
        tr.forward_backward([next(tr.batches)])
        params = [p for p in tr.model.parameters() if p.grad is not None]
        saved = [p.grad.clone() for p in params]
        limit, limits = cfg.optim.grad_clip or float("inf"), cfg.optim.clip_groups

        def torch_twice():
            torch.nn.utils.clip_grad_norm_(params, limit)
            for k, group in tr.clip_groups.items():
                torch.nn.utils.clip_grad_norm_([p for p in group if p.grad is not None], limits[k])

        times = {"clip_grad_norm_ twice": [], "clip_grads": []}
        for _ in range(a.rounds):
            for name, fn in (("clip_grad_norm_ twice", torch_twice), ("clip_grads", tr.clip)):
                torch._foreach_copy_([p.grad for p in params], saved)
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    step = 1000 * statistics.median(steps[5:])
    n = sum(g.numel() for g in saved)
    grouped = sum(p.grad.numel() for ps in tr.clip_groups.values() for p in ps if p.grad is not None)
    print(f"clip of one step of {a.config or 'tiny-cpu'}: {n} gradient values, {grouped} in clip groups {limits}")
    print(f"{torch.get_num_threads()} torch threads, median of {a.rounds} rounds; the step itself {step:.1f} ms")
    base = statistics.median(times["clip_grad_norm_ twice"])
    print(f"{'contender':<24}{'ms':>8}{'x twice':>9}{'% of step':>11}")
    for name, ts in times.items():
        s = statistics.median(ts)
        print(f"{name:<24}{1000 * s:>8.3f}{s / base:>9.2f}{100000 * s / step:>11.2f}")


def compile_times(a, model_overrides) -> dict:
    "Median warm ms/step of eager and compiled trainers on the same config (or the compile error), alternating."
    trainers, times = {}, {}
    with tempfile.TemporaryDirectory() as d:
        for name, extra in (("eager", []), ("compiled", ["training.compile=true"])):
            cfg = load_config(None, [*QUIET, *model_overrides, *extra, *a.overrides])
            tr = bare_trainer(cfg, f"{d}/{name}")
            bare = training_callbacks(tr.callbacks)
            t0 = time.perf_counter()
            try:
                timed_steps(tr, bare, 3)  # warm-up (compilation for the compiled one)
            except Exception as e:  # a block that does not compile: report why
                times[name] = f"fails: {type(e).__name__}: {str(e).strip().splitlines()[0][:150]}"
                continue
            print(f"  {name}: 3 warm-up steps (compilation included) {time.perf_counter() - t0:.1f} s", flush=True)
            trainers[name], times[name] = (tr, bare), []
        for _ in range(a.rounds):
            for name, (tr, bare) in trainers.items():
                times[name].append(timed_steps(tr, bare, a.steps))
    return {k: v if isinstance(v, str) else 1000 * statistics.median(v) for k, v in times.items()}


def bench_compile(a):
    print(f"warm step time, eager vs compiled blocks, median of {a.rounds} rounds x {a.steps} steps")
    print(f"{'model':<22}{'eager ms':>10}{'compiled ms':>13}{'ratio':>8}")
    for label, over in (("tiny-cpu (MoE)", []), ("tiny-cpu dense", ["model.moe.n_routed=0"])):
        t = compile_times(a, over)
        if isinstance(t["compiled"], str):
            print(f"{label:<22}{t['eager']:>10.1f}   compiled {t['compiled']}")
        else:
            print(f"{label:<22}{t['eager']:>10.1f}{t['compiled']:>13.1f}{t['compiled'] / t['eager']:>8.2f}")


def ac_memory(cfg, mode, batch: int) -> dict:
    "Peak MiB by kind and seconds of one forward and backward of `cfg`'s model checkpointed with `mode`."
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    m = apply_ac(CipherModel(cfg.model), mode)
    x = torch.randint(0, cfg.model.vocab, (batch, cfg.training.seq_len))
    secs = []
    for _ in range(3):  # the first is a warm-up (allocator, kernels); the time is the median without the tracker
        t0 = time.perf_counter()
        out = m(x, labels=x)
        (out.loss + sum(out.aux.values())).backward()
        secs.append(time.perf_counter() - t0)
        m.zero_grad(set_to_none=True)
    mt = MemTracker()
    mt.track_external(m)
    with mt:
        out = m(x, labels=x)
        (out.loss + sum(out.aux.values())).backward()
    secs = statistics.median(secs[1:])
    peak = {
        str(k).removeprefix("_MemRefType."): v / 2**20
        for k, v in mt.get_tracker_snapshot("peak")[torch.device("cpu")].items()
    }
    return dict(peak, seconds=secs)


def bench_ac(a):
    cfg = load_config(None, [*QUIET, "training.seq_len=2048", *a.overrides])
    batch = 2
    rows = {mode: ac_memory(cfg, mode, batch) for mode in AC_MODES}
    print(f"one forward + backward of tiny-cpu, {batch} x {cfg.training.seq_len} tokens, peak MiB (MemTracker)")
    print(f"{'checkpoint':<11}{'act MiB':>9}{'x none':>8}{'temp MiB':>10}{'total MiB':>11}{'x none':>8}{'s':>7}")
    base = rows["none"]
    for mode, r in rows.items():
        print(
            f"{mode:<11}{r['ACT']:>9.1f}{r['ACT'] / base['ACT']:>8.2f}{r['TEMP']:>10.1f}{r['Total']:>11.1f}"
            f"{r['Total'] / base['Total']:>8.2f}{r['seconds']:>7.2f}"
        )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", choices=["monitor", "compile", "ac", "versions", "clip", "all"], default="monitor")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--other", help="versions: the checkout to compare this one with")
    p.add_argument("--threads", type=int, default=2, help="versions: torch threads of each process")
    p.add_argument("--config", help="clip: the model's preset (default tiny-cpu)")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    benches = (
        ("monitor", bench_monitor),
        ("compile", bench_compile),
        ("ac", bench_ac),
        ("versions", bench_versions),
        ("clip", bench_clip),
    )
    for name, fn in benches:
        if a.bench == name or (a.bench == "all" and name != "versions"):
            fn(a)


if __name__ == "__main__":
    main()
