"""cipher-gate as a user runs it on a run directory: a healthy run exits 0, a broken one exits 1 with the failing
lines, bad input names the problem."""

import json
import math
import re
import shutil

import yaml
from conftest import ROOT, run_cli


def cli():
    return shutil.which("cipher-gate") or str(ROOT / ".venv/bin/cipher-gate")


def rows(n=150, every=10, **over):
    "Metric rows of a healthy 2-layer MoE run; `over` maps a metric to a function of the step."
    out = []
    for s in range(every, n + 1, every):
        r = {
            "step": s,
            "tokens": s * 4096,
            "loss": 1.5 + 4 * math.exp(-s / 50),
            "loss/lm": 1.5 + 4 * math.exp(-s / 50),
            "loss/z": 2e-3,
            "grad_norm": 0.9,
            "lr": 1e-3,
            "tok_per_s": 2e4,
            "mem_gb": 0.6,
            "router/layer1_max_load": 1.2,
            "router/layer2_max_load": 1.4,
            "router/layer1_entropy": 1.6 + 0.4 * math.exp(-s / 80),
            "router/layer2_entropy": 1.7 + 0.3 * math.exp(-s / 80),
        }
        r.update({k: f(s) for k, f in over.items()})
        out.append(r)
    return out


def make_run(tmp_path, name, metrics, config=None):
    d = tmp_path / name
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    if config is not None:
        (d / "config.yaml").write_text(yaml.safe_dump(config))
    return d


def table(stdout):
    "{criterion: (verdict, figure)} from cipher-gate's output."
    out = {}
    for line in stdout.splitlines():
        if line[:4] in ("PASS", "FAIL", "SKIP"):
            verdict, crit, fig = re.split(r"\s{2,}", line, maxsplit=2)
            out[crit] = (verdict, fig)
    return out


def test_healthy_run_passes(tmp_path):
    r = run_cli(cli(), str(make_run(tmp_path, "ok", rows(), {"monitor": {"gate_steps": 100}})))
    assert r.returncode == 0, r.stdout + r.stderr
    t = table(r.stdout)
    assert len(t) == 7 and {v for v, _ in t.values()} == {"PASS", "SKIP"}
    assert t["GPU utilisation over 70% (MFU as the proxy)"][0] == "SKIP"  # a CPU run logs no MFU
    assert t["cross-population overlap under 0.3"] == ("SKIP", "populations off (model.moe.n_pop_a = 0)")
    assert "gate PASS: 5 passed, 0 failed, 2 skipped" in r.stdout


def test_broken_run_fails_naming_the_lines(tmp_path):
    bad = rows(
        loss=lambda s: float("nan") if s == 70 else 5 - s / 100,
        grad_norm=lambda s: 35.0 if s == 60 else 1.0,
        mfu=lambda s: 0.3,
    )
    r = run_cli(cli(), str(make_run(tmp_path, "bad", bad)))
    assert r.returncode == 1
    t = table(r.stdout)
    fails = sorted(c for c, (v, _) in t.items() if v == "FAIL")
    assert fails == [
        "GPU utilisation over 70% (MFU as the proxy)",
        "gradient norm under 10",
        "no NaN or inf in the losses and gradient norm",
    ]
    assert t["gradient norm under 10"][1] == "max 35 at step 60"
    assert "loss at step 70" in t["no NaN or inf in the losses and gradient norm"][1]
    assert "gate FAIL" in r.stdout


def test_thresholds_and_populations_come_from_config_yaml(tmp_path):
    ov = rows(**{"router/cross_pop_overlap": lambda s: 0.2})
    run = make_run(tmp_path, "pops", ov, {"model": {"n_pop_a": 4}, "monitor": {"max_overlap": 0.1}})
    r = run_cli(cli(), str(run))
    assert r.returncode == 1 and table(r.stdout)["cross-population overlap under 0.1"][0] == "FAIL"
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"n_pop_a": 4}}))
    r = run_cli(cli(), str(run))
    assert r.returncode == 0 and table(r.stdout)["cross-population overlap under 0.3"] == (
        "PASS",
        "0.200, last quarter",
    )


def test_bad_input_is_a_clear_error(tmp_path):
    r = run_cli(cli(), str(tmp_path / "nope"))
    assert r.returncode == 1 and "does not exist" in r.stderr
    (tmp_path / "nometrics").mkdir()
    r = run_cli(cli(), str(tmp_path / "nometrics"))
    assert r.returncode == 1 and "no metrics file" in r.stderr and "metrics.jsonl" in r.stderr
    r = run_cli(cli(), str(make_run(tmp_path, "empty", [])))
    assert r.returncode == 1 and "holds no metrics" in r.stderr
    r = run_cli(cli(), str(make_run(tmp_path, "badcfg", rows(), {"monitor": {"max_grad_norms": 3}})))
    assert r.returncode == 1 and "did you mean 'monitor.max_grad_norm'" in r.stderr
