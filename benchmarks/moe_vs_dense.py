"""The MoE against dense, one record: reads `benchmarks/quality.py` results (its `--out`.json) and writes each
budget's and recipe's verdict on the MoE - dense held-out bits per byte to `benchmarks/results/moe-vs-dense.json`.

    python benchmarks/moe_vs_dense.py benchmarks/results/2026-12-05-moe-vs-dense-90s-default.json \
        --recipe default --budget 90s --max-seeds 5

The scaling sweep's compute multiplier (`benchmarks/scaling.py --out`.json) joins the same record, with the paired
verdict over its matched runs (MoE - dense at each width, budget and seed: equal FLOPs, run by run) and, where the
sweep has it, the multiplier read without the law from each budget's own minimum (`own_minima`):

    python benchmarks/moe_vs_dense.py --scaling benchmarks/results/2026-12-05-scaling-2.json

A record is keyed by (recipe, budget): adding one again replaces it, so the file holds each comparison's latest
figures, with the command that made them. The verdict is recomputed from the runs by the one function every ablation
uses (`cipher_nb.eval.verdict`): sequential when the comparison added seeds until decided (`--max-seeds`, the
`--seeds` it was planned for), else the 95% paired interval.
"""

import argparse
import json
from datetime import date
from pathlib import Path

from cipher_nb.eval.verdict import paired_verdict, sequential_verdict

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "benchmarks/results/moe-vs-dense.json"


def moe_minus_dense(runs: list, max_seeds: int = 0) -> dict:
    "The verdict on MoE - dense over the seeds both ran, from quality.py's runs ({name, seed, bpb})."
    bpb = {(r["name"], r["seed"]): r["bpb"] for r in runs}
    seeds = sorted(s for n, s in bpb if n == "moe" and ("dense", s) in bpb)
    if not seeds:
        raise ValueError("these results hold no seed that both 'moe' and 'dense' ran")
    a, b = [bpb["moe", s] for s in seeds], [bpb["dense", s] for s in seeds]
    names = ("MoE", "dense")
    v = sequential_verdict(a, b, max_seeds, names) if max_seeds else paired_verdict(a, b, names)
    return {**v, "seed_list": seeds, "moe_bpb": a, "dense_bpb": b}


def add_record(record: dict, recipe: str, budget: str, result: dict, max_seeds: int = 0, when: str = "") -> dict:
    "`record` with the (recipe, budget) comparison of one quality.py `result` set (replacing an older one)."
    entry = dict(
        recipe=recipe,
        budget=budget,
        date=when or date.today().isoformat(),
        command=result.get("command", ""),
        **moe_minus_dense(result["runs"], max_seeds),
    )
    rows = [r for r in record.get("comparisons", []) if (r["recipe"], r["budget"]) != (recipe, budget)]
    return {**record, "comparisons": sorted(rows + [entry], key=lambda r: (r["recipe"], r["budget"]))}


def matched_runs(runs: list) -> dict:
    "The paired verdict on MoE - dense over a sweep's fitted runs that both families ran at one width, budget, seed."
    bpb = {(r["family"], r["width"], r["budget"], r.get("seed", 0)): r["bpb"] for r in runs if not r["heldout"]}
    keys = sorted(k[1:] for k in bpb if k[0] == "moe" and ("dense", *k[1:]) in bpb)
    if not keys:
        raise ValueError("this sweep holds no run that both 'moe' and 'dense' ran")
    v = paired_verdict([bpb[("moe", *k)] for k in keys], [bpb[("dense", *k)] for k in keys], ("MoE", "dense"))
    v = {k: x for k, x in v.items() if k != "seeds"}  # its pairs are runs, counted below
    return {
        **v,
        "verdict": v["verdict"].replace("seeds", "matched runs"),
        "runs": len(keys),
        "sweep_seeds": len({k[2] for k in keys}),
    }


