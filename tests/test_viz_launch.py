"""launch/: the preflight on a CPU machine (fails cleanly without a GPU, passes its other checks with --skip-gpu, names
each problem), and the torchrun commands the node and multi-node scripts would run."""

import importlib.util
import io
import shlex
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest
from conftest import ROOT, TINY, run_cli

PY = sys.executable


def preflight(*args):
    "launch/preflight.py as a program, on a machine that shows no GPU."
    return run_cli(PY, str(ROOT / "launch/preflight.py"), *args, env={"CUDA_VISIBLE_DEVICES": ""})


def preflight_in_process(*args):
    "The preflight's main() on ARGS in this process, for the checks that --skip-gpu leaves (no GPU is touched)."
    assert "--skip-gpu" in args
    spec = importlib.util.spec_from_file_location("preflight", ROOT / "launch/preflight.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = mod.main([str(a) for a in args])
    return subprocess.CompletedProcess(["preflight.py", *args], code, out.getvalue(), err.getvalue())


def lines(out):
    "{check name: (status, figure)} from the preflight's table."
    res = {}
    for line in out.splitlines():
        if line[:4] in ("PASS", "FAIL", "SKIP"):
            name, fig = line[6:].split("  ", 1)
            res[name.strip()] = (line[:4], fig.strip())
    return res


def test_preflight_fails_cleanly_without_gpu(tmp_path):
    r = preflight(
        "examples/configs/tiny-cpu.yaml",
        f"training.persistent_dir={tmp_path / 'persist'}",
        "--out",
        str(tmp_path / "run"),
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    res = lines(r.stdout)
    assert res["gpu"][0] == "FAIL" and "no CUDA GPU" in res["gpu"][1] and "--skip-gpu" in res["gpu"][1]
    assert r.stdout.strip().splitlines()[-1] == "preflight FAIL: gpu"  # the only failure is the GPU
    assert all(s in ("PASS", "SKIP") for n, (s, _) in res.items() if n != "gpu")


def test_preflight_passes_non_gpu_checks_with_flag(tmp_path):
    persist = tmp_path / "persist"
    args = ["--skip-gpu", "--gpu", "h100", "--gpus", "8", f"training.persistent_dir={persist}", *TINY]
    r = preflight_in_process(*args, "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stdout + r.stderr
    res = lines(r.stdout)
    assert res["gpu"][0] == "SKIP"
    assert res["plan"][1].startswith("8 x h100, ddp: peak "), res["plan"]  # planned for the named GPU
    for name in (
        "config",
        "disk: run directory",
        "run directory writable",
        "persistent checkpoint directory",
        "disk: persistent directory",
        "data reachable",
        "plan",
    ):
        assert res[name][0] == "PASS", (name, res[name])
    assert "one batch (2, 64)" in res["data reachable"][1]  # the real loader, this config's batch shape
    assert persist.is_dir() and list(persist.iterdir()) == []  # the probe file was cleaned up
    assert r.stdout.strip().splitlines()[-1] == "preflight PASS"


@pytest.mark.parametrize(
    "extra, check, expect, code",
    [  # exit 2: the failure is in the input (a config, data or --init cipher-train would refuse with 2)
        ([], "persistent checkpoint directory", "training.persistent_dir is empty", 1),
        (["training.persistent_dir=/etc/hostname/ckpt"], "persistent checkpoint directory", "Not a directory", 1),
        (["PERSIST", "data.source=files", "data.path=/nonexistent/*.txt"], "data reachable", "/nonexistent", 2),
        (["PERSIST", "--min-disk-gb", "1e9"], "disk: run directory", "need 1,000,000,000.0 GB", 1),
        (["PERSIST", "model.moe.top_k=40"], "config", "model.moe.top_k", 2),
        (["PERSIST", "INIT"], "init source", "no_such_checkpoint", 2),
    ],
)
def test_preflight_names_each_problem(tmp_path, extra, check, expect, code):
    sub = {
        "PERSIST": f"training.persistent_dir={tmp_path / 'p'}",
        "INIT": f"stage.init={tmp_path / 'no_such_checkpoint'}",
    }
    extra = [sub.get(e, e) for e in extra]
    r = preflight_in_process("--skip-gpu", *TINY, *extra, "--out", str(tmp_path / "run"))
    assert r.returncode == code and "Traceback" not in r.stdout + r.stderr
    res = lines(r.stdout)
    assert res[check][0] == "FAIL" and expect in res[check][1], res[check]
    assert (
        r.stdout.strip().splitlines()[-1].startswith("preflight FAIL: ") and check in r.stdout.strip().splitlines()[-1]
    )


def dry(script, *args, **env):
    r = run_cli("bash", str(ROOT / "launch" / script), *args, env={"DRY_RUN": "1", **env})
    assert r.returncode == 0, r.stderr
    return [shlex.split(line) for line in r.stdout.splitlines() if line.strip()]


def test_single_node_command():
    pre, train = dry("train_node.sh", "examples/configs/h100.yaml", "schedule.lr=2e-4", PERSIST="/mnt/p", RUN_NAME="a")
    assert pre[1].endswith("launch/preflight.py") and "--gpus" in pre and pre[pre.index("--gpus") + 1] == "8"
    assert train[:5] == ["torchrun", "--standalone", "--nproc_per_node=8", "--no-python", "cipher-train"]
    assert "training.persistent_dir=/mnt/p" in train and "schedule.lr=2e-4" in train
    assert "data.tokenizer=/mnt/p/tokenizers/h100.json" in train  # the token-level preset's tokenizer, trained once
    # its documents tokenized once into the persistent volume, then read as shards
    assert "data.source=shards" in train and "data.path=/mnt/p/shards/h100" in train
    assert train[train.index("--out") + 1] == "runs/a" and train[train.index("--resume") + 1] == "auto"
    # preflight checks exactly the config the job trains
    assert pre[2 : pre.index("--gpus")] == train[5 : train.index("--out")]


def test_multi_node_command():
    pre, train = dry(
        "train_multinode.sh",
        "examples/configs/h100.yaml",
        NNODES="4",
        MASTER_ADDR="10.0.0.1",
        JOB_ID="job7",
        SHARED="/mnt/s",
        NPROC="8",
    )
    assert train[0] == "torchrun" and "--nnodes=4" in train and "--nproc_per_node=8" in train
    assert "--rdzv_backend=c10d" in train and "--rdzv_endpoint=10.0.0.1:29500" in train and "--rdzv_id=job7" in train
    assert train[train.index("--out") + 1] == "/mnt/s/runs/job7"  # shared storage: every rank reads it on resume
    assert "training.persistent_dir=/mnt/s/persist" in train


@pytest.mark.parametrize(
    "script, env, missing", [("train_node.sh", {}, "PERSIST"), ("train_multinode.sh", {"NNODES": "2"}, "MASTER_ADDR")]
)
def test_scripts_name_a_missing_setting(script, env, missing):
    r = run_cli(
        "bash", str(ROOT / "launch" / script), "examples/configs/h100.yaml", env={"DRY_RUN": "1", "PERSIST": "", **env}
    )
    assert r.returncode == 2 and f"set {missing}" in r.stderr
