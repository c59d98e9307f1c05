"""Issue 49's routing targets, read from a run's `metrics.jsonl`: per MoE layer, the worst 50-step window of the
window-averaged per-expert load (its busiest expert over the mean; target: at most 2x), and the longest stretch, in
steps, that any expert spends under a quarter of an even share (target: at most 50), both from step 30.

    python benchmarks/routing_targets.py RUN [RUN ...]

The loads are the monitor's per-expert loads (each expert's share over the mean: 1 is an even share), one value per
logged row, read as the gate and the plots read them (`cipher_nb.monitor.health.row_loads`: the row's
`router/layerN_load_E` keys, or `expert_loads.jsonl` for a model over 1,024 experts), so the stretch counts the log
interval per row under a quarter. Beside them, where the run logged it, the median from step 30 of
`router/layerN_batch_max_load`: one batch's busiest expert over the mean, averaged over each row's forwards. Far
above the window's figure, it says the busiest expert changes from batch to batch (each batch still goes mostly to one
expert), which window-averaged loads cannot show. The last `val/bpb` is printed beside them.
"""

import argparse
import json
import statistics
from pathlib import Path

from cipher_nb.monitor.health import LOADS_FILE, attach_loads, row_loads


def read_rows(run: Path) -> list:
    "The run's metrics rows, with the per-expert loads of `LOADS_FILE` attached when it wrote one."
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return attach_loads(rows, run / LOADS_FILE)


def layer_loads(rows: list) -> dict:
    "{layer: (steps [rows], loads [rows][experts])} over the rows that logged every layer's loads."
    rows = [(r["step"], row_loads(r)) for r in rows]
    rows = [(s, x) for s, x in rows if x]
    layers = sorted(rows[0][1]) if rows else []
    return {L: ([s for s, _ in rows], [x[L] for _, x in rows]) for L in layers}


def worst_window(steps: list, loads: list, start: int = 30, width: int = 50) -> float:
    "The largest busiest-over-mean of the window-averaged loads, over the `width`-step windows from `start`."
    worst = 0.0
    for w0 in range(start, steps[-1] + 1, width):
        rows = [x for s, x in zip(steps, loads) if w0 <= s < w0 + width]
        if rows:
            mean = [sum(col) / len(rows) for col in zip(*rows)]
            worst = max(worst, max(mean) / (sum(mean) / len(mean)))
    return worst


def longest_starved(steps: list, loads: list, start: int = 30, below: float = 0.25) -> int:
    "The most consecutive steps (rows x log interval) any expert spends under `below` of an even share."
    every = steps[1] - steps[0] if len(steps) > 1 else 1
    longest = 0
    for e in range(len(loads[0])):
        run = 0
        for s, x in zip(steps, loads):
            if s >= start:
                run = run + every if x[e] < below else 0
                longest = max(longest, run)
    return longest


def batch_busiest(rows: list, layer: int, start: int = 30) -> float | None:
    "The median from `start` of the rows' `router/layer{layer}_batch_max_load` (None: the run did not log it)."
    xs = [r[k] for r in rows if r.get("step", 0) >= start and (k := f"router/layer{layer}_batch_max_load") in r]
    return statistics.median(xs) if xs else None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="run directories written by cipher-train")
    for run in map(Path, p.parse_args().runs):
        rows = read_rows(run)
        layers = layer_loads(rows)
        if not layers:
            raise SystemExit(f"routing_targets: {run} logged no per-expert loads (router/layerN_load_E)")
        parts = []
        for L, (s, x) in layers.items():
            b = batch_busiest(rows, L)
            per_batch = "" if b is None else f", per batch {b:.2f}x"
            parts.append(f"L{L}: {worst_window(s, x):.2f}x, {longest_starved(s, x)} starved{per_batch}")
        bpb = [r["val/bpb"] for r in rows if "val/bpb" in r]
        print(f"{run.name}: " + " | ".join(parts) + (f" | val/bpb {bpb[-1]:.4f}" if bpb else ""))


if __name__ == "__main__":
    main()