def add_multiplier(record: dict, sweep: dict, command: str = "", when: str = "") -> dict:
    "`record` with the sweep's compute multiplier at each budget and its matched runs' verdict (replacing older ones)."
    if not sweep.get("multiplier"):
        raise ValueError("this sweep result holds no multiplier (run benchmarks/scaling.py again)")
    rows = [
        dict(flops=m["C"], multiplier=m["multiplier"], low=m["lo_hi"][0], high=m["lo_hi"][1])
        for m in sweep["multiplier"]
    ]
    entry = dict(date=when or date.today().isoformat(), command=command, sweep=sweep.get("sweep", ""), budgets=rows)
    if sweep.get("minima_multiplier"):  # the same from each budget's own minimum, without the law (approach 2)
        entry["own_minima"] = [
            dict(flops=m["C"], multiplier=m["multiplier"], low=m["lo_hi"][0], high=m["lo_hi"][1])
            for m in sweep["minima_multiplier"]
        ]
    if sweep.get("runs"):
        entry["matched"] = matched_runs(sweep["runs"])
    return {**record, "multiplier": entry}


def read_json(path) -> dict:
    "The JSON in `path`; a file that is not JSON is named in the error."
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not a JSON result ({e})") from None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("result", nargs="?", help="a benchmarks/quality.py --out .json holding 'moe' and 'dense' runs")
    p.add_argument("--recipe", help="the recipe's name: default (tiny-cpu), 90s (tiny-cpu-90s), ...")
    p.add_argument("--budget", help="the budget as quality.py was given it: 90s, 8m")
    p.add_argument("--scaling", help="a benchmarks/scaling.py --out .json: record its compute multiplier")
    p.add_argument("--max-seeds", type=int, default=0, help="the planned seeds of a --sequential run (0: not one)")
    p.add_argument("--out", default=str(RECORD), help="the record to update")
    a = p.parse_args()
    if not (a.result or a.scaling) or (a.result and not (a.recipe and a.budget)):
        p.error("give a quality.py result with --recipe and --budget, or --scaling SWEEP.json, or both")
    out = Path(a.out)
    try:  # a missing or foreign file is the user's to fix: one line, exit 2, the record untouched
        record = read_json(out) if out.exists() else {}
        if a.result:
            record = add_record(record, a.recipe, a.budget, read_json(a.result), a.max_seeds)
        if a.scaling:
            sweep = read_json(a.scaling)
            seeds = len({r.get("seed", 0) for r in sweep.get("runs", [])})
            cmd = f"python benchmarks/scaling.py --sweep {sweep.get('sweep', '')}"
            cmd += f" --seeds {seeds}" if seeds > 1 else ""
            record = add_multiplier(record, sweep, cmd)
    except KeyError as e:
        p.error(f"a result lacks the field {e}: give a benchmarks/quality.py or benchmarks/scaling.py --out .json")
    except (OSError, ValueError) as e:
        p.error(str(e))
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(out)  # a kill mid-write leaves the old record whole
    for m in record.get("multiplier", {}).get("budgets", []):
        print(f"compute multiplier at {m['flops']:.3g} FLOPs: {m['multiplier']:.3g} [{m['low']:.3g}, {m['high']:.3g}]")
    for m in record.get("multiplier", {}).get("own_minima", []):
        print(f"  without the law, at {m['flops']:.3g}: {m['multiplier']:.3g} [{m['low']:.3g}, {m['high']:.3g}]")
    if "matched" in record.get("multiplier", {}):
        v = record["multiplier"]["matched"]
        iv = f"[{v['low']:+.4f}, {v['high']:+.4f}]"
        print(f"matched runs (equal FLOPs): MoE - dense {v['mean']:+.4f} {iv} over {v['runs']}: {v['verdict']}")
    for r in record.get("comparisons", []):
        iv = f"[{r['low']:+.4f}, {r['high']:+.4f}]"
        print(f"{r['recipe']:>8} {r['budget']:>4}: MoE - dense {r['mean']:+.4f} {iv} over {r['seeds']}: {r['verdict']}")


if __name__ == "__main__":
    main()
