"cipher-config as a user runs it: the H100 preset prints its values, a bad override or preset exits 2 naming the keys."

import os
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, run_cli, run_in_process


def cli():
    return shutil.which("cipher-config") or str(ROOT / ".venv/bin/cipher-config")


def config(*args):
    "cipher-config ARGS in this process, from the repository root (test_h100_preset_prints_its_values runs a process)."
    from cipher_nb.config.sizing import cipher_config

    args = [str(ROOT / a) if str(a).startswith("examples/") else a for a in args]
    return run_in_process(cipher_config, *args, pos=["path"])  # the pos of its @command


def test_h100_preset_prints_its_values():
    r = run_cli(cli(), "examples/configs/h100.yaml")
    assert r.returncode == 0, r.stderr
    body = yaml.safe_load("\n".join(line for line in r.stdout.splitlines() if not line.startswith("#")))
    m, t, s, o = body["model"], body["training"], body["schedule"], body["optim"]
    a, e = m["attention"], m["moe"]
    assert (m["vocab"], m["d_model"], m["n_layers"], a["n_heads"], a["n_kv_heads"], a["head_dim"]) == (
        32768,
        512,
        12,
        8,
        2,
        64,
    )
    assert (e["n_routed"], e["n_shared"], e["top_k"], e["expert_d_ff"]) == (32, 2, 4, 128)
    # the runbook's 4 x 12 sequences per optimizer step, as one micro-batch of 48 (cipher-plan: it fits an H100)
    assert (t["seq_len"], t["batch_size"], t["grad_accum"], s["lr"], s["min_lr"]) == (2048, 48, 1, 3e-4, 3e-5)
    assert (s["warmup_steps"], s["max_steps"], o["weight_decay"], o["grad_clip"], t["precision"]) == (
        200,
        10000,
        0.1,
        1.0,
        "auto",
    )
    assert t["compile"] is True
    assert (t["checkpoint_every"], t["eval_every"], t["log_every"]) == (500, 500, 10)
    assert "# config hash:" in r.stdout and "active per token" in r.stdout


def test_bad_override_exits_nonzero_naming_the_keys():
    r = config("examples/configs/h100.yaml", "model.moe.top_k=40")
    assert r.returncode != 0
    assert "model.moe.top_k" in r.stderr and "model.moe.n_routed" in r.stderr


def test_old_flat_override_still_applies():
    r = config("examples/configs/h100.yaml", "model.top_k=40")
    assert r.returncode != 0 and "model.moe.top_k (40)" in r.stderr
    r = config("examples/configs/h100.yaml", "model.top_k=2", "model.moe_impl=bmm")
    assert r.returncode == 0, r.stderr
    m = yaml.safe_load("\n".join(line for line in r.stdout.splitlines() if not line.startswith("#")))["model"]
    assert (m["moe"]["top_k"], m["moe"]["impl"]) == (2, "bmm")


def test_flat_key_and_nested_twin_is_an_error(tmp_path):
    p = tmp_path / "both.yaml"
    p.write_text("model:\n  top_k: 2\n  moe:\n    top_k: 4\n")
    r = config(str(p))
    assert r.returncode != 0 and "model.top_k and model.moe.top_k" in r.stderr


def test_unknown_key_suggests_the_closest():
    r = config("examples/configs/tiny-cpu.yaml", "training.warmup=10")
    assert r.returncode != 0 and "did you mean 'schedule.warmup_steps'" in r.stderr


def test_every_preset_loads():
    from cipher_nb.config.load import load_config

    for p in sorted((ROOT / "examples/configs").glob("*.yaml")):
        load_config(p)


def test_presets_are_nested():
    "The presets use the nested model sections, not the old flat keys (which still load, for old files)."
    from cipher_nb.config.load import LEGACY_KEYS, upgrade_keys

    for p in sorted((ROOT / "examples/configs").glob("*.yaml")):
        d = yaml.safe_load(p.read_text()) or {}
        assert upgrade_keys(d) == d, (
            f"{p.name} uses old flat keys: {sorted(set(d.get('model', {})) & {k.split('.')[1] for k in LEGACY_KEYS})}"
        )


