"benchmarks/quality.py's comparison arithmetic: the per-seed difference from dense and the table built on it."

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("quality", Path(__file__).parent.parent / "benchmarks/quality.py")
quality = importlib.util.module_from_spec(spec)
spec.loader.exec_module(quality)


def run(name, seed, bpb):
    return dict(
        name=name,
        seed=seed,
        bpb=bpb,
        steps=10,
        tok_per_s=1.0,
        params=1e6,
        active=1e6,
        peak_gb=0.1,
        used=1.0,
        budget=8,
        clock="cpu",
        threads=1,
    )


def test_paired_matches_seeds_not_order():
    dense = [run("dense", 0, 2.0), run("dense", 1, 2.5)]
    moe = [run("moe", 1, 2.4), run("moe", 0, 2.1), run("moe", 2, 1.0)]  # seed 2 has no dense partner: left out
    assert [round(d, 6) for d in quality.paired(moe, dense)] == [-0.1, 0.1]


def test_table_weighs_the_gap_by_the_paired_spread():
    # seed 1 is harder for both: the unpaired spread is 0.3536, the per-seed gap is -0.05 on both seeds
    runs = [run("dense", 0, 2.0), run("dense", 1, 2.5), run("moe", 0, 1.95), run("moe", 1, 2.45)]
    row = next(line for line in quality.table(runs, ["dense", "moe"]).splitlines() if line.startswith("| moe |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1] == "2.2000 ± 0.3536"
    assert cells[2] == "-0.0500 ± 0.0000"
    assert cells[3] == "2/2 seeds"
