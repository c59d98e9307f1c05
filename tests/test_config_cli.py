"cipher-config as a user runs it: the H100 preset prints its values, a bad override exits non-zero naming the keys."

import shutil

import yaml
from conftest import ROOT, run_cli


def cli():
    return shutil.which("cipher-config") or str(ROOT / ".venv/bin/cipher-config")


def test_h100_preset_prints_its_values():
    r = run_cli(cli(), "examples/configs/h100.yaml")
    assert r.returncode == 0, r.stderr
    body = yaml.safe_load("\n".join(l for l in r.stdout.splitlines() if not l.startswith("#")))
    m, t = body["model"], body["training"]
    assert (m["vocab"], m["d_model"], m["n_layers"], m["n_heads"], m["n_kv_heads"], m["head_dim"]) == (
        32768,
        512,
        12,
        8,
        2,
        64,
    )
    assert (m["n_routed"], m["n_shared"], m["top_k"], m["expert_d_ff"]) == (32, 2, 4, 128)
    assert (t["seq_len"], t["batch_size"], t["grad_accum"], t["lr"], t["min_lr"]) == (2048, 4, 12, 3e-4, 3e-5)
    assert (t["warmup_steps"], t["max_steps"], t["weight_decay"], t["grad_clip"], t["precision"]) == (
        200,
        10000,
        0.1,
        1.0,
        "bf16",
    )
    assert (t["checkpoint_every"], t["eval_every"], t["log_every"]) == (500, 500, 10)
    assert "# config hash:" in r.stdout and "active per token" in r.stdout


def test_bad_override_exits_nonzero_naming_the_keys():
    r = run_cli(cli(), "examples/configs/h100.yaml", "model.top_k=40")
    assert r.returncode != 0
    assert "top_k" in r.stderr and "n_routed" in r.stderr


def test_unknown_key_suggests_the_closest():
    r = run_cli(cli(), "examples/configs/tiny-cpu.yaml", "training.warmup=10")
    assert r.returncode != 0 and "did you mean 'training.warmup_steps'" in r.stderr


def test_every_preset_loads():
    from cipher_nb.config import load_config

    for p in sorted((ROOT / "examples/configs").glob("*.yaml")):
        load_config(p)


def test_tiny_cpu_is_the_default():
    "cipher-train with no arguments trains tiny-cpu: the preset and the config defaults must stay the same experiment."
    from cipher_nb.config import Config, config_hash, critical_diff, load_config

    tiny = load_config(ROOT / "examples/configs/tiny-cpu.yaml")
    assert critical_diff(tiny, Config()) == [] and config_hash(tiny) == config_hash(Config())