def test_old_flat_preset_loads_as_its_nested_form(tmp_path):
    from cipher_nb.config.load import load_config

    flat = tmp_path / "flat.yaml"
    flat.write_text(
        "model:\n  n_heads: 8\n  n_kv_heads: 2\n  top_k: 4\n  n_shared: 2\n  moe_impl: bmm\n"
        "  boundary: false\n  bp_rate: 0.25\n  n_loops: 1\n"
    )
    nested = tmp_path / "nested.yaml"
    nested.write_text(
        "model:\n  attention: {n_heads: 8, n_kv_heads: 2}\n  moe: {top_k: 4, n_shared: 2, impl: bmm}\n"
        "  boundary: {enabled: false, rate: 0.25}\n  recurrence: {n_loops: 1}\n"
    )
    assert load_config(flat) == load_config(nested)


def test_tiny_cpu_is_the_default():
    "cipher-train with no arguments trains tiny-cpu: the preset and the config defaults must stay the same experiment."
    from cipher_nb.config.load import Config, config_hash, critical_diff, load_config

    tiny = load_config(ROOT / "examples/configs/tiny-cpu.yaml")
    assert critical_diff(tiny, Config()) == [] and config_hash(tiny) == config_hash(Config())


def test_tiny_cpu_90s_preset_is_the_default_at_a_small_step():
    "The 90-second preset: the default at half its width and its sweep rate, at a small step, 8 experts, Engram."
    from dataclasses import asdict

    from cipher_nb.config.load import Config, load_config, parse_duration
    from cipher_nb.eval.scaling import FULL_SWEEP

    p, d = load_config(ROOT / "examples/configs/tiny-cpu-90s.yaml"), Config()
    assert (p.training.batch_size, p.training.seq_len) == (12, 64)
    assert parse_duration(p.schedule.time_budget) == 90
    assert p.training.eval_batches * p.training.batch_size * p.training.seq_len >= (
        d.training.eval_batches * d.training.batch_size * d.training.seq_len
    )
    assert asdict(p.data) == asdict(d.data)
    w = d.model.d_model // 2
    assert asdict(p.model) == {
        **asdict(d.model),
        "d_model": w,
        "moe": {**asdict(d.model.moe), "n_routed": 8, "bias_gamma": 3e-3, "expert_d_ff": w},
        "attention": {**asdict(d.model.attention), "head_dim": d.model.attention.head_dim // 2},
        "engram": {**asdict(d.model.engram), "layers": [1, 2]},
    }
    changed = {k for k, v in asdict(p.training).items() if v != asdict(d.training)[k]}
    assert changed == {"batch_size", "seq_len", "eval_batches"}, changed
    # the budget sets the horizon; written without schedule.max_steps, it has no cap (max_steps 0)
    assert {k: v for k, v in asdict(p.schedule).items() if v != asdict(d.schedule)[k]} == {
        "time_budget": "90s",
        "max_steps": 0,
        "lr": FULL_SWEEP.lr_width / w,  # the scaling sweep's rate for the width, min_lr a tenth
        "min_lr": FULL_SWEEP.lr_width / w / 10,
    }
    assert asdict(p.optim) == asdict(d.optim) and p.optim.name == "adamw"  # written out, as the default


def test_tiny_cpu_8m_is_the_90_second_recipe_planned_for_8_minutes():
    "One model at two budgets: what a 90-second ablation reads carries to the 8-minute run."
    from cipher_nb.config.load import config_hash, load_config

    long = load_config(ROOT / "examples/configs/tiny-cpu-8m.yaml")
    short = load_config(ROOT / "examples/configs/tiny-cpu-90s.yaml", ["schedule.time_budget=8m"])
    assert config_hash(long) == config_hash(short)


def test_the_runbooks_guard_rails_warn_and_do_not_refuse():
    "An MoE without warmup, or above 3e-4 in bf16 (auto: bf16 on a GPU): one line each on stderr, exit 0, YAML intact."
    r = config("examples/configs/h100.yaml")
    assert r.returncode == 0 and r.stderr == "", r.stderr  # the runbook's own numbers
    r = config("examples/configs/h100.yaml", "schedule.warmup_steps=0", "schedule.lr=1e-3")
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [
        "cipher-config: warning: schedule.warmup_steps = 0 on an MoE: the cipher-training runbook says DO NOT skip "
        "warmup (routers need warmup before the full learning rate)",
        "cipher-config: warning: schedule.lr = 0.001 on an MoE with training.precision = auto (bf16 on a GPU): the "
        "cipher-training runbook says 0.0003 is the max for a BF16 MoE",
    ]
    assert (
        yaml.safe_load("\n".join(x for x in r.stdout.splitlines() if not x.startswith("#")))["schedule"]["lr"] == 1e-3
    )
    r = config("examples/configs/h100.yaml", "schedule.lr=1e-3", "training.precision=fp32")
    assert r.returncode == 0 and r.stderr == ""  # the rule is about bf16
    r = config("examples/configs/wide-h100.yaml", "schedule.warmup_steps=0", "schedule.lr=1e-3")
    assert r.returncode == 0 and r.stderr == ""  # a dense model has no router


def test_a_key_given_twice_is_one_line_with_exit_code_2(tmp_path):
    "PyYAML keeps the last of two equal keys: the first `training:` section would be dropped without a word."
    dup = tmp_path / "dup.yaml"
    dup.write_text("training:\n  lr: 1.0e-3\ntraining:\n  seed: 1\n")
    r = config(str(dup))
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        f"cipher-config: invalid config: config file '{dup}' line 3: key 'training' is given twice (first on line 1); "
        "keep one of them"
    ]


