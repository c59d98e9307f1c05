"""benchmarks/routing_targets.py: issue 49's windows and starved stretches, against a hand count on made-up rows."""

import importlib.util
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location("rt", Path(__file__).parents[1] / "benchmarks/routing_targets.py")
rt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rt)


def _run(tmp_path, loads_by_step, big=False):
    "A run directory whose rows (every 10 steps from 0) hold these per-expert loads of layer 1."
    rows = []
    for step, loads in loads_by_step:
        row = {"step": step, "router/layer1_max_load": max(loads), "router/layer1_batch_max_load": step / 10}
        if not big:
            row.update({f"router/layer1_load_{e}": x for e, x in enumerate(loads)})
        rows.append(row)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if big:  # a model over 1,024 experts: the loads in their own file
        lines = [json.dumps({"step": s, "loads": {"1": x}}) + "\n" for s, x in loads_by_step]
        (tmp_path / "expert_loads.jsonl").write_text("".join(lines))
    return tmp_path


def _rows():
    # steps 0-20 (before the targets start), 30-70 (first window), 80-120 (second)
    collapsed = [(s, [3.0, 1.0, 0.0, 0.0]) for s in range(0, 80, 10)]
    even = [(s, [1.0, 1.0, 1.0, 1.0]) for s in range(80, 130, 10)]
    return collapsed + even


def test_windows_and_starved_stretch_by_hand(tmp_path):
    ((L, (steps, loads)),) = rt.layer_loads(rt.read_rows(_run(tmp_path, _rows()))).items()
    assert L == 1 and steps == list(range(0, 130, 10))
    assert rt.worst_window(steps, loads) == 3.0  # steps 30-79: expert 0 at 3x the mean (1)
    assert rt.longest_starved(steps, loads) == 50  # experts 2, 3: rows 30..70, five rows of 10 steps
    rows = rt.read_rows(tmp_path)
    assert rt.batch_busiest(rows, 1) == 7.5  # the median of 3, 4, ..., 12 (rows from step 30)
    assert rt.batch_busiest(rows, 2) is None  # a layer that never logged it


def test_loads_in_their_own_file_read_the_same(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    small = rt.layer_loads(rt.read_rows(_run(tmp_path / "a", _rows())))
    big = rt.layer_loads(rt.read_rows(_run(tmp_path / "b", _rows(), big=True)))
    assert small == big and small[1][1][0] == [3.0, 1.0, 0.0, 0.0]
