"""Live tracking through a real `cipher-train` run: W&B offline (read back from its transaction log), a resume that
continues the same W&B run, and TensorBoard scalars read back with TensorBoard's own EventAccumulator."""

import shutil

import pytest
from conftest import ROOT, SMALL_MODEL, rows, run_cli

pytest.importorskip("wandb")
pytest.importorskip("tensorboard")

from cipher_nb.config.load import load_config  # noqa: E402
from cipher_nb.persist.record import RunRecord  # noqa: E402
from cipher_nb.train.tracking import finished_wandb_runs, read_tracking  # noqa: E402

ARGS = [
    *SMALL_MODEL,
    "training.seq_len=64",
    "training.batch_size=4",
    "training.eval_batches=2",
    "schedule.warmup_steps=1",
    "training.log_every=1",
    "training.eval_every=2",
    "training.checkpoint_every=2",
    "logging.tensorboard=true",
    "logging.wandb.mode=offline",
    "logging.wandb.project=cipher-test",
]


def train(out, *args):
    cli = shutil.which("cipher-train") or str(ROOT / ".venv/bin/cipher-train")
    # WANDB_MODE says online: the config's offline mode must win (no network call in this test)
    return run_cli(cli, "--out", str(out), "--quiet", *args, env={"WANDB_MODE": "online", "WANDB_SILENT": "true"})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    "A run stopped by SIGTERM after step 2 (checkpoint written), then resumed with --resume auto to step 4."
    run = tmp_path_factory.mktemp("tracking") / "run"
    r = train(run, "--max-steps", "4", *ARGS, "--fault", "sigterm@2")
    assert r.returncode == 0 and "SIGTERM" in r.stderr, r.stderr[-3000:]
    first = read_tracking(run)
    r = train(run, "--resume", "auto", *ARGS)
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-3000:]
    return run, first


def test_wandb_offline_run_holds_the_config_and_the_rows(run):
    run, _ = run
    runs = finished_wandb_runs(run, 2)  # W&B's service may still be writing after the run exits
    assert len(runs) == 2  # the first start and the resume, each an offline directory
    assert all(r["finished"] for r in runs)  # each closed with its exit record
    cfg = load_config(run / "config.yaml").to_dict()  # the resolved config the run trained with
    for r in runs:
        assert r["config"] == cfg
    logged = {h["step"]: h for r in runs for h in r["history"]}
    written = rows(run)
    assert sorted(logged) == [x["step"] for x in written] == [1, 2, 3, 4]
    for x in written:
        for k, v in x.items():
            if k != "step" and isinstance(v, (int, float)) and v == v:  # NaN compares unequal to itself
                assert logged[x["step"]][k] == pytest.approx(v, rel=1e-12), (x["step"], k)
    assert "val/loss" in logged[2] and "val/loss" in logged[4]


def test_resume_continues_the_same_wandb_run(run):
    run, first = run
    ids = {r["id"] for r in finished_wandb_runs(run, 2)}
    assert ids == {first["wandb"]["id"]}, ids
    assert read_tracking(run)["wandb"] == first["wandb"]
    record = RunRecord.load(run / "record.json")
    assert record.tracking["wandb"]["id"] == first["wandb"]["id"]
    assert record.tracking["wandb"]["mode"] == "offline" and record.tracking["tensorboard"] == {"dir": "tensorboard"}


def test_tensorboard_scalars_read_back(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = run
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    written = rows(run)
    loss = [(e.step, e.value) for e in events.Scalars("loss")]
    assert [s for s, _ in loss] == [1, 2, 3, 4]
    for (step, value), x in zip(loss, written):
        assert value == pytest.approx(x["loss"], rel=1e-6)  # stored as float32
    val = [(e.step, e.value) for e in events.Scalars("val/loss")]
    assert [s for s, _ in val] == [2, 4]
    assert val[-1][1] == pytest.approx(written[-1]["val/loss"], rel=1e-6)
