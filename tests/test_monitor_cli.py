"""cipher-gate as a user runs it on a run directory: a healthy run exits 0, a broken one exits 1 with the failing
lines, bad input names the problem."""

import json
import math
import re
import shutil

import yaml
from conftest import ROOT, run_cli, run_in_process

from cipher_nb.eval.harness import cipher_gate


def cli():
    return shutil.which("cipher-gate") or str(ROOT / ".venv/bin/cipher-gate")


def gate(run_dir):
    "cipher-gate RUN_DIR in this process (the console script's wiring: test_healthy_run_passes runs it as one)."
    return run_in_process(cipher_gate, run_dir)


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
            fig, _, reads = fig.partition("  [reads ")
            assert reads.endswith("]"), line  # every line names the metrics it reads
            out[crit] = (verdict, fig)
    return out


def test_healthy_run_passes(tmp_path):
    r = run_cli(cli(), str(make_run(tmp_path, "ok", rows(), {"monitor": {"gate_steps": 100}})))
    assert r.returncode == 0, r.stdout + r.stderr
    t = table(r.stdout)
    assert len(t) == 7 and {v for v, _ in t.values()} == {"PASS", "SKIP"}
    assert t["GPU utilisation over 70%"][0] == "SKIP"  # a CPU run logs no gpu_util
    assert "[reads gpu_util]" in r.stdout and "[reads grad_norm (max of each log window)]" in r.stdout
    assert t["cross-population overlap under 0.3"] == ("SKIP", "populations off (model.moe.n_pop_a = 0)")
    assert "gate PASS: 5 passed, 0 failed, 2 skipped" in r.stdout


def test_broken_run_fails_naming_the_lines(tmp_path):
    bad = rows(
        loss=lambda s: float("nan") if s == 70 else 5 - s / 100,
        grad_norm=lambda s: 35.0 if 60 <= s <= 80 else 1.0,  # three rows in a row: a blow-up
        gpu_util=lambda s: 30.0,
        mfu=lambda s: 0.3,
    )
    r = gate(str(make_run(tmp_path, "bad", bad)))
    assert r.returncode == 1
    t = table(r.stdout)
    fails = sorted(c for c, (v, _) in t.items() if v == "FAIL")
    assert fails == [
        "GPU utilisation over 70%",
        "no blow-up after warmup: gradient norm over 10 in at most 2 of 5 rows",
        "no skipped step, no NaN or inf in the losses and gradient norm",
    ]
    assert t["no blow-up after warmup: gradient norm over 10 in at most 2 of 5 rows"][1].startswith(
        "max 35 at step 60; over 10 in 3 of 15 rows"
    )
    assert "loss at step 70" in t["no skipped step, no NaN or inf in the losses and gradient norm"][1]
    assert t["GPU utilisation over 70%"][1].startswith("busy 30% of the time")
    assert "gate FAIL" in r.stdout


def test_thresholds_and_populations_come_from_config_yaml(tmp_path):
    ov = rows(**{"router/cross_pop_overlap": lambda s: 0.2})
    run = make_run(tmp_path, "pops", ov, {"model": {"n_pop_a": 4}, "monitor": {"max_overlap": 0.1}})
    r = gate(str(run))
    assert r.returncode == 1 and table(r.stdout)["cross-population overlap under 0.1"][0] == "FAIL"
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"n_pop_a": 4}}))
    r = gate(str(run))
    assert r.returncode == 0 and table(r.stdout)["cross-population overlap under 0.3"] == (
        "PASS",
        "0.200, last quarter",
    )


