"The release chain as processes on the embedded defaults: pretrain -> refinement -> SFT; LoRA; resume; the refusals."

import csv
import json
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import SMALL_MODEL, run_cli, run_in_process, script

MODEL = SMALL_MODEL
PRETRAIN = [
    *MODEL,
    "training.seq_len=128",
    "training.batch_size=8",
    "schedule.warmup_steps=5",
    "training.eval_batches=2",
    "training.eval_every=1000",
    "training.checkpoint_every=1000",
    "training.log_every=10",
]
SFT = [
    *MODEL,
    "training.seq_len=256",
    "training.batch_size=4",
    "training.log_every=5",
    "sft.max_train_examples=96",
    "sft.epochs=2",
    "schedule.lr=2e-3",
    "schedule.min_lr=2e-4",
]
ENV = {"OMP_NUM_THREADS": "1"}  # these models are tiny: one thread is faster, and far faster on a busy machine


def cli():
    return script("cipher-train")


def train(out, *args, env=None):
    return run_cli(cli(), "--out", str(out), "--quiet", *args, env={**ENV, **(env or {})})


def refused(out, *args):
    "cipher-train ARGS in this process, for a start refused before any model is built (no process to start)."
    from cipher_nb.train.cli import cipher_train

    return run_in_process(cipher_train, "--out", str(out), "--quiet", *args, pos=["config"])


def csv_rows(run):
    return list(csv.DictReader(open(Path(run) / "metrics.csv")))


