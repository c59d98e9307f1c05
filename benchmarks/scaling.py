"""A scaling sweep of the dense and the MoE family of the default model: isoFLOP sets, a fitted law per family with
bootstrap intervals, a held-out larger configuration predicted before it trains, the compute-optimal frontiers and
where they cross; and, without the law, each budget's own minimum (Chinchilla's approach 2) and the multiplier it gives.

    python benchmarks/scaling.py --sweep full --root runs/scaling --out benchmarks/results/2026-12-02-scaling --jobs 2
    python benchmarks/scaling.py --refit OLD.json --out NEW    # the fits and tables again, from a sweep's rows
    python benchmarks/scaling.py --refit OLD.json --out NEW --predict 48@1e13   # and a prediction, then its runs

The sweeps are `cipher_nb.eval.scaling`'s SMALL_SWEEP and FULL_SWEEP, the ones `examples/04_scaling.ipynb` runs, and
DEEP_SWEEP (`--sweep deep`): the full one with three seeds and a larger budget at the narrowest widths.
Runs are reused (`run_once`), so an interrupted sweep picks up where it stopped. The held-out runs' predictions are
written to OUT.json before they train. Writes OUT.json (every run, each law, the predictions), OUT.md and OUT.png.
`--refit` trains nothing: it reads the runs of an earlier OUT.json (held-out ones included) and fits and reports them.
`--predict WIDTH@FLOPS` (repeatable) adds held-out configurations beyond the sweep: each family's prediction is
written to OUT.json, then its run trains (into ROOT, reused when finished), and the table sets them beside the sweep's.
"""

import argparse
import dataclasses
import json
import resource
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from cipher_nb.eval.scaling import (
    DEEP_SWEEP,
    FULL_SWEEP,
    SMALL_SWEEP,
    compute_multiplier,
    crossing,
    fit_families,
    frontier,
    isoflop_minima,
    minima_multiplier,
    run_sweep,
    sweep_runs,
    train_runs,
)
from cipher_nb.eval.verdict import paired_verdict, verdict_line
from cipher_nb.viz.plots import plot_frontiers, plot_isoflops

SWEEPS = {"small": SMALL_SWEEP, "full": FULL_SWEEP, "deep": DEEP_SWEEP}
PARAMS = ("E", "A", "alpha", "B", "beta")


def cpu_clock() -> float:
    "CPU seconds of this process and of its children that have ended (the --jobs workers, once their pool closes)."
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def law_rows(fits: dict) -> dict:
    "Each family's fitted parameters with the 95% bootstrap interval of each, and the rms of its residuals."
    rms = {f: float(np.sqrt(np.mean(fit.residuals**2))) for f, fit in fits.items()}
    return {f: {k: list(v) for k, v in fit.intervals().items()} | {"residual_rms": rms[f]} for f, fit in fits.items()}


def predictions(fits: dict, sweep) -> list:
    "The fit's prediction, with its 95% interval, for each family's held-out configuration."
    out = []
    for r in (r for r in sweep_runs(sweep) if r["heldout"]):
        pred, lo, hi = fits[r["family"]].predict(r["N"], r["tokens"])
        out.append(dict(name=r["name"], family=r["family"], N=r["N"], tokens=r["tokens"], pred=pred, lo=lo, hi=hi))
    return out


def matched(rows: list, a: str = "dense", b: str = "moe") -> tuple:
    "The table of b - a at each width and budget both families ran (over its seeds), and the paired verdict over runs."
    bpb = {(r["family"], r["width"], r["budget"], r.get("seed", 0)): r["bpb"] for r in rows if not r["heldout"]}
    keys = sorted({k[1:] for k in bpb if k[0] == a and (b, *k[1:]) in bpb})  # (width, budget, seed)
    diff = {k: bpb[(b, *k)] - bpb[(a, *k)] for k in keys}
    budgets = sorted({c for _, c, _ in keys})
    lines = [
        "| width | " + " | ".join(f"{b} - {a} at {c:.0e}" for c in budgets) + " |",
        "|---" * (1 + len(budgets)) + "|",
    ]
    for w in sorted({w for w, _, _ in keys}):
        ds = [[d for (w2, c2, _), d in diff.items() if (w2, c2) == (w, c)] for c in budgets]
        lines.append(f"| {w} | " + " | ".join(f"{np.mean(d):+.4f}" if d else "" for d in ds) + " |")
    v = paired_verdict([bpb[(a, *k)] for k in keys], [bpb[(b, *k)] for k in keys], (a, b))
    return "\n".join(lines), verdict_line(v).replace("seeds", "matched runs")


