"benchmarks/quality.py --sequential: the verdicts at each look and when the comparison may stop (milliseconds)."

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("quality", Path(__file__).parent.parent / "benchmarks/quality.py")
quality = importlib.util.module_from_spec(spec)
spec.loader.exec_module(quality)


def runs(name, bpbs):
    return [dict(name=name, seed=s, bpb=b) for s, b in enumerate(bpbs)]


def test_sequential_verdicts_widen_the_interval_and_stop_when_decided():
    # moe - dense per seed: -0.06, -0.05, -0.07. Planned for 6 seeds: 5 looks (2..6 seeds), each at 1 - 0.05 / 5 = 99%.
    # After 2 seeds: mean -0.055, standard error 0.005, t(0.995, 1) = 63.657 from a printed table:
    # -0.055 +- 0.3183 = [-0.3733, +0.2633], no verdict. After 3: mean -0.06, standard error 0.01 / sqrt(3) = 0.005774,
    # t(0.995, 2) = 9.925: -0.06 +- 0.0573 = [-0.1173, -0.0027]: moe better, every pair decided.
    dense = runs("dense", [2.0, 2.0, 2.0])
    moe = runs("moe", [1.94, 1.95, 1.93])
    two = [r for r in dense + moe if r["seed"] < 2]
    assert not quality.all_decided(two, ["dense", "moe"], 6)
    assert quality.verdict_table(two, ["dense", "moe"], 6).splitlines()[2:] == [
        "- moe - dense: -0.0550 [-0.3733, +0.2633] over 2 seeds, signs --: cannot tell at this budget with 2 seeds"
    ]
    three = quality.verdict_table(dense + moe, ["dense", "moe"], 6).splitlines()
    assert "sequential, planned for 6 seeds: each look's 99.00% t interval" in three[0]
    assert three[2:] == ["- moe - dense: -0.0600 [-0.1173, -0.0027] over 3 seeds, signs ---: moe better"]
    assert quality.all_decided(dense + moe, ["dense", "moe"], 6)
    # the fixed 95% interval of the same three seeds is narrower: t(0.975, 2) = 4.303, -0.06 +- 0.0248
    assert quality.verdict_table(dense + moe, ["dense", "moe"]).splitlines()[2] == (
        "- moe - dense: -0.0600 [-0.0848, -0.0352] over 3 seeds, signs ---: moe better"
    )


def test_sequential_waits_for_every_pair_and_stops_at_the_planned_seeds():
    dense = runs("dense", [2.0, 2.0, 2.0])
    moe = runs("moe", [1.94, 1.95, 1.93])  # decided after 3 seeds (above)
    bp = runs("moe+bp", [2.06, 1.96, 1.95])  # +0.06, -0.04, -0.05: open
    names = ["dense", "moe", "moe+bp"]
    assert not quality.all_decided(dense + moe + bp, names, 6)
    assert quality.all_decided(dense + moe + bp, names, 3)  # the planned seeds are spent: stop
    assert not quality.all_decided(moe + bp, ["moe", "moe+bp"], 6)  # no reference: nothing to decide