def test_bad_input_is_a_clear_error(tmp_path):
    r = gate(str(tmp_path / "nope"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    (tmp_path / "nometrics").mkdir()
    r = gate(str(tmp_path / "nometrics"))
    assert r.returncode == 2 and "no metrics file" in r.stderr and "metrics.jsonl" in r.stderr
    r = gate(str(make_run(tmp_path, "empty", [])))
    assert r.returncode == 2 and "holds no metrics" in r.stderr
    r = gate(str(make_run(tmp_path, "badcfg", rows(), {"monitor": {"max_grad_norms": 3}})))
    assert r.returncode == 2 and "did you mean 'monitor.max_grad_norm'" in r.stderr


def trainer_rows(n=150, every=10, norms=None, skipped_at=None):
    "Rows as the trainer writes them: grad_norm the max over each window's steps, grad_norm_mean the mean, skips."
    norms, skipped_at, out = norms or {}, skipped_at or [], []
    for r in rows(n, every):
        g = [norms.get(s, 0.9) for s in range(r["step"] - every + 1, r["step"] + 1)]
        at = [s for s in skipped_at if r["step"] - every < s <= r["step"]]
        done = [s for s in skipped_at if s <= r["step"]]
        r.update(
            grad_norm=max(g), grad_norm_mean=sum(g) / every, skipped=len(at), skipped_total=len(done), skipped_at=at
        )
        out.append(r)
    return out


GRAD_LINE = "no blow-up after warmup: gradient norm over 10 in at most 2 of 5 rows"


def test_one_step_spike_passes_a_sustained_one_fails(tmp_path):
    "A spike the clipping absorbed passes; the same step in 3 windows of 5 fails, though every window's mean is low."
    r = gate(str(make_run(tmp_path, "spike", trainer_rows(norms={55: 50.0}))))
    verdict, fig = table(r.stdout)[GRAD_LINE]
    assert r.returncode == 0 and verdict == "PASS" and fig.startswith("max 50 at step 60; over 10 in 1 of 15 rows"), fig
    sustained = trainer_rows(norms={55: 50.0, 65: 50.0, 85: 50.0})
    assert max(r["grad_norm_mean"] for r in sustained) < 10  # the mean over each window would hide it
    r = gate(str(make_run(tmp_path, "sustained", sustained)))
    assert r.returncode == 1 and table(r.stdout)[GRAD_LINE][0] == "FAIL"


def test_warmup_rows_are_not_judged_for_the_gradient_norm(tmp_path):
    "The first steps' norms are the largest of a run: with schedule.warmup_steps in config.yaml they are left out."
    early = trainer_rows(norms={s: 30.0 for s in (5, 15, 25)})
    r = gate(str(make_run(tmp_path, "warm", early, {"schedule": {"warmup_steps": 30}})))
    assert r.returncode == 0 and "rows after step 30" in table(r.stdout)[GRAD_LINE][1], r.stdout
    r = gate(str(make_run(tmp_path, "cold", early, {"schedule": {"warmup_steps": 0}})))
    assert r.returncode == 1 and table(r.stdout)[GRAD_LINE][0] == "FAIL"


def test_skipped_step_fails_and_is_named(tmp_path):
    r = gate(str(make_run(tmp_path, "skip", trainer_rows(skipped_at=[47]))))
    verdict, fig = table(r.stdout)["no skipped step, no NaN or inf in the losses and gradient norm"]
    assert r.returncode == 1 and verdict == "FAIL" and "skipped step 47" in fig


def test_gpu_utilisation_is_read_from_gpu_util(tmp_path):
    busy = rows(gpu_util=lambda s: 92.0, mfu=lambda s: 0.35)
    r = gate(str(make_run(tmp_path, "busy", busy)))
    verdict, fig = table(r.stdout)["GPU utilisation over 70%"]
    assert r.returncode == 0 and verdict == "PASS" and "busy 92%" in fig


def test_a_cuda_run_without_nvml_fails_the_utilisation_line_unless_told(tmp_path):
    "CUDA logs gpu_util as null when NVML measured nothing: not measured, a FAIL; monitor.require_gpu_util=false: SKIP."
    blind = rows(gpu_util=lambda s: None, mfu=lambda s: 0.35)
    r = gate(str(make_run(tmp_path, "blind", blind)))
    verdict, fig = table(r.stdout)["GPU utilisation over 70%"]
    assert r.returncode == 1 and verdict == "FAIL" and fig.startswith("not measured"), r.stdout
    r = gate(str(make_run(tmp_path, "told", blind, {"monitor": {"require_gpu_util": False}})))
    assert r.returncode == 0 and table(r.stdout)["GPU utilisation over 70%"][0] == "SKIP", r.stdout
