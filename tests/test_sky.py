"""The SkyPilot task files in launch/sky without SkyPilot: each loads, installs the project, mounts the checkpoint
bucket, and its `run` section, executed by bash with SkyPilot's variables set by hand and DRY_RUN=1, hands the launch
script the node count, GPUs, rendezvous host and run directory that SkyPilot's variables say. SkyPilot's own parser
checks the same files in tools/validate_sky.py (its own virtual environment; run it before a release)."""

import importlib.util
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
TASKS = sorted((ROOT / "launch" / "sky").glob("*.yaml"))
# the variables SkyPilot sets on every node of a task (its distributed-jobs guide)
SKYPILOT_VARS = {"SKYPILOT_NODE_IPS", "SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES", "SKYPILOT_NUM_GPUS_PER_NODE"}
SKYPILOT_VARS |= {"SKYPILOT_TASK_ID"}
IPS = ["10.0.0.5", "10.0.0.6", "10.0.0.7"]


def load_validator():
    spec = importlib.util.spec_from_file_location("validate_sky", ROOT / "tools" / "validate_sky.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def task(name):
    return yaml.safe_load((ROOT / "launch" / "sky" / name).read_text())


def dry_run(t, node_rank=0, num_nodes=1, gpus=8, **extra):
    "The commands the task's `run` section would run on one node: bash with DRY_RUN=1, SkyPilot's variables by hand."
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKYPILOT_")}
    env.update({k: str(v) for k, v in t["envs"].items()})
    env.update(
        SKYPILOT_NODE_IPS="\n".join(IPS[:num_nodes]),
        SKYPILOT_NODE_RANK=str(node_rank),
        SKYPILOT_NUM_NODES=str(num_nodes),
        SKYPILOT_NUM_GPUS_PER_NODE=str(gpus),
        SKYPILOT_TASK_ID="sky-managed-2026-11-30_cipher_id-7",
        DRY_RUN="1",
        **extra,
    )
    for k in ("NNODES", "NPROC", "MASTER_ADDR", "MASTER_PORT", "JOB_ID", "SHARED", "PERSIST", "OUT"):
        env.pop(k, None)  # whatever the task does not set must not leak in from the test's environment
    r = subprocess.run(["bash", "-c", t["run"]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [shlex.split(line) for line in r.stdout.splitlines() if line.strip()]


def command(lines, program):
    "The one printed command that runs `program` (its first word, or the script python runs)."
    found = [c for c in lines if c[0] == program or (len(c) > 1 and c[1].endswith(program))]
    assert len(found) == 1, lines
    return found[0]


def test_task_files_exist():
    assert {p.name for p in TASKS} >= {"node.yaml", "multinode.yaml", "managed.yaml"}


@pytest.mark.parametrize("path", TASKS, ids=lambda p: p.name)
def test_task_shape(path):
    t = yaml.safe_load(path.read_text())
    assert t["resources"]["accelerators"].startswith("H100:")
    assert t["workdir"] == "."
    assert "-e ." in t["setup"] and "torch==${TORCH_VERSION}" in t["setup"]
    script = "launch/train_multinode.sh" if t.get("num_nodes", 1) > 1 else "launch/train_node.sh"
    assert script in t["run"] and (ROOT / script).exists()
    # checkpoints on a bucket that outlives the cluster, mounted (not copied) so new checkpoints reach it
    mount = t["file_mounts"]["/ckpt"]
    assert mount == {"name": "${BUCKET}", "mode": "MOUNT", "persistent": True}
    assert "BUCKET" in t["envs"] and "RUN_NAME" in t["envs"]


@pytest.mark.parametrize("path", TASKS, ids=lambda p: p.name)
def test_task_reads_only_declared_variables(path):
    v = load_validator()
    t = yaml.safe_load(path.read_text())
    for part in ("setup", "run"):
        assert v.undeclared(t[part], set(t["envs"]), SKYPILOT_VARS) == [], part


def test_undeclared_variables_hand_case():
    v = load_validator()
    script = 'export A=1 B="$SKYPILOT_NODE_RANK"\necho $A ${B} $C ${SKPILOT_NUM_NODES:-1} $HOME\n'
    test = v.undeclared(script, envs={"D"}, skypilot_vars=SKYPILOT_VARS)
    assert test == ["C", "SKPILOT_NUM_NODES"]
    assert v.file_mount_refs("/ckpt:\n  name: ${BUCKET}-${RUN}\n") == {"BUCKET", "RUN"}


def test_node_maps_skypilot_variables():
    t = task("node.yaml")
    lines = dry_run(t, gpus=4, OVERRIDES="schedule.max_steps=5")
    pre, run = command(lines, "preflight.py"), command(lines, "torchrun")
    assert pre[pre.index("--gpus") + 1] == "4"
    assert "--standalone" in run and "--nproc_per_node=4" in run
    assert "training.persistent_dir=/ckpt/persist" in run and "schedule.max_steps=5" in run
    assert run[run.index("--out") + 1] == f"runs/{t['envs']['RUN_NAME']}"
    assert run[run.index("--resume") + 1] == "auto"


def test_managed_is_spot_with_recovery():
    t = task("managed.yaml")
    assert t["resources"]["use_spot"] is True
    assert t["resources"]["job_recovery"]["max_restarts_on_errors"] >= 1
    run = command(dry_run(t), "torchrun")
    assert "training.persistent_dir=/ckpt/persist" in run and "--nproc_per_node=8" in run


@pytest.mark.parametrize("node_rank", [0, 2])
def test_multinode_maps_skypilot_variables(node_rank):
    t = task("multinode.yaml")
    lines = dry_run(t, node_rank=node_rank, num_nodes=3, gpus=8)
    run = command(lines, "torchrun")
    # every node, whatever its rank, meets at the first IP of SKYPILOT_NODE_IPS under the task's id
    assert "--nnodes=3" in run and "--nproc_per_node=8" in run
    assert f"--rdzv_endpoint={IPS[0]}:{t['envs']['MASTER_PORT']}" in run
    assert "--rdzv_id=sky-managed-2026-11-30_cipher_id-7" in run
    assert f"--max-restarts={t['envs']['MAX_RESTARTS']}" in run
    assert run[run.index("--out") + 1] == f"/ckpt/runs/{t['envs']['RUN_NAME']}"
    assert "training.persistent_dir=/ckpt/persist" in run
    pre = command(lines, "preflight.py")
    assert pre[pre.index("--out") + 1] == f"/ckpt/runs/{t['envs']['RUN_NAME']}"
