"benchmarks/scaling.py's pure parts: the matched-runs table and its paired verdict, and the report of a finished sweep."

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cipher_nb.eval.scaling import Law, fit_families, frontier

spec = importlib.util.spec_from_file_location("scaling_bench", Path(__file__).parent.parent / "benchmarks/scaling.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def rows_from(laws: dict, heldout=()) -> list:
    "Sweep rows drawn from known laws on three isoFLOP budgets x five widths, as run_sweep returns them."
    out = []
    for family, law in laws.items():
        for c in (1e14, 1e15, 1e16):
            for width, n in zip((16, 24, 32, 48, 64), (1e5, 3e5, 1e6, 3e6, 1e7)):
                d = c / (6 * n)
                name = f"{family}/d{width}/C={c:.0e}"
                out.append(dict(family=family, width=width, budget=c, heldout=False, N=n, tokens=d, flops=c,
                                steps=1, name=name, bpb=float(law(n, d))))  # fmt: skip
    return out


def test_matched_runs_table_and_verdict_by_hand():
    rows = [
        dict(family=f, width=w, budget=c, heldout=False, bpb=v)
        for f, w, c, v in [
            ("dense", 16, 1e11, 3.0),
            ("moe", 16, 1e11, 2.9),
            ("dense", 32, 1e11, 3.2),
            ("moe", 32, 1e11, 3.25),
            ("dense", 32, 3e11, 2.8),
            ("moe", 32, 3e11, 2.7),
            ("dense", 16, 3e11, 2.6),
        ]  # fmt: skip
    ]
    table, line = bench.matched(rows)
    lines = table.splitlines()
    assert lines[2] == "| 16 | -0.1000 |  |"  # width 16 at 3e11 has no MoE run: an empty cell, no pair
    assert lines[3] == "| 32 | +0.0500 | -0.1000 |"
    d = np.array([3.0 - 2.9, 3.2 - 3.25, 2.8 - 2.7])  # dense - moe over the three matched pairs
    assert f"{d.mean():+.4f}" in line and "over 3 matched runs" in line and "cannot tell" in line


def test_report_of_a_sweep_from_known_laws():
    laws = {"dense": Law(1.2, 40.0, 0.34, 60.0, 0.28), "moe": Law(1.1, 80.0, 0.34, 60.0, 0.28)}
    rows = rows_from(laws)
    fits = fit_families(rows, boot=5)
    held = dict(name="moe/d96/C=1e+17", family="moe", N=3e7, tokens=1e10, flops=1.8e18, pred=2.0, lo=1.9, hi=2.1)
    res = dict(runs=rows, laws=bench.law_rows(fits), predictions=[{**held, "measured": 2.05}],
               frontier=frontier(fits, [1e14, 1e16]), crossing=None)  # fmt: skip
    text = bench.report(res)
    assert "| moe/d96/C=1e+17 | 2.0000 [1.9000, 2.1000] | 2.0500 | +0.0500 | yes |" in text
    assert abs(res["laws"]["moe"]["E"][0] - 1.1) < 0.03 and res["laws"]["dense"]["residual_rms"] < 1e-3
    assert "Crossing of the frontiers inside the fitted budgets: none." in text


def test_the_multiplier_of_a_law_moved_along_the_dense_frontier():
    "A MoE law whose A and B are k^-gamma times the dense law's reaches at C what dense reaches at k C: multiplier k."
    dense, k = Law(1.2, 40.0, 0.34, 60.0, 0.28), 2.5
    s = k ** -(dense.alpha * dense.beta / (dense.alpha + dense.beta))
    rows = rows_from({"dense": dense, "moe": Law(1.2, 40.0 * s, 0.34, 60.0 * s, 0.28)})
    fits = fit_families(rows, boot=5)
    ms = bench.multipliers(fits, [1e14, 1e16])
    assert [round(m["multiplier"], 2) for m in ms] == [k, k] and all(
        m["lo_hi"][0] <= k <= m["lo_hi"][1] + 1e-6 for m in ms
    )
    text = bench.report(dict(runs=rows, laws={}, predictions=[], frontier=[], crossing=None,
                             multiplier=ms))  # fmt: skip
    assert "| 1e+14 | 2.5 [" in text


def test_matched_runs_pair_each_seed_and_the_table_shows_their_mean():
    rows = [
        dict(family=f, width=16, budget=1e11, seed=s, heldout=False, bpb=v)
        for f, s, v in [("dense", 0, 3.0), ("moe", 0, 2.9), ("dense", 1, 3.1), ("moe", 1, 3.3), ("moe", 2, 2.0)]
    ]
    table, line = bench.matched(rows)
    assert table.splitlines()[2] == "| 16 | +0.0500 |"  # (-0.1 + 0.2) / 2; the MoE's seed 2 has no dense pair
    assert "over 2 matched runs" in line and f"{(0.1 - 0.2) / 2:+.4f}" in line  # dense - moe, seed by seed


def test_each_budgets_own_minimum_finds_the_moved_laws_multiplier():
    "Approach 2 on runs drawn from the two laws above, budgets half a decade apart: k between budgets, within 3%."
    dense, k = Law(1.2, 40.0, 0.34, 60.0, 0.28), 2.5
    s = k ** -(dense.alpha * dense.beta / (dense.alpha + dense.beta))
    laws = {"dense": dense, "moe": Law(1.2, 40.0 * s, 0.34, 60.0 * s, 0.28)}
    rows = [
        dict(family=f, budget=c, heldout=False, N=n, bpb=float(law(n, c / (6 * n))))
        for f, law in laws.items()
        for c in (1e14, 3e14, 1e15, 3e15, 1e16)
        for n in np.geomspace(1e5, 1e7, 9)
    ]
    mins, ms = bench.own_minima(rows, boot=5)
    assert len(mins) == 10 and [m["C"] for m in ms] == [1e14, 3e14, 1e15, 3e15, 1e16]
    assert all(abs(m["multiplier"] / k - 1) < 0.03 for m in ms[:-1])  # the last extends dense's last segment: low
    assert ms[-1]["multiplier"] < k
    frontier_rows = [dict(family=f, C=c, N=1.0, L=1.0) for f in laws for c in (1e14, 1e15)]
    text = bench.minima_text(dict(minima=mins, minima_multiplier=ms, frontier=frontier_rows, multiplier=[]))
    assert f"| 1e+15 | dense | {mins[2]['N']:,.0f} [" in text and f"| 1e+15 |  | {ms[2]['multiplier']:.3g} [" in text


def test_refit_reports_a_saved_sweep_and_refuses_a_bad_file_in_one_line(tmp_path, monkeypatch, capsys):
    laws = {"dense": Law(1.2, 40.0, 0.34, 60.0, 0.28), "moe": Law(1.1, 80.0, 0.34, 60.0, 0.28)}
    held = [r for r in bench.sweep_runs(bench.SWEEPS["small"]) if r["heldout"]]
    rows = rows_from(laws) + [{**r, "bpb": float(laws[r["family"]](r["N"], r["tokens"]))} for r in held]
    saved = tmp_path / "old.json"
    saved.write_text(
        json.dumps(dict(sweep="small", runs=[{k: v for k, v in r.items() if k != "overrides"} for r in rows]))
    )
    monkeypatch.setattr(
        sys, "argv", ["scaling.py", "--refit", str(saved), "--out", str(tmp_path / "new"), "--boot", "5"]
    )
    bench.main()
    res = json.loads((tmp_path / "new.json").read_text())
    assert [p["measured"] for p in res["predictions"]] == [r["bpb"] for r in rows[-len(held) :]]
    assert res["minima"] and "Without the law (approach 2)" in (tmp_path / "new.md").read_text()
    saved.write_text(json.dumps(dict(sweep="small", runs=rows_from(laws))))  # no held-out rows: an unfinished sweep
    for bad in (saved, tmp_path / "missing.json"):
        monkeypatch.setattr(sys, "argv", ["scaling.py", "--refit", str(bad), "--out", str(tmp_path / "x")])
        with pytest.raises(SystemExit) as e:
            bench.main()
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and f"--refit {bad}" in err[-1] and "Traceback" not in err[-1]
    monkeypatch.setattr(
        sys, "argv", ["scaling.py", "--refit", str(saved), "--out", str(tmp_path / "x"), "--seeds", "3"]
    )
    with pytest.raises(SystemExit) as e:  # a refit does not train: options for training are a mistake, said so
        bench.main()
    assert e.value.code == 2 and "--refit fits the runs as they ran" in capsys.readouterr().err


def test_predict_adds_a_configuration_predicted_then_trained(tmp_path, monkeypatch, capsys):
    laws = {"dense": Law(1.2, 40.0, 0.34, 60.0, 0.28), "moe": Law(1.1, 80.0, 0.34, 60.0, 0.28)}
    held = [r for r in bench.sweep_runs(bench.SWEEPS["small"]) if r["heldout"]]
    rows = rows_from(laws) + [{**r, "bpb": 3.0} for r in held]
    saved = tmp_path / "old.json"
    saved.write_text(
        json.dumps(dict(sweep="small", runs=[{k: v for k, v in r.items() if k != "overrides"} for r in rows]))
    )
    args = ["--refit", str(saved), "--out", str(tmp_path / "new"), "--boot", "5", "--root", str(tmp_path / "runs")]
    monkeypatch.setattr(sys, "argv", ["scaling.py", *args, "--predict", "16@2e10"])
    bench.main()
    res = json.loads((tmp_path / "new.json").read_text())
    extra = {p["name"]: p for p in res["predictions"] if "C=2e+10" in p["name"]}
    assert sorted(extra) == ["dense/d16/C=2e+10", "moe/d16/C=2e+10"]  # each family, predicted and measured
    assert all(2.0 < p["measured"] < 9.0 and p["lo"] < p["hi"] for p in extra.values())
    assert (tmp_path / "runs/small/moe/d16/C=2e+10/metrics.jsonl").is_file()
    for bad in ("16x2e10", "15@2e10"):  # not WIDTH@FLOPS; a width that does not split into the heads
        monkeypatch.setattr(sys, "argv", ["scaling.py", *args, "--predict", bad])
        with pytest.raises(SystemExit) as e:
            bench.main()
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 2 and ("WIDTH@FLOPS" in err or "width 15" in err) and "Traceback" not in err


def test_a_bad_predict_point_is_refused_before_the_sweep_trains(tmp_path, monkeypatch, capsys):
    args = [
        "--sweep",
        "small",
        "--root",
        str(tmp_path / "runs"),
        "--out",
        str(tmp_path / "new"),
        "--predict",
        "15@2e10",
    ]
    monkeypatch.setattr(sys, "argv", ["scaling.py", *args])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2 and "width 15" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "new.json").exists()  # nothing trained, nothing written


def test_the_invocations_cpu_time_counts_its_workers():
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    t0, own = bench.cpu_clock(), time.process_time()
    subprocess.run([sys.executable, "-c", burn], check=True)  # a worker's CPU time, as a --jobs pool's
    assert bench.cpu_clock() - t0 >= 0.3 > time.process_time() - own  # the process's own clock misses it
