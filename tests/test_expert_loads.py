"""Per-expert loads of a model over `LOAD_KEYS_MAX` experts: a real run writes them beside metrics.jsonl (the threshold
lowered, so a tiny model counts as large), a resume cuts them at its step, and the gate, cipher-plot and the dashboard
read them back from disk; a faked run of 40 layers x 64 experts shows the readers at that scale."""

import json
import shutil

import pytest
from conftest import SMALL_MODEL, rows, run_in_process
from PIL import Image

import cipher_nb.monitor.health as health
from cipher_nb.monitor.health import LOADS_FILE, LOADS_KEY, append_row, collect_metrics

RUN = [
    *SMALL_MODEL,  # one MoE layer of 4 experts
    "training.seq_len=64",
    "training.batch_size=2",
    "training.eval_batches=1",
    "schedule.warmup_steps=1",
    "schedule.max_steps=6",
    "training.log_every=1",
    "training.checkpoint_every=3",
    "training.eval_every=3",
]


def train(out, *args):
    from cipher_nb.train.cli import cipher_train

    return run_in_process(cipher_train, "--out", str(out), "--quiet", *args, pos=["config"])


def lines(run) -> list:
    return [json.loads(t) for t in (run / LOADS_FILE).read_text().splitlines()]


@pytest.fixture
def large(monkeypatch):
    "The threshold under the tiny model's 4 experts: its loads take the form of a large model's."
    monkeypatch.setattr(health, "LOAD_KEYS_MAX", 3)


def test_a_large_model_writes_its_loads_beside_the_rows_and_a_resume_cuts_them(tmp_path, large):
    run = tmp_path / "run"
    r = train(run, *RUN)
    assert r.returncode == 0, r.stderr[-3000:]
    m = rows(run)
    assert not [k for row in m for k in row if health.LOAD_KEY.fullmatch(k) or k == LOADS_KEY]  # no key per expert
    summed = [row for row in m if "router/layer1_max_load" in row]  # the per-layer summaries stay in the rows
    assert [x["step"] for x in lines(run)] == [row["step"] for row in summed] == [1, 2, 3, 4, 5, 6]
    for row, line in zip(summed, lines(run)):
        loads = line["loads"]["1"]
        assert len(loads) == 4 and sum(loads) == pytest.approx(4.0, abs=4e-3)  # loads over the mean: they sum to E
        assert max(loads) == pytest.approx(row["router/layer1_max_load"], abs=1e-3)

    # a run killed after its checkpoint at step 3 wrote rows 4-6 that its resume trains again
    shutil.rmtree(run / "final")
    shutil.rmtree(run / "checkpoints/step_0000006")
    r = train(run, "--resume", "auto", *RUN)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "at step 3" in r.stderr
    assert [x["step"] for x in lines(run)] == [x["step"] for x in rows(run) if "router/layer1_max_load" in x]
    assert [x["step"] for x in lines(run)] == [1, 2, 3, 4, 5, 6]  # cut at step 3, then written again

    # the readers, from disk
    from cipher_nb.monitor.gate import gate_load, read_metrics
    from cipher_nb.viz.dashboard import plot_latest_load
    from cipher_nb.viz.plots import PngFigure, expert_load_matrix, load_run

    back, cfg = load_run(run)
    assert expert_load_matrix(back, 1)[1].shape == (4, 6)
    line = gate_load(read_metrics(run / "metrics.jsonl"), cfg.monitor)
    assert line.figure.startswith("worst layer 1, expert ") and "loads over the last quarter" in line.figure
    plot_latest_load(back, ax := PngFigure().subplots())
    assert ax.images[0].get_array().shape == (1, 4)


def test_a_small_model_keeps_a_key_per_expert(tmp_path):
    "Under the threshold (every shipped CPU preset): the keys of before, and no second file."
    run = tmp_path / "run"
    r = train(run, *RUN, "schedule.max_steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert all(f"router/layer1_load_{e}" in rows(run)[-1] for e in range(4))
    assert not (run / LOADS_FILE).exists()


@pytest.fixture
def many_experts(tmp_path):
    "A run directory of 40 MoE layers x 64 experts, written as the trainer writes it: expert 42 of layer 17 hot."
    counts = {f"layer{i}/expert_counts": [10.0] * 64 for i in range(1, 41)}
    counts["layer17/expert_counts"][42] = 40.0
    for s in range(10, 101, 10):
        append_row(tmp_path, {"step": s, "loss": 4.0 - s / 100, **collect_metrics(counts)})
    return tmp_path


def test_the_readers_of_a_run_with_many_experts(many_experts, capsys):
    from cipher_nb.monitor.gate import gate_run
    from cipher_nb.viz.dashboard import LiveDashboard
    from cipher_nb.viz.plots import cipher_plot

    assert len(json.loads((many_experts / "metrics.jsonl").read_text().splitlines()[0])) < 300  # summaries, no loads
    assert gate_run(str(many_experts)) == 1
    out = capsys.readouterr().out
    assert "worst layer 17, expert 42: 3.82x over 40 layer(s)" in out, out

    r = run_in_process(cipher_plot, str(many_experts))
    assert r.returncode == 0, r.stderr[-3000:]
    with Image.open(many_experts / "plots/routing.png") as im:
        panels = im.text["Description"].split(" | ")
    assert panels == [f"expert load, layer {i}" for i in range(1, 41)] + ["routing entropy"]

    LiveDashboard(widget=False).on_reuse(many_experts)
    with Image.open(many_experts / "dashboard.png") as im:
        assert "expert load (latest)" in im.text["Description"]
