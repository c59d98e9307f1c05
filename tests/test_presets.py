"Every shipped preset builds with the parameter count `cipher-config` prints; the CPU byte model logs every piece."

import dataclasses
import json
import math
import re
import shutil
import sys
from operator import attrgetter
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


GPU_PRESETS = [p for p in PRESETS if "cpu" not in p.stem]  # h100, wide-h100, flexitokens-h100, qwen3, gpu-card-*


def same_model(stage, preset) -> bool:
    "A stage's model is the preset's, but for the shift of a fresh router's first steps, which a stage turns off."
    moe = dataclasses.replace(stage.moe, center_steps=preset.moe.center_steps)
    return stage.moe.center_steps == 0 and dataclasses.replace(stage, moe=moe) == preset


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
    o = cfg.optim
    assert (o.name, list(o.betas), o.weight_decay) == ("adamw", [0.9, 0.95], 0.1)  # the guide's AdamW
    assert same_model(cfg.model, preset.model) and cfg.training.precision == preset.training.precision
    r = run_in_process(cipher_config, str(path), "stage.name=sft", pos=["path"])
    assert r.returncode == 0, r.stderr
    said = next(line for line in r.stdout.splitlines() if line.startswith("# stage sft replaces the preset's "))
    for key in ("schedule.lr", "schedule.max_steps", "schedule.target_tokens", "schedule.warmup_steps"):
        was, now = attrgetter(key)(preset), attrgetter(key)(cfg)
        assert was == now or f"{key} {was!r} -> " in said, (key, said)  # each key the preset set otherwise
    assert f"training.eval_every {preset.training.eval_every!r} -> " in said
    assert f"schedule.lr {preset.schedule.lr!r} -> 2e-05" in said
    r = run_in_process(cipher_config, str(path), "stage.name=sft", "schedule.lr=1e-5", pos=["path"])
    assert "schedule.lr" not in next(x for x in r.stdout.splitlines() if x.startswith("# stage"))  # given for it
    assert "lr: 1.0e-05" in r.stdout


def test_sft_over_a_muon_preset_trains_with_the_guides_adamw(tmp_path):
    "A stage never inherits the pretraining optimizer: Muon's hidden matrices would train at optim.muon_lr."
    preset = tmp_path / "muon.yaml"  # the 90-second recipe as it was before it moved to AdamW
    preset.write_text((ROOT / "examples/configs/tiny-cpu-90s.yaml").read_text().replace("name: adamw", "name: muon"))
    assert load_config(preset).optim.name == "muon"
    assert load_config(preset, ["stage.name=sft"]).optim.name == "adamw"
    assert load_config(preset, ["stage.name=sft", "optim.name=muon"]).optim.name == "muon"  # given for the stage


def shards_overrides(cfg, path) -> list:
    "The overrides that read `cfg`'s data from the prepared directory `path`: each named source's, or the one source."
    if not cfg.data.sources:
        return ["data.source=shards", f"data.path={path}"]
    return [f"data.sources.{n}.{k}" for n in cfg.data.sources for k in ("source=shards", f"path={path}")]


@pytest.mark.parametrize("path", GPU_PRESETS, ids=lambda p: Path(p).stem)
def test_refinement_on_a_gpu_preset_is_one_pass_over_its_prepared_data(path, tmp_path):
    "`PRESET stage.name=refinement` (launch/'s stage 2): one uncapped pass over prepared shards; on the fly, refused."
    from conftest import run_in_process

    from cipher_nb.config.sizing import cipher_config

    preset = load_config(path)
    shards = shards_overrides(preset, tmp_path / "shards")
    cfg = load_config(path, ["stage.name=refinement", *shards])
    s = cfg.schedule
    assert (s.epochs, s.max_steps, s.target_tokens, s.time_budget) == (1, 0, 0, "")
    assert same_model(cfg.model, preset.model) and cfg.optim == preset.optim and s.lr == preset.schedule.lr
    r = run_in_process(cipher_config, str(path), "stage.name=refinement", pos=["path"])  # its hub data, on the fly
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "stage refinement is one pass over its data" in r.stderr
    assert ("data.sources.NAME: {source: shards" if preset.data.sources else "data.source=shards") in r.stderr
    own = load_config(path, ["stage.name=refinement", "schedule.max_steps=5000"])  # a horizon of its own, not a pass
    assert (own.schedule.epochs, own.schedule.max_steps, own.schedule.target_tokens) == (0, 5000, 0)