# cipher-train's own refusals of these (a negative step count, a zero cadence, a directory or a list as the preset)
# are rows of tests/test_reliability.py.


def test_an_unreadable_preset_is_one_line(tmp_path, monkeypatch):
    "chmod 000 stops a read except as root, where the read is made to fail instead."
    from cipher_nb.config.load import ConfigError, load_config

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    p = tmp_path / "locked.yaml"
    p.write_text("training:\n  lr: 1.0e-3\n")
    if os.geteuid() == 0:
        monkeypatch.setattr(Path, "read_text", denied)
    else:
        p.chmod(0)
    with pytest.raises(ConfigError, match=r"locked.yaml' cannot be read \(Permission denied\): check its permissions"):
        load_config(p)


@pytest.mark.parametrize(
    "argv",
    [
        "examples/configs/tiny-cpu-90s.yaml --out RUN data.path=x --max-steps 3",
        "--out RUN examples/configs/tiny-cpu-90s.yaml data.path=x --max-steps 3",
        "--max-steps 3 examples/configs/tiny-cpu-90s.yaml data.path=x --out RUN",
    ],
)
def test_cipher_train_takes_options_and_overrides_in_any_order(argv):
    from cipher_nb.cli import parse_command
    from cipher_nb.train.cli import cipher_train

    args, kwargs = parse_command(cipher_train.__wrapped__, argv.split(), ["config"])
    assert args == ["examples/configs/tiny-cpu-90s.yaml", "data.path=x"]
    assert (kwargs["out"], kwargs["max_steps"]) == ("RUN", 3)


def test_every_console_script_parses_in_any_order():
    "Each `cipher-*` entry point is a `cipher_nb.cli.command` (fastcore's `call_parse` stops at the first option)."
    import importlib
    import re

    from cipher_nb.cli import command

    probe = command(lambda: 0).__code__
    section = (ROOT / "pyproject.toml").read_text().split("[project.scripts]")[1].split("\n[")[0]
    scripts = re.findall(r'^(cipher-[\w-]+) = "([\w.]+):(\w+)"', section, re.M)
    assert len(scripts) >= 7, section
    for name, module, func in scripts:
        assert getattr(importlib.import_module(module), func).__code__ is probe, name
