"Every shipped preset builds with the parameter count `cipher-config` prints; the CPU byte model logs every piece."

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_cli

from cipher_nb.config.load import load_config
from cipher_nb.config.sizing import param_counts
from cipher_nb.model.lm import CipherModel

PRESETS = sorted((ROOT / "examples/configs").glob("*.yaml"))


def script(name):
    return shutil.which(name) or str(Path(sys.executable).parent / name)


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: Path(p).stem)
def test_preset_builds_on_meta_with_its_counted_parameters(path):
    "Built on the meta device (no memory, so the 2B-parameter H100 presets build on a CPU runner too)."
    cfg = load_config(path)
    with torch.device("meta"):
        model = CipherModel(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == param_counts(cfg.model)["total"], path.name


GPU_PRESETS = [p for p in PRESETS if "h100" in p.stem]


@pytest.mark.parametrize("path", GPU_PRESETS, ids=lambda p: Path(p).stem)
def test_sft_on_a_gpu_preset_takes_the_guides_schedule_and_names_what_it_replaced(path):
    "`PRESET stage.name=sft` (launch/'s stage 3): the training-stage guide's SFT schedule, not the preset's."
    from conftest import run_in_process

    from cipher_nb.config.sizing import cipher_config

    preset = load_config(path)
    cfg = load_config(path, ["stage.name=sft"])
    s, t = cfg.schedule, cfg.training
    assert (s.lr, s.min_lr, s.epochs, s.warmup_frac, s.warmup_steps, s.max_steps) == (2e-5, 0.0, 3, 0.03, 0, 0)
    assert (t.eval_every, t.checkpoint_every, t.eval_at_start) == (0, 0, True)  # an evaluation and a save per epoch
    assert cfg.model == preset.model and cfg.optim == preset.optim  # the stage replaces its own keys only
    r = run_in_process(cipher_config, str(path), "stage.name=sft", pos=["path"])
    assert r.returncode == 0, r.stderr
    said = next(line for line in r.stdout.splitlines() if line.startswith("# stage sft replaces the preset's "))
    for key in ("schedule.lr", "schedule.max_steps", "schedule.warmup_steps", "training.eval_every"):
        was = repr(eval(f"preset.{key}"))
        assert f"{key} {was} -> " in said, (key, said)
    assert f"schedule.lr {preset.schedule.lr!r} -> 2e-05" in said
    r = run_in_process(cipher_config, str(path), "stage.name=sft", "schedule.lr=1e-5", pos=["path"])
    assert "schedule.lr" not in next(x for x in r.stdout.splitlines() if x.startswith("# stage"))  # given for it
    assert "lr: 1.0e-05" in r.stdout


def test_flexitokens_h100_has_the_training_scripts_shapes():
    m = load_config(ROOT / "examples/configs/flexitokens-h100.yaml").model
    r, e = m.recurrence, m.moe
    assert (m.vocab, m.d_model, r.n_prelude, r.n_core, r.n_coda, r.n_loops) == (272, 2048, 2, 6, 2, 6)
    assert (e.kind, e.n_routed, e.top_k, e.shared_inter, e.expert_rank) == ("shared_projection", 32, 2, 6144, 256)
    assert r.halting and r.injection == "lti" and r.loop_lora_rank > 0 and m.boundary.enabled
    assert [i - r.n_prelude for i in m.engram.layers] == [1, 4]  # the core's layers 1 and 4


def test_flexitokens_cpu_logs_halting_and_memory_and_the_gate_reads_them(tmp_path):
    "Every piece on, a few steps: the metrics carry loop/halt_frac_K and engram/..., and cipher-gate has their lines."
    run = tmp_path / "flexi"
    cfg = str(ROOT / "examples/configs/flexitokens-cpu.yaml")
    fast = ["training.eval_every=8", "training.checkpoint_every=8", "training.eval_batches=2", "training.log_every=4"]
    r = run_cli(script("cipher-train"), cfg, *fast, "--max-steps", "8", "--out", str(run), "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    keys = set().union(*rows)
    assert {"loop/halt_frac_1", "loop/mean_loops", "engram/gate", "bp/compression", "loss/ponder"} <= keys, keys
    gate = run_cli(script("cipher-gate"), str(run)).stdout
    assert "halting spread over the loops" in gate and "Engram memory used" in gate, gate
