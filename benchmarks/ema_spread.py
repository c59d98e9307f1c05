"""Weight averaging against schedule-length noise: one seed of a config trained to several step counts, and each run's
final held-out bits per byte with its trained weights and with `optim.ema`'s average of them.

    python benchmarks/ema_spread.py --config examples/configs/tiny-cpu-90s.yaml --steps 760,800,840 --ema 0.99

One run per length gives both numbers: the average changes no trained weight (tests/test_ema.py), so the run with
`optim.ema` on is the run without it, evaluated twice at its end on the same held-out batches. The spread of a row is
max - min over the lengths. Prints a markdown table; `--out FILE.json` keeps every run.
"""

import argparse
import json
import tempfile
import time

import torch
from bench_args import int_list

from cipher_nb.config.load import load_config
from cipher_nb.data.codecs import build_codec
from cipher_nb.monitor.metrics import heldout_metrics
from cipher_nb.train.builder import build_trainer


def final_bpb(config: str, steps: int, ema: float, seed: int, overrides: list) -> dict:
    "Train `steps` fixed steps (no time budget); the held-out bpb of the trained weights and of their average."
    plan = [f"schedule.max_steps={steps}", "schedule.time_budget=", f"optim.ema={ema}", f"training.seed={seed}"]
    quiet = [f"training.eval_every={steps}", f"training.checkpoint_every={steps}", "training.log_every=100"]
    cfg = load_config(config, [*overrides, *plan, *quiet])
    with tempfile.TemporaryDirectory() as run:
        tr = build_trainer(cfg, run, progress=False)
        t0 = time.perf_counter()
        tr.fit(progress=False)
        seconds = time.perf_counter() - t0
        lengths = torch.as_tensor(build_codec(cfg.data).byte_lengths)
        trained = heldout_metrics(tr.model, tr.heldout, lengths, tr.device, tr.dtype, tr.env)["val/bpb"]
        with tr.checkpoints.average.applied(tr.raw_model):
            averaged = heldout_metrics(tr.model, tr.heldout, lengths, tr.device, tr.dtype, tr.env)["val/bpb"]
    return dict(steps=steps, seed=seed, ema=ema, trained=trained, averaged=averaged, seconds=round(seconds, 1))


def table(runs: list) -> str:
    "The markdown table of the runs, and each column's spread over the lengths."
    lines = ["| steps | bpb, trained weights | bpb, average | average - trained |", "|---|---|---|---|"]
    for r in runs:
        lines.append(
            f"| {r['steps']} | {r['trained']:.4f} | {r['averaged']:.4f} | {r['averaged'] - r['trained']:+.4f} |"
        )
    spread = {k: max(r[k] for r in runs) - min(r[k] for r in runs) for k in ("trained", "averaged")}
    ratio = spread["averaged"] / spread["trained"] if spread["trained"] else float("nan")
    lines.append(f"| spread (max - min) | {spread['trained']:.4f} | {spread['averaged']:.4f} | x{ratio:.2f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="examples/configs/tiny-cpu-90s.yaml")
    p.add_argument("--steps", type=int_list, default="760,800,840", help="the schedule lengths, comma-separated")
    p.add_argument("--ema", type=float, default=0.99, help="optim.ema of every run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="a JSON file for every run")
    p.add_argument("overrides", nargs="*", help="a.b=c config overrides for every run")
    a = p.parse_args()
    if not 0 < a.ema < 1:
        p.error(f"--ema {a.ema}: give a decay in (0, 1)")
    torch.set_num_threads(1)
    runs = []
    for steps in a.steps:
        runs.append(final_bpb(a.config, steps, a.ema, a.seed, a.overrides))
        print(json.dumps(runs[-1]), flush=True)
    print(table(runs))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(config=a.config, overrides=a.overrides, runs=runs), f, indent=1)


if __name__ == "__main__":
    main()
