"""launch/smoke.sh end to end on CPU (one process under torchrun, gloo): preflight, a run killed after its half-way
checkpoint, a resume from the persistent mirror into an empty run directory, the gate and the plots."""

import os
import sys
from pathlib import Path

import conftest
from conftest import ROOT, run_cli

TINY = ["training.device=cpu", *conftest.TINY]


def test_smoke_run_on_cpu(tmp_path):
    bin_dir = str(Path(sys.executable).parent)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PY": sys.executable,
        "NPROC": "1",
        "SMOKE_STEPS": "8",
        "PREFLIGHT_ARGS": "--skip-gpu",
        "PERSIST": str(tmp_path / "persist"),
        "OUT": str(tmp_path / "run"),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    r = run_cli("bash", str(ROOT / "launch/smoke.sh"), "examples/configs/tiny-cpu.yaml", *TINY, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for line in (
        "ok: step 4's checkpoint reached the persistent volume",
        "ok: the resumed run finished and exported",
        "ok: its metrics reach step 8",
        "smoke PASS",
    ):
        assert line in r.stdout
    assert (
        "resumed from " + str(tmp_path / "persist/run/checkpoints/step_0000004") in r.stderr
    )  # from the mirror, not local disk
    resumed = tmp_path / "run-resumed"
    assert (resumed / "final/COMPLETE").exists() and (resumed / "plots/training.png").exists()
    assert (
        tmp_path / "persist/run-resumed/checkpoints/step_0000008/COMPLETE"
    ).exists()  # the finished run is mirrored too


def test_smoke_stops_when_preflight_fails(tmp_path):
    "Without --skip-gpu on a CPU machine the preflight fails and nothing trains."
    env = {
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PY": sys.executable,
        "NPROC": "1",
        "PERSIST": str(tmp_path / "persist"),
        "OUT": str(tmp_path / "run"),
        "CUDA_VISIBLE_DEVICES": "",
    }
    r = run_cli("bash", str(ROOT / "launch/smoke.sh"), "examples/configs/tiny-cpu.yaml", *TINY, env=env)
    assert r.returncode == 1 and "preflight FAIL: gpu" in r.stdout
    assert not (tmp_path / "run/metrics.jsonl").exists()
