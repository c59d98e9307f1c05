"""benchmarks/moe_vs_dense.py: the record's verdict is the paired one, recomputed from quality.py's runs by hand."""

import importlib.util
import math
from pathlib import Path

spec = importlib.util.spec_from_file_location("moe_vs_dense", Path(__file__).parents[1] / "benchmarks/moe_vs_dense.py")
mvd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mvd)


def _runs(moe, dense):
    return [dict(name="moe", seed=s, bpb=b) for s, b in enumerate(moe)] + [
        dict(name="dense", seed=s, bpb=b) for s, b in enumerate(dense)
    ]


def test_record_holds_the_paired_difference():
    moe, dense = [2.00, 2.10, 2.05], [2.10, 2.15, 2.12]
    rec = mvd.add_record({}, "default", "90s", dict(command="c", runs=_runs(moe, dense)), when="2026-12-05")
    (r,) = rec["comparisons"]
    d = [m - x for m, x in zip(moe, dense)]  # by hand: -0.10, -0.05, -0.07
    mean = sum(d) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 2)
    half = 4.302652729911275 * sd / math.sqrt(3)  # t(0.975, 2)
    assert (r["recipe"], r["budget"], r["seeds"], r["signs"]) == ("default", "90s", 3, "---")
    assert math.isclose(r["mean"], mean) and math.isclose(r["high"], mean + half, rel_tol=1e-6)
    assert r["verdict"].startswith("MoE better")


def test_a_record_replaces_its_older_self_and_keeps_the_others():
    res = dict(runs=_runs([2.0, 2.1], [2.0, 2.2]))
    rec = mvd.add_record({}, "default", "90s", res)
    rec = mvd.add_record(rec, "90s", "90s", res)
    rec = mvd.add_record(rec, "default", "90s", dict(runs=_runs([2.3, 2.4], [2.0, 2.2])))
    assert [(r["recipe"], r["budget"]) for r in rec["comparisons"]] == [("90s", "90s"), ("default", "90s")]
    assert rec["comparisons"][1]["moe_bpb"] == [2.3, 2.4]


def test_sequential_verdict_when_planned():
    r = mvd.moe_minus_dense(_runs([2.0, 2.1, 2.05], [2.1, 2.15, 2.12]), max_seeds=5)
    assert r["level"] > 0.95 and "stop" in r  # each look's share of the 5%


def test_the_sweeps_multiplier_joins_the_record_beside_the_verdicts():
    rec = mvd.add_record({}, "default", "90s", dict(runs=_runs([2.0, 2.1], [2.0, 2.2])))
    sweep = dict(sweep="full", multiplier=[dict(C=1e11, multiplier=1.4, lo_hi=(0.9, 2.1))])
    rec = mvd.add_multiplier(rec, sweep, "c", when="2026-12-05")
    assert rec["multiplier"]["budgets"] == [dict(flops=1e11, multiplier=1.4, low=0.9, high=2.1)]
    assert len(rec["comparisons"]) == 1 and rec["multiplier"]["sweep"] == "full"
    assert "own_minima" not in rec["multiplier"]  # a sweep result from before approach 2
    own = [dict(C=1e12, multiplier=1.3, lo_hi=(1.1, 1.5))]
    both = mvd.add_multiplier(rec, sweep | dict(minima_multiplier=own), "c")
    assert both["multiplier"]["own_minima"] == [dict(flops=1e12, multiplier=1.3, low=1.1, high=1.5)]


def test_the_sweeps_matched_runs_give_a_paired_verdict_at_equal_flops():
    def run(family, width, budget, seed, bpb, heldout=False):
        return dict(family=family, width=width, budget=budget, seed=seed, bpb=bpb, heldout=heldout)

    runs = [run("dense", 16, 1e11, 0, 3.0), run("moe", 16, 1e11, 0, 2.9), run("dense", 16, 1e11, 1, 3.1)]
    runs += [run("moe", 16, 1e11, 1, 3.05), run("dense", 32, 1e11, 0, 3.2), run("moe", 32, 1e11, 0, 3.12)]
    runs += [run("moe", 64, 1e11, 0, 2.0), run("dense", 160, 2e12, 0, 2.5, True), run("moe", 160, 2e12, 0, 2.0, True)]
    sweep = dict(sweep="full", multiplier=[dict(C=1e11, multiplier=1.2, lo_hi=(0.9, 1.6))], runs=runs)
    m = mvd.add_multiplier({}, sweep, "c")["multiplier"]["matched"]
    d = [
        -0.10,
        -0.05,
        -0.08,
    ]  # by hand: (16, seed 0), (16, seed 1), (32, seed 0); width 64 has no dense, 160 is held out
    mean = sum(d) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 2)
    assert (m["runs"], m["sweep_seeds"]) == (3, 2) and math.isclose(m["mean"], mean)
    assert math.isclose(m["low"], mean - 4.302652729911275 * sd / math.sqrt(3), rel_tol=1e-6)
    assert m["verdict"].startswith("MoE better")


def test_a_bad_result_is_one_line_and_exit_2_with_the_record_untouched(tmp_path):
    import subprocess
    import sys

    record, bad = tmp_path / "record.json", tmp_path / "notes.md"
    record.write_text('{"comparisons": []}\n')
    bad.write_text("# not json\n")
    script = Path(__file__).parents[1] / "benchmarks/moe_vs_dense.py"
    for args in ([str(bad), "--recipe", "x", "--budget", "8m"], ["--scaling", str(tmp_path / "missing.json")]):
        r = subprocess.run([sys.executable, script, *args, "--out", str(record)], capture_output=True, text=True)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("moe_vs_dense.py: error:")
    assert record.read_text() == '{"comparisons": []}\n'