def report(res: dict) -> str:
    "The markdown tables of a finished sweep."
    lines = ["| run | N | steps | tokens | FLOPs | bpb |", "|---|---|---|---|---|---|"]
    for r in res["runs"]:
        held = " (held out)" if r["heldout"] else ""
        lines.append(
            f"| {r['name']}{held} | {r['N']:,.0f} | {r['steps']} | {r['tokens']:,} | {r['flops']:.3g} "
            f"| {r['bpb']:.4f} |"
        )
    lines += ["", "| family | " + " | ".join(PARAMS) + " | residual rms |", "|---" * (len(PARAMS) + 2) + "|"]
    for family, law in res["laws"].items():
        cells = [f"{v:.3g} [{lo:.3g}, {hi:.3g}]" for v, lo, hi in (law[k] for k in PARAMS)]
        lines.append(f"| {family} | " + " | ".join(cells) + f" | {law['residual_rms']:.4f} |")
    lines += ["", "| held out | predicted bpb [95%] | measured | error | covered |", "|---|---|---|---|---|"]
    for p in res["predictions"]:
        err = p["measured"] - p["pred"]
        covered = "yes" if p["lo"] <= p["measured"] <= p["hi"] else "no"
        lines.append(
            f"| {p['name']} | {p['pred']:.4f} [{p['lo']:.4f}, {p['hi']:.4f}] | {p['measured']:.4f} | {err:+.4f} "
            f"| {covered} |"
        )
    lines += ["", "| FLOPs | family | N* [95%] | bpb* [95%] | vs first family |", "|---|---|---|---|---|"]
    first = {r["C"]: r["L"] for r in res["frontier"] if r["family"] == res["frontier"][0]["family"]}
    for r in res["frontier"]:
        lines.append(
            f"| {r['C']:.3g} | {r['family']} | {r['N']:,.0f} [{r['N_lo_hi'][0]:,.0f}, {r['N_lo_hi'][1]:,.0f}] "
            f"| {r['L']:.4f} [{r['L_lo_hi'][0]:.4f}, {r['L_lo_hi'][1]:.4f}] | x{r['L'] / first[r['C']]:.4f} |"
        )
    table, line = matched(res["runs"])
    each = "each width, budget and seed; a cell above: the mean over seeds"
    lines += ["", table, "", f"Paired over the matched runs ({each}): {line}."]
    cross = res["crossing"]
    lines += ["", f"Crossing of the frontiers inside the fitted budgets: {f'{cross:.3g} FLOPs' if cross else 'none'}."]
    if res.get("multiplier"):
        lines += ["", "| FLOPs | compute multiplier [95%]: the dense FLOPs that reach the MoE's loss, over the MoE's |"]
        lines += ["|---|---|"]
        lines += [
            f"| {m['C']:.3g} | {m['multiplier']:.3g} [{m['lo_hi'][0]:.3g}, {m['lo_hi'][1]:.3g}] |"
            for m in res["multiplier"]
        ]
    if res.get("minima") is not None:
        lines += ["", minima_text(res)]
    return "\n".join(lines)