def test_flexitokens_h100_has_the_training_scripts_shapes():
    m = load_config(ROOT / "examples/configs/flexitokens-h100.yaml").model
    r, e = m.recurrence, m.moe
    assert (m.vocab, m.d_model, r.n_prelude, r.n_core, r.n_coda, r.n_loops) == (272, 2048, 2, 6, 2, 6)
    assert (e.kind, e.n_routed, e.top_k, e.shared_inter, e.expert_rank) == ("shared_projection", 32, 2, 6144, 256)
    assert r.halting and r.injection == "lti" and r.loop_lora_rank > 0 and m.boundary.enabled
    assert [i - r.n_prelude for i in m.engram.layers] == [1, 4]  # the core's layers 1 and 4


def header(path) -> str:
    "A preset's header comment as one line of text."
    lines = Path(path).read_text().split("\nmodel:")[0].splitlines()
    return " ".join(line.removeprefix("#").strip() for line in lines)


def said(pattern, text) -> tuple:
    "The numbers the header states where `pattern` matches (commas dropped)."
    m = re.search(pattern, text)
    assert m, pattern
    return tuple(float(g.replace(",", "")) for g in m.groups())


def test_flexitokens_h100s_header_states_what_the_config_does():
    "Every figure the Spider preset's header states, read off the header and checked against the loaded config."
    from cipher_nb.config.load import global_batch_tokens, token_budget_steps
    from cipher_nb.model.attention import rope_frequencies

    path = ROOT / "examples/configs/flexitokens-h100.yaml"
    text, cfg = header(path), load_config(path)
    m, t, s, a = cfg.model, cfg.training, cfg.schedule, cfg.model.attention
    assert said(r"width (\d+)", text) == (m.d_model,) and said(r"(\d+) loops", text) == (m.recurrence.n_loops,)
    assert said(r"seq_len (\d+), lr", text) == (t.seq_len,) and said(r"warmup (\d+)", text) == (s.warmup_steps,)
    assert said(r"lr ([\d.e-]+) with min_lr = lr / (\d+)", text) == (s.lr, round(s.lr / s.min_lr))
    assert said(r"checkpoints every (\d+)", text) == (t.checkpoint_every,)
    assert said(r"weight decay ([\d.]+)", text) == (cfg.optim.weight_decay,)
    # the horizon: the token target, no cap, and the steps it buys on 8 GPUs
    assert said(r"token target, ([\d,]+) tokens", text) == (s.target_tokens,) and s.max_steps == 0
    gpus, per_gpu, seq, per_step, steps = said(
        r"On (\d+) GPUs a step reads \d+ x (\d+) x (\d+) = ([\d,]+) tokens: ([\d,]+)", text
    )
    assert (per_gpu, seq) == (t.batch_size * t.grad_accum, t.seq_len)
    assert (per_step, steps) == (global_batch_tokens(t, int(gpus)), token_budget_steps(s, t, int(gpus)))
    assert said(r"(\d+) sequences per GPU", text) == (per_gpu,)
    assert said(r"a micro-batch of (\d+) and (\d+) accumulation steps", text) == (t.batch_size, t.grad_accum)
    # YaRN: the context it reaches, and the pairs it rescales at every length, counted by hand from YaRN's ramp
    factor, orig, context = said(r"factor (\d+) \(rope_scaling\) over an original context of ([\d,]+)", text) + said(
        r"= ([\d,]+) positions", text
    )
    assert (factor, orig, context) == (a.rope_scaling, a.rope_orig_ctx, a.rope_scaling * a.rope_orig_ctx)
    pairs = a.rope_head_dim // 2
    turns = [a.rope_orig_ctx / (2 * math.pi) * a.rope_base ** (-2 * i / a.rope_head_dim) for i in range(pairs)]
    by_hand = (sum(r < 32 for r in turns), pairs, sum(r <= 1 for r in turns))  # YaRN's beta_fast 32, beta_slow 1
    assert said(r"it rescales (\d+) of MLA's (\d+) RoPE frequency pairs \((\d+) by the whole factor", text) == by_hand
    plain, _ = rope_frequencies(a.rope_head_dim, a.rope_base)
    yarn, scale = rope_frequencies(a.rope_head_dim, a.rope_base, a.rope_scaling, a.rope_orig_ctx)
    ratio = (yarn / plain).tolist()
    assert (sum(r < 1 - 1e-6 for r in ratio), sum(abs(r - 1 / factor) < 1e-6 for r in ratio)) == (
        by_hand[0],
        by_hand[2],
    )
    assert f"attention by 0.1 ln {factor:g} + 1" in text and scale == 0.1 * math.log(a.rope_scaling) + 1
    assert said(r"sliding window \((\d+)\) masks nothing at seq_len (\d+)", text) == (a.sliding_window, t.seq_len)
    assert a.sliding_window >= t.seq_len


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
