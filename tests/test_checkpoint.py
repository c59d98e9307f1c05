"""Checkpoint I/O as a run meets it: a save killed with SIGKILL, a truncated file, unsafe pickles, the stage and
resume rules, the export."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from torch import nn

from cipher_nb.config.load import load_config
from cipher_nb.faults import SAVE_POINTS, arm_save_fault, disarm_save_fault
from cipher_nb.persist.checkpointer import (
    Checkpointer,
    checkpoint_meta,
    load_weights,
    restore_training_state,
    training_state,
)
from cipher_nb.persist.export import compare_state_dicts, export_model
from cipher_nb.persist.files import (
    EXPORT_WEIGHTS,
    MARKER,
    STATE,
    CheckpointError,
    CheckpointWarning,
    ResumeError,
    StageError,
    UnsafeCheckpointError,
    UnverifiedWarning,
    copy_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_exported,
    read_meta,
    safe_load,
    save_checkpoint,
    verify_checkpoint,
    write_marker,
)
from cipher_nb.persist.stages import check_init_source, check_resume

SAVE_TWO = """
import sys, torch
from cipher_nb.persist.checkpointer import Checkpointer
from cipher_nb.faults import arm_save_fault
ck = Checkpointer(sys.argv[1], keep_last=3, background=sys.argv[3] == 'bg')
ck.save(1, dict(w=torch.full((1000,), 1.0), step=1), dict(step=1)); ck.wait()
point, action = sys.argv[2].split(':'); arm_save_fault(point, action)
ck.save(2, dict(w=torch.full((200_000,), 2.0), step=2), dict(step=2)); ck.wait()
print('save finished', flush=True)   # never reached: the fault pauses or kills the save
"""


def run_until_fault(root, spec, mode="fg"):
    "Start a process that saves step 1, then step 2 with the fault `spec`; SIGKILL it at the pause; return its exit."
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(
        [sys.executable, "-c", SAVE_TWO, str(root), spec, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        if spec.endswith(":die"):
            p.wait(timeout=120)
        else:
            line = p.stdout.readline()
            assert "save paused at" in line, (line, p.stderr.read() if p.poll() is not None else "")
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode


def assert_only_step_one(root):
    steps = [s for s, _ in list_checkpoints(root)]
    assert steps == [1], steps
    assert latest_checkpoint(root).name == "step_0000001"
    assert torch.equal(load_checkpoint(root / "step_0000001")["w"], torch.full((1000,), 1.0))
    with pytest.raises(CheckpointError, match="step_0000002"):
        read_meta(root / "step_0000002")


@pytest.mark.parametrize("point", SAVE_POINTS)
def test_sigkill_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path, point):
    rc = run_until_fault(tmp_path, f"{point}:pause")
    assert rc == -signal.SIGKILL
    assert_only_step_one(tmp_path)
    # the next save of the run clears what the killed one left behind
    Checkpointer(tmp_path, keep_last=3).save(3, dict(w=torch.zeros(3)), dict(step=3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000001", "step_0000003"]


def test_background_save_killed_mid_write(tmp_path):
    assert run_until_fault(tmp_path, "write:pause", mode="bg") == -signal.SIGKILL
    assert_only_step_one(tmp_path)


def test_fault_die_kills_the_process_itself(tmp_path):
    assert run_until_fault(tmp_path, "marker:die") == -signal.SIGKILL
    assert_only_step_one(tmp_path)
    assert (tmp_path / "step_0000002" / STATE).is_file()  # renamed, complete on disk, but unmarked: it does not exist


def _three(tmp_path):
    root = tmp_path / "run"
    for s in (1, 2, 3):
        save_checkpoint(root / "checkpoints" / f"step_{s:07d}", dict(w=torch.full((4096,), float(s))), dict(step=s))
    return root


def test_truncated_checkpoint_clear_error_and_auto_resume_falls_back(tmp_path):
    root = _three(tmp_path)
    f = root / "checkpoints" / "step_0000003" / STATE
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"step_0000003/state\.pt: .* truncated or damaged"):
        load_checkpoint(f.parent)
    with pytest.warns(CheckpointWarning, match=r"skipping damaged checkpoint step_0000003.*falling back"):
        assert latest_checkpoint(root).name == "step_0000002"
    # a damaged file with no marker to compare against still fails with a message naming it
    g = tmp_path / "loose.pt"
    g.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="loose.pt: damaged or truncated"):
        safe_load(g)


def flip_byte(f, at=None):
    "Change one byte of `f` (the middle by default), keeping its size."
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2 if at is None else at] ^= 0x55
    f.write_bytes(raw)


def test_flipped_byte_is_refused_by_name_and_skipped_by_latest(tmp_path):
    root = _three(tmp_path)
    f = root / "checkpoints" / "step_0000003" / STATE
    flip_byte(f)
    with pytest.raises(CheckpointError, match=r"step_0000003/state\.pt: its SHA-256 does not match the marker's"):
        load_checkpoint(f.parent)
    with pytest.warns(CheckpointWarning, match=r"skipping damaged checkpoint step_0000003: .*SHA-256 does not match"):
        assert latest_checkpoint(root).name == "step_0000002"
    with pytest.raises(CheckpointError, match="fails its CRC check"):  # the deep check, all an old marker offers
        verify_checkpoint(f.parent, deep=True, checksums=False)


def test_an_old_marker_loads_with_one_note(tmp_path):
    root = _three(tmp_path)
    ck = root / "checkpoints" / "step_0000003"
    m = json.loads((ck / MARKER).read_text())
    (ck / MARKER).write_text(json.dumps(dict(files=m["files"], time=m["time"], step=3)))  # sizes only
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert latest_checkpoint(root).name == "step_0000003"
        assert torch.equal(load_checkpoint(ck)["w"], torch.full((4096,), 3.0))
        load_checkpoint(ck)
    assert [x.category for x in w] == [UnverifiedWarning], [str(x.message) for x in w]
    assert "step_0000003: its marker predates checksums (sizes only)" in str(w[0].message)


def test_a_resume_reads_each_file_once(tmp_path, monkeypatch):
    import hashlib

    import cipher_nb.persist.checksum as cs

    p, _ = _pretrain_ckpt(tmp_path, "fp")
    monkeypatch.setattr(cs, "SETTLED_S", -1.0)  # as if the files were written long ago
    hashed = []
    real = hashlib.sha256
    monkeypatch.setattr(hashlib, "sha256", lambda *a: hashed.append(1) or real(*a))
    assert latest_checkpoint(p.parent) == p  # what cipher-train --resume auto does: find, restore, read the trainer
    restore_training_state(p, nn.Linear(4, 4))
    load_checkpoint(p, keys=("step",))
    assert len(hashed) == 2  # state.pt and meta.json, once each


@pytest.mark.parametrize("background", [False, True], ids=["blocking", "background"])
@pytest.mark.parametrize("point", SAVE_POINTS)
def test_a_full_disk_at_each_save_point_keeps_the_previous_checkpoint(tmp_path, point, background):
    ck = Checkpointer(tmp_path, keep_last=3, background=background)
    ck.save(1, dict(w=torch.full((1000,), 1.0)), dict(step=1))
    ck.save_best(dict(w=torch.full((1000,), 1.0)), dict(step=1), 2.0)
    ck.wait()
    for save in (
        lambda: ck.save(2, dict(w=torch.zeros(200_000)), dict(step=2)),
        lambda: ck.save_best(dict(w=torch.zeros(200_000)), dict(step=2), 1.0),
    ):
        arm_save_fault(point, "enospc")
        try:
            with pytest.raises((OSError, CheckpointError), match="No space left on device"):
                save()
                ck.wait()
        finally:
            disarm_save_fault()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "step_0000001"]  # no .tmp-, no .old-
        assert latest_checkpoint(tmp_path).name == "step_0000001"
        for name in ("step_0000001", "best"):
            verify_checkpoint(tmp_path / name)
            assert torch.equal(load_checkpoint(tmp_path / name)["w"], torch.full((1000,), 1.0))


def test_copy_of_a_changed_checkpoint_is_refused_and_writes_no_mirror(tmp_path):
    root = _three(tmp_path)
    src = root / "checkpoints" / "step_0000003"
    copy_checkpoint(src, tmp_path / "vol" / "step_0000003")
    first = json.loads((tmp_path / "vol" / "step_0000003" / MARKER).read_text())
    assert first["sha256"] == json.loads((src / MARKER).read_text())["sha256"]
    flip_byte(src / STATE)
    with pytest.raises(CheckpointError, match=r"step_0000003/state\.pt: its SHA-256 does not match"):
        copy_checkpoint(src, tmp_path / "vol" / "step_0000004")
    with pytest.raises(CheckpointError, match="SHA-256 does not match"):
        copy_checkpoint(src, tmp_path / "vol" / "step_0000003")  # over the good copy: it stays
    assert sorted(p.name for p in (tmp_path / "vol").iterdir()) == ["step_0000003"]
    verify_checkpoint(tmp_path / "vol" / "step_0000003")


def test_a_full_disk_while_mirroring_or_exporting_keeps_the_previous_one(tmp_path, monkeypatch):
    import errno

    import cipher_nb.persist.export as ex
    import cipher_nb.persist.files as ckpt

    root = _three(tmp_path)
    copy_checkpoint(root / "checkpoints" / "step_0000002", tmp_path / "vol" / "step_0000002")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(ckpt, "copy_hashed", full)
        with pytest.raises(OSError, match="No space"):
            copy_checkpoint(root / "checkpoints" / "step_0000003", tmp_path / "vol" / "step_0000002")
    assert sorted(p.name for p in (tmp_path / "vol").iterdir()) == ["step_0000002"]
    assert torch.equal(load_checkpoint(tmp_path / "vol" / "step_0000002")["w"], torch.full((4096,), 2.0))
    export_model(TiedLM(), tmp_path / "final", config={}, codec={})
    before = verify_checkpoint(tmp_path / "final")["sha256"]
    with monkeypatch.context() as m:
        m.setattr(ex, "file_sha256", full)  # after the weights were written and compared
        with pytest.raises(OSError, match="No space"):
            export_model(TiedLM(), tmp_path / "final", config={}, codec={})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "run", "vol"]
    assert verify_checkpoint(tmp_path / "final")["sha256"] == before


def test_unsafe_pickle_is_refused_and_never_runs(tmp_path):
    canary = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (canary,))

    ck = tmp_path / "step_0000001"
    ck.mkdir()
    torch.save(dict(model=Evil()), ck / STATE)
    (ck / "meta.json").write_text('{"step": 1}')
    write_marker(ck, step=1)
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"step_0000001/state\.pt: refused: loading it needs the Python object .*can run code",
    ):
        load_checkpoint(ck)
    with pytest.raises(UnsafeCheckpointError, match="add_safe_globals"):
        load_weights(ck, nn.Linear(2, 2))
    assert not canary.exists()


def _pretrain_ckpt(tmp_path, fingerprint, stage="pretrain", **over):
    cfg = load_config(None, [f"stage.name={stage}", *[f"{k}={v}" for k, v in over.items()]])
    m = nn.Linear(4, 4)
    opt = torch.optim.AdamW(m.parameters(), lr=cfg.schedule.lr)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    return save_checkpoint(
        tmp_path / stage / "step_0000010",
        training_state(m, opt, step=10, tokens=640),
        checkpoint_meta(cfg, step=10, tokens=640, data_fingerprint=fingerprint),
    ), cfg


def selection_fingerprint(doc_ids):
    return hashlib.sha256(
        json.dumps(dict(sources=["stdlib@3.11"], shards=[0, 1], docs=list(doc_ids))).encode()
    ).hexdigest()


def test_pretrain_to_sft_is_rejected_with_the_reason(tmp_path):
    p, _ = _pretrain_ckpt(tmp_path, "fp")
    sft, declared = (
        load_config(None, ["stage.name=sft"]),
        load_config(None, ["stage.name=sft", "stage.source_stage=refinement"]),
    )
    with pytest.raises(StageError, match=r"pretrain -> sft is refused: .*pretrain -> refinement -> sft"):
        check_init_source(p, sft.stage, sft.data)
    with pytest.raises(StageError, match=r"declares 'refinement' but the checkpoint is from stage 'pretrain'"):
        check_init_source(p, declared.stage, declared.data)


def test_refinement_on_another_selection_of_equal_size_is_rejected(tmp_path):
    pre_docs, other_docs = list(range(500)), list(range(499)) + [10_000]  # same count, one document swapped
    assert len(pre_docs) == len(other_docs)
    fp_pre, fp_other = selection_fingerprint(pre_docs), selection_fingerprint(other_docs)
    p, _ = _pretrain_ckpt(tmp_path, fp_pre)
    (p / STATE).write_bytes(b"garbage")  # the check reads metadata only, before any model exists
    refine = load_config(None, ["stage.name=refinement"])
    check_init_source(p, refine.stage, refine.data, fp_pre)
    with pytest.raises(StageError, match=rf"fingerprint {fp_other} here, {fp_pre} in the checkpoint"):
        check_init_source(p, refine.stage, refine.data, fp_other)
    with pytest.raises(StageError, match="fail closed"):
        check_init_source(p, refine.stage, refine.data, "")


def test_resume_with_a_changed_lr_is_refused_naming_the_key(tmp_path):
    p, cfg = _pretrain_ckpt(tmp_path, "fp")
    check_resume(read_meta(p), cfg, world_size=1)
    changed = load_config(None, ["schedule.lr=5e-4"])
    with pytest.raises(ResumeError, match=r"schedule\.lr: 0\.001 in the checkpoint, 0\.0005 now"):
        check_resume(read_meta(p), changed, world_size=1)
    with pytest.raises(ResumeError, match=r"\(world_size\)"):
        check_resume(read_meta(p), cfg, world_size=8)


def test_exact_resume_restores_everything(tmp_path):
    p, cfg = _pretrain_ckpt(tmp_path, "fp")
    torch.manual_seed(1)
    m = nn.Linear(4, 4)
    opt = torch.optim.AdamW(m.parameters(), lr=cfg.schedule.lr)
    info = restore_training_state(p, m, opt)
    saved = load_checkpoint(p)
    assert (info["step"], info["tokens"]) == (10, 640)
    assert compare_state_dicts(saved["model"], m.state_dict()) == []
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], saved["optimizer"]["state"][0]["exp_avg"])


class TiedLM(nn.Module):
    def __init__(self, vocab=97, d=24):
        super().__init__()
        self.embed, self.block, self.lm_head = nn.Embedding(vocab, d), nn.Linear(d, d), nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed.weight
        self.register_buffer("rope_cache", torch.randn(8, d))


def test_export_round_trip_with_tied_weights(tmp_path):
    torch.manual_seed(0)
    model = TiedLM()
    with torch.no_grad():
        model.block.weight[0, 0] = float("nan")  # compared bit for bit, NaN included
    cfg = load_config()
    hashes = export_model(
        model,
        tmp_path / "final",
        config=cfg.to_dict(),
        codec=dict(kind="tokenizer", vocab=97),
        meta=checkpoint_meta(cfg, step=5),
    )
    final = tmp_path / "final"
    assert sorted(hashes) == ["config.json", "meta.json", "model.safetensors"]
    for f, h in hashes.items():
        assert hashlib.sha256((final / f).read_bytes()).hexdigest() == h
    sd = load_exported(final)
    assert compare_state_dicts(model.state_dict(), sd) == []
    assert sd["lm_head.weight"] is sd["embed.weight"]
    fresh = TiedLM()
    load_weights(final, fresh)
    assert fresh.lm_head.weight is fresh.embed.weight
    assert compare_state_dicts(model.state_dict(), fresh.state_dict()) == []
    assert json.loads((final / "config.json").read_text())["tied"] == {"lm_head.weight": "embed.weight"}
    assert read_meta(final)["stage"] == "pretrain"
    flip_byte(final / EXPORT_WEIGHTS, at=-3)  # one byte of the last float: same size, still a safetensors file
    assert load_exported(final)["block.bias"] is not None  # the file alone does not tell
    with pytest.raises(CheckpointError, match=r"final/model\.safetensors: its SHA-256 does not match the marker's"):
        load_weights(final, TiedLM())
    (final / EXPORT_WEIGHTS).write_bytes((final / EXPORT_WEIGHTS).read_bytes()[:50])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_exported(final)


def test_a_changed_export_is_refused_by_load(tmp_path):
    from cipher_nb.model.lm import CipherModel
    from cipher_nb.persist.export import load

    cfg = load_config(
        None, ["model.d_model=32", "model.n_layers=1", "model.moe.n_routed=2", "model.moe.expert_d_ff=16"]
    )
    export_model(CipherModel(cfg.model), tmp_path / "final", config=cfg.to_dict(), codec=dict(kind="bytes"))
    load(tmp_path)
    flip_byte(tmp_path / "final" / EXPORT_WEIGHTS)
    with pytest.raises(CheckpointError, match=r"final/model\.safetensors: its SHA-256 does not match the marker's"):
        load(tmp_path)


def test_export_round_trip_failure_is_reported(tmp_path, monkeypatch):
    import cipher_nb.persist.export as ex

    real = ex.load_exported

    def lossy(path):
        sd = real(path)
        sd["block.bias"] = sd["block.bias"] + 1
        return sd

    monkeypatch.setattr(ex, "load_exported", lossy)
    with pytest.raises(CheckpointError, match=r"round trip .*block\.bias: values differ"):
        export_model(TiedLM(), tmp_path / "final", config={}, codec={})
    assert not (tmp_path / "final").exists()