def minima_text(res: dict) -> str:
    "The table of each budget's own minimum (approach 2) beside the law's optimum, and the two multipliers."
    law = {(r["family"], r["C"]): r for r in res["frontier"]}
    lines = [
        "Without the law (approach 2): a parabola in ln N through each budget's lowest mean bpb and two widths either "
        "side; a budget whose lowest run is at the grid's edge has no row.",
        "",
        "| FLOPs | family | N* [95%], own minimum | bpb* [95%], own minimum | N*, law | bpb*, law |",
        "|---|---|---|---|---|---|",
    ]
    for m in res["minima"]:
        f = law.get((m["family"], m["C"]))
        lines.append(
            f"| {m['C']:.3g} | {m['family']} | {m['N']:,.0f} [{m['N_lo_hi'][0]:,.0f}, {m['N_lo_hi'][1]:,.0f}] "
            f"| {m['L']:.4f} [{m['L_lo_hi'][0]:.4f}, {m['L_lo_hi'][1]:.4f}] | "
            + (f"{f['N']:,.0f} | {f['L']:.4f} |" if f else " | |")
        )
    by_law = {m["C"]: m for m in res.get("multiplier") or []}
    lines += ["", "| FLOPs | compute multiplier [95%], the law | the budgets' own minima |", "|---|---|---|"]
    for m in res["minima_multiplier"]:
        a = by_law.get(m["C"])
        cell = f"{a['multiplier']:.3g} [{a['lo_hi'][0]:.3g}, {a['lo_hi'][1]:.3g}]" if a else ""
        lines.append(f"| {m['C']:.3g} | {cell} | {m['multiplier']:.3g} [{m['lo_hi'][0]:.3g}, {m['lo_hi'][1]:.3g}] |")
    return "\n".join(lines)


def multipliers(fits: dict, budgets: list) -> list:
    "The MoE's compute multiplier over the dense family at each budget, with its paired bootstrap interval."
    return [compute_multiplier(fits["dense"], fits["moe"], C) for C in budgets] if {"dense", "moe"} <= set(fits) else []


def own_minima(rows: list, boot: int) -> tuple:
    "Approach 2: each budget's own minimum per family, and the MoE's multiplier at each budget it brackets."
    mins = isoflop_minima(rows, boot=boot)
    ms = [minima_multiplier(mins, m["C"]) for m in mins if m["family"] == "moe"]
    return mins, [m for m in ms if m]


def train_and_fit(a, out: Path) -> tuple:
    "Train the sweep's fitted runs, fit them, write the held-out predictions, then train the held-out runs."
    sweep, root = SWEEPS[a.sweep], Path(a.root) / a.sweep
    given = dict(lr_width=a.lr_width, seeds=a.seeds, max_cpu_hours=a.max_cpu_hours)
    sweep = dataclasses.replace(sweep, **{k: v for k, v in given.items() if v is not None})
    for pt in a.predict:  # a --predict point the sweep cannot lay out is refused before anything trains
        sweep_runs(dataclasses.replace(sweep, heldout=pt))
    rows = run_sweep(sweep, root, jobs=a.jobs)
    fits = fit_families(rows, boot=a.boot)
    res = dict(sweep=a.sweep, runs=rows, laws=law_rows(fits), predictions=predictions(fits, sweep))
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))  # the predictions, before the held-out runs
    held = {r["name"]: r for r in run_sweep(sweep, root, heldout=True, jobs=a.jobs)}
    return rows, held, res, fits, sweep


def predict_more(fits: dict, sweep, points: list, root: Path, out: Path, res: dict, jobs: int) -> dict:
    "Each family's prediction at each (width, budget), written to OUT.json before those runs train; their rows."
    more = [dataclasses.replace(sweep, heldout=pt) for pt in points]
    res["predictions"] += [pr for s in more for pr in predictions(fits, s)]
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    runs = [r for s in more for r in sweep_runs(s) if r["heldout"]]
    return {r["name"]: r for r in train_runs(sweep.config, runs, root, jobs)}  # one pool: no core waits for a pair


def width_at_flops(text: str) -> tuple:
    "A --predict point: WIDTH@FLOPS, e.g. 48@1e13."
    try:
        w, c = text.split("@")
        return int(w), float(c)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not WIDTH@FLOPS (e.g. 48@1e13)") from None


