"""Weight averaging (`optim.ema`) in a real run: an interrupted run resumed ends with the same average as an
uninterrupted one, bit for bit; the average changes no trained weight; `final/` holds the average, and with the average
off it holds the trained weights as before. The average itself against a float64 reference: nbs/08d_optim_ema.ipynb.

The runs are `cipher-train` in this process (a stop by SIGTERM, `--fault sigterm@3`, saves and resumes like a kill
after a checkpoint, without seconds of imports per process), on one thread like conftest's `straight_run`, which they
are compared with bit for bit."""

import json
import shutil
import sys
from pathlib import Path

import torch
from conftest import RESUME, RESUME_EVERY, RESUME_STEPS, ROOT, rows, run_cli, run_in_process, same_weights, weights

EMA = [*RESUME, "optim.ema=0.9"]  # 0.9: the warmed-up decay (0.1, 2/11, ...) moves over six steps, and the cap too


def train(out, *args):
    from cipher_nb.train.cli import cipher_train

    return run_in_process(cipher_train, "--out", out, "--quiet", *args, pos=["config"])


def checkpoint(run, step: int) -> dict:
    from cipher_nb.persist.files import load_checkpoint

    return load_checkpoint(run / f"checkpoints/step_{step:07d}")


def test_resume_with_ema_is_bit_identical(straight_run, tmp_path, one_thread):
    "EMA on: N steps straight == stopped at k, resumed to N: the same losses, average and export, bit for bit."
    a, b = tmp_path / "straight", tmp_path / "stopped"
    assert train(a, *EMA).returncode == 0
    r = train(b, *EMA, "--fault", f"sigterm@{RESUME_EVERY}")
    assert r.returncode == 0 and not (b / "final").exists(), r.stderr[-2000:]
    r = train(b, "--resume", "auto", *EMA)
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-3000:]
    assert [(x["step"], x.get("loss"), x.get("val/loss")) for x in rows(a)] == [
        (x["step"], x.get("loss"), x.get("val/loss")) for x in rows(b)
    ]
    ea, eb = checkpoint(a, RESUME_STEPS)["ema"], checkpoint(b, RESUME_STEPS)["ema"]
    assert ea["updates"] == eb["updates"] == RESUME_STEPS
    assert same_weights(ea["weights"], eb["weights"]) and ea["buffers"] == eb["buffers"]
    assert same_weights(weights(a / "final"), weights(b / "final"))
    # the average changes no trained weight: the model of the last checkpoint is the run's without it (conftest's)
    assert same_weights(checkpoint(a, RESUME_STEPS)["model"], checkpoint(straight_run, RESUME_STEPS)["model"])
    # final/ holds the average, and says so; the evaluations read it too (another val/loss than without it)
    final = weights(a / "final")
    shared = [k for k in final if k in ea["weights"]]
    assert shared and all(torch.equal(final[k], ea["weights"][k]) for k in shared)
    # and the averaged balancing biases, not the live ones the model's checkpoint holds
    live = checkpoint(a, RESUME_STEPS)["model"]
    biases = [k for k in final if k.endswith("expert_bias")]
    assert biases and sorted(biases) == sorted(ea["buffers"])
    for k in biases:
        assert torch.equal(final[k], torch.tensor(ea["buffers"][k])) and not torch.equal(final[k], live[k]), k
    assert json.loads((a / "final/meta.json").read_text())["averaged"] == dict(decay=0.9, updates=RESUME_STEPS)
    val = [x["val/loss"] for x in rows(a) if "val/loss" in x]
    assert val != [x["val/loss"] for x in rows(straight_run) if "val/loss" in x]
    ema = json.loads((a / "record.json").read_text())["optimizer"]["ema"]
    n = sum(t.numel() for t in ea["weights"].values()) + sum(map(len, ea["buffers"].values()))
    assert ema == dict(decay=0.9, bytes_per_rank=4 * n, world_size=1)


def test_ema_off_exports_the_trained_weights(straight_run):
    "optim.ema = 0 (the default): no average in the checkpoint, final/ is the last trained weights, no record entry."
    last = checkpoint(straight_run, RESUME_STEPS)
    assert "ema" not in last
    final = weights(straight_run / "final")
    shared = [k for k in final if k in last["model"]]
    assert shared and all(torch.equal(final[k], last["model"][k]) for k in shared)
    assert "ema" not in json.loads((straight_run / "record.json").read_text())["optimizer"]


def test_fsdp2_average_is_sharded_and_resumes_exactly(tmp_path):
    """FSDP2 on two CPU ranks (gloo): the average is a shard per rank, saved through DCP with the model, and a run
    resumed from its half-way checkpoint ends with the same shards of average and weights as the run that went on."""
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    r = run_cli(
        torchrun, "--standalone", "--nproc_per_node=2", str(ROOT / "tests/ema_fsdp.py"), str(tmp_path),
        env={"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for res in ranks:
        assert res["sharded"] and res["same_average"] and res["same_weights"] and res["same_biases"], res
        assert res["updates"] == [RESUME_STEPS, RESUME_STEPS]
    skeleton = torch.load(tmp_path / f"a/checkpoints/step_{RESUME_EVERY:07d}/state.pt", weights_only=False)["_sharded"]
    assert "ema" in skeleton  # written by DCP beside the model's shards, not gathered into state.pt
    assert same_weights(weights(tmp_path / "a/final"), weights(tmp_path / "b/final"))  # the average, gathered
    ema = json.loads((tmp_path / "a/record.json").read_text())["optimizer"]["ema"]
    assert ema == dict(decay=0.9, bytes_per_rank=ranks[0]["bytes"], world_size=2)
    n = sum(t.numel() for t in weights(tmp_path / "a/final").values())
    assert ranks[0]["biases"] == ranks[1]["biases"]  # the averaged biases: whole, and the same, on every rank
    halves = sum(r["bytes"] - r["bias_bytes"] for r in ranks) + ranks[0]["bias_bytes"]
    assert halves <= 4 * n  # each rank holds its half of the weights (tied weights are exported once)