def weights(path):
    from safetensors.torch import load_file

    return load_file(Path(path) / "model.safetensors")


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    "Pretraining, then refinement from its final/ (same data, fresh optimizer): the source of every SFT run below."
    d = tmp_path_factory.mktemp("chain")
    # short stages: what the tests below need of the source is its stage and a loss SFT can improve on
    r = train(d / "pretrain", "--max-steps", "30", *PRETRAIN)
    assert r.returncode == 0, r.stderr[-3000:]
    r = train(
        d / "refinement", "--stage", "refinement", "--init", str(d / "pretrain/final"), "--max-steps", "10", *PRETRAIN
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return d


@pytest.fixture(scope="module")
def sft_run(chain):
    run = chain / "sft"
    r = train(run, "--stage", "sft", "--init", str(chain / "refinement/final"), *SFT)
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def test_chain_sft_improves_on_its_source(sft_run, capsys):
    rows = csv_rows(sft_run)
    cfg = yaml.safe_load((sft_run / "config.yaml").read_text())
    rec = json.loads((sft_run / "record.json").read_text())
    spe = rec["schedule"]["max_steps"] // 2  # two epochs (schedule.epochs, given as the old sft.epochs)
    assert [int(r["step"]) for r in rows] == [0, spe, 2 * spe]  # the source checkpoint, then every epoch
    losses = [float(r["val/loss"]) for r in rows]
    with capsys.disabled():
        print(f"\nSFT held-out loss by epoch (nats per answer byte): {losses}; bpb {[r['val/bpb'] for r in rows]}")
    assert losses[-1] < losses[0], losses
    for step in (spe, 2 * spe):
        assert (sft_run / f"checkpoints/step_{step:07d}/COMPLETE").exists()
    assert (sft_run / "checkpoints/best/COMPLETE").exists() and (sft_run / "final/model.safetensors").exists()
    assert rec["stage"] == "sft" and rec["mode"] == "full" and rec["source_checkpoint"]["stage"] == "refinement"
    assert any(n.startswith("sft data stdlib-qa") for n in rec["limitations"])
    manifest = json.loads((sft_run / "sft_manifest.json").read_text())  # checked before step 0, kept in the record
    assert rec["data"]["sft_manifest"] == manifest and manifest["seq_len"] == 256 and "python" in manifest["source"]
    assert [e["step"] for e in rec["evals"]] == [0, spe, 2 * spe] and rec["selection_rule"]
    s, t = cfg["schedule"], cfg["training"]  # the config as asked: the stage derives its steps, never writes them
    assert (s["lr"], s["epochs"], s["max_steps"], t["eval_every"], t["eval_at_start"]) == (2e-3, 2, 0, 0, True)
    assert rec["schedule"]["set_by"] == "schedule.epochs = 2" and rec["schedule"]["warmup_steps"] == round(
        0.03 * 2 * spe
    )


def test_pretrain_to_sft_is_refused(chain, tmp_path):
    r = refused(tmp_path / "bad", "--stage", "sft", "--init", str(chain / "pretrain/final"), *SFT)
    assert r.returncode != 0 and "pretrain -> sft is refused" in r.stderr


def test_a_key_sft_derives_is_refused_naming_the_one_to_set(tmp_path):
    "SFT's steps and cadence follow from schedule.epochs: setting them for the stage is refused before anything runs."
    for key in ("schedule.max_steps=5", "training.eval_every=10"):
        r = refused(tmp_path / "run", "--stage", "sft", "--init", str(tmp_path / "none"), *SFT, key)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert f"{key.replace('=', ' = ')}: stage sft derives it" in lines[0] and "set schedule.epochs" in lines[0]
    assert not (tmp_path / "run").exists()


def test_full_parameter_state_refuses_a_lora_resume(sft_run):
    r = refused(sft_run, "--resume", "auto", "sft.lora_rank=4")
    assert r.returncode != 0 and "sft.lora_rank" in r.stderr, r.stderr[-2000:]


def test_kill_and_resume_is_bit_identical(chain, sft_run, tmp_path):
    "SFT killed right after its first epoch checkpoint and resumed ends with the same metrics and the same weights."
    spe = int(csv_rows(sft_run)[1]["step"])
    run = tmp_path / "killed"
    args = ["--stage", "sft", "--init", str(chain / "refinement/final"), *SFT]
    r = train(run, *args, "--fault", f"kill@{spe}")
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    r = train(run, "--resume", "auto", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert csv_rows(run) == csv_rows(sft_run)
    wa, wb = weights(sft_run / "final"), weights(run / "final")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_lora_trains_adapters_only_and_exports_merged(chain, tmp_path):
    run = tmp_path / "lora"
    r = train(
        run,
        "--stage",
        "sft",
        "--init",
        str(chain / "refinement/final"),
        *SFT,
        "sft.epochs=1",
        "sft.lora_rank=4",
        "sft.lora_targets=[wq, wv]",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    src, out = weights(chain / "refinement/final"), weights(run / "final")
    assert src.keys() == out.keys()  # merged: no adapter tensors in the export
    changed = {k for k in src if not torch.equal(src[k], out[k])}
    assert changed and all(k.endswith(("attn.wq.weight", "attn.wv.weight")) for k in changed), (
        changed
    )  # the rest is bit-identical
    rec = json.loads((run / "record.json").read_text())
    assert rec["mode"] == "lora" and float(csv_rows(run)[-1]["val/loss"]) < float(csv_rows(run)[0]["val/loss"])
    r = refused(run, "--resume", "auto", "sft.lora_rank=0")
    assert r.returncode != 0 and "sft.lora_rank" in r.stderr, r.stderr[-2000:]
    r = refused(tmp_path / "full", "--stage", "sft", "--init", str(run / "final"), "stage.source_stage=sft", *SFT)
    assert r.returncode != 0 and "LoRA checkpoint" in r.stderr, r.stderr[-2000:]


def test_torchrun_fsdp_lora_matches_one_process(chain, sft_run, tmp_path):
    "Two CPU ranks (FSDP2, LoRA): the same held-out figure for the source checkpoint as one process; a merged export."
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    run = tmp_path / "fsdp"
    r = run_cli(
        torchrun,
        "--standalone",
        "--nproc_per_node=2",
        cli(),
        "--out",
        str(run),
        "--quiet",
        "--stage",
        "sft",
        "--init",
        str(chain / "refinement/final"),
        *SFT,
        "sft.epochs=1",
        "sft.lora_rank=4",
        "training.parallel=fsdp",
        env={**ENV, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert r.returncode == 0, r.stderr[-4000:]
    two, one = csv_rows(run), csv_rows(sft_run)
    assert abs(float(two[0]["val/loss"]) - float(one[0]["val/loss"])) < 1e-5, (
        two[0],
        one[0],
    )  # the whole held-out set, split over ranks
    src, out = weights(chain / "refinement/final"), weights(run / "final")
    assert src.keys() == out.keys() and {k.split(".")[-2] for k in src if not torch.equal(src[k], out[k])} <= {
        "wq",
        "wk",
        "wv",
        "wo",
    }


def test_bad_sft_data_is_one_clear_line(tmp_path):
    "A broken sft.data file stops cipher-train with one line naming the file, before anything is written."
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"instruction": "café", "output": "x"}\n'.encode("latin-1"))
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    for bad, fragment in ((latin1, "line 1, byte offset 20"), (empty, "the file is empty")):
        run = tmp_path / f"run-{bad.stem}"
        r = refused(run, "--stage", "sft", "--init", str(tmp_path / "no-source/final"), *SFT, f"sft.data={bad}")
        assert r.returncode != 0 and str(bad) in r.stderr and fragment in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in r.stderr and r.stderr.strip().startswith("cipher-train: "), r.stderr[-2000:]
        assert not run.exists()  # nothing half-written


def test_a_resume_on_changed_sft_data_is_refused(sft_run, tmp_path):
    "A resume whose SFT data no longer matches RUN/sft_manifest.json stops in one line, before anything is read."
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps(dict(instruction="Hi.", output="Hello.")) + "\n")
    r = refused(sft_run, "--resume", "auto", f"sft.data={other}")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert f"does not match {sft_run / 'sft_manifest.json'}: other.jsonl is new" in lines[0]


def test_sft_manifest_refusals_are_one_line(tmp_path):
    "Over-length data, data that differs from a given sft.manifest, an unpinned hub name: exit 2, nothing written."
    data = tmp_path / "chats.jsonl"
    rows = [dict(instruction=f"Count to {i}.", output=str(i)) for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in [*rows, dict(instruction="Repeat.", output="x" * 400)]))
    manifest = tmp_path / "sft_manifest.json"  # an earlier run's, over other bytes
    manifest.write_text(json.dumps(dict(source=dict(files={"chats.jsonl": dict(sha256="0" * 64, bytes=1)}))))
    cases = (
        ([f"sft.data={data}"], "chats.jsonl': 1 SFT example(s) longer than training.seq_len = 256"),
        ([f"sft.data={data}", f"sft.manifest={manifest}"], f"does not match {manifest}: chats.jsonl has SHA-256"),
        (["sft.data=someone/chats", "sft.revision=main"], "pin it with sft.revision=COMMIT"),
    )
    for extra, fragment in cases:
        run = tmp_path / "run"
        r = refused(run, "--stage", "sft", "--init", str(tmp_path / "none/final"), *SFT, *extra)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and fragment in lines[0], r.stderr[-2000:]
        assert not run.exists()  # nothing trained, nothing written