def refit(old: Path, boot: int) -> tuple:
    "The same from the runs of an earlier, finished OUT.json: nothing trains."
    try:
        prev = json.loads(old.read_text())
        runs, sweep = prev["runs"], SWEEPS[prev["sweep"]]
        rows, held = [r for r in runs if not r["heldout"]], {r["name"]: r for r in runs if r["heldout"]}
        fits = fit_families(rows, boot=boot)
        res = dict(sweep=prev["sweep"], runs=rows, laws=law_rows(fits), predictions=predictions(fits, sweep))
        missing = [pr["name"] for pr in res["predictions"] if pr["name"] not in held]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--refit {old}: not a sweep's OUT.json ({type(e).__name__}: {e}); give one scaling.py wrote")
    if missing:
        raise ValueError(f"--refit {old}: the held-out run {missing[0]} has no row; finish the sweep first")
    return rows, held, res, fits, sweep


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", choices=sorted(SWEEPS), default="small")
    p.add_argument("--root", default="runs/scaling", help="where the runs go (reused when finished)")
    p.add_argument("--out", required=True, help="OUT.json, OUT.md and OUT.png are written")
    p.add_argument("--boot", type=int, default=200, help="bootstrap resamples of each fit")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--jobs", type=int, default=1, help="runs trained at a time, each a process on one torch thread")
    p.add_argument("--lr-width", type=float, help="schedule.lr = LR_WIDTH / width (default: the sweep's own)")
    p.add_argument("--seeds", type=int, help="runs of each fitted point (default: the sweep's own, 1)")
    p.add_argument("--max-cpu-hours", type=float, help="the sweep's cost cap (default: the sweep's own)")
    p.add_argument("--refit", metavar="OLD.json", help="train nothing: fit and report the runs of an earlier OUT.json")
    p.add_argument(
        "--predict",
        type=width_at_flops,
        action="append",
        default=[],
        metavar="WIDTH@FLOPS",
        help="also predict, then train, this held-out configuration (repeatable)",
    )
    a = p.parse_args()
    if a.refit and any(v is not None for v in (a.lr_width, a.seeds, a.max_cpu_hours)):
        p.error(
            "--refit fits the runs as they ran: --lr-width, --seeds and --max-cpu-hours are for a sweep that trains"
        )
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    t0 = cpu_clock()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if a.refit:
                rows, held, res, fits, sweep = refit(Path(a.refit), a.boot)
            else:
                rows, held, res, fits, sweep = train_and_fit(a, out)
            if a.predict:
                held |= predict_more(fits, sweep, a.predict, Path(a.root) / res["sweep"], out, res, a.jobs)
        except ValueError as e:  # over its CPU cap, a budget too small for a width, too few runs, a bad OUT.json
            p.error(str(e))
    for pr in res["predictions"]:
        pr["measured"] = held[pr["name"]]["bpb"]
    budgets = sorted({r["budget"] for r in rows})
    families = list(fits)
    res |= dict(
        runs=rows + list(held.values()),
        frontier=frontier(fits, budgets + [10 * budgets[-1]]),
        crossing=crossing(fits[families[0]].law, fits[families[-1]].law, budgets[0], budgets[-1]),
        multiplier=multipliers(fits, budgets + [10 * budgets[-1]]),
    )
    mins, res["minima_multiplier"] = own_minima(rows, a.boot)
    res["minima"] = [{k: v for k, v in m.items() if k != "boot_L"} for m in mins]
    res["cpu_seconds"] = round(cpu_clock() - t0)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    out.with_suffix(".md").write_text(report(res) + "\n")
    fig_iso = plot_isoflops(rows, fits, mins)
    fig_iso.savefig(out.with_name(out.name + "-isoflops.png"), dpi=110)
    fig = plot_frontiers(fits, budgets + [10 * budgets[-1]], list(held.values()), res["crossing"])
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(report(res))
    print(f"CPU time of this invocation: {res['cpu_seconds']} s")


if __name__ == "__main__":
    main()
