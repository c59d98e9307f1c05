"""Scale-out on one machine: two torchrun "nodes" joined by c10d rendezvous on 127.0.0.1 (launch/train_multinode.sh),
a lost rank restarted by torchrun --max-restarts, the single-process supervisor (launch/supervise.sh), and
background sharded (FSDP2) checkpoints. Every check compares against an uninterrupted run or a blocking save."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import ONE_THREAD, RESUME, RESUME_EVERY, ROOT, SMALL_MODEL, end_launch, run_cli, stop_once_saved

BIN = Path(sys.executable).parent
STEPS, EVERY = 6, 3  # the fault lands on the checkpoint half way
SETTINGS = [  # a small FSDP2 run on CPU: each rank writes its own shards into the shared run directory
    *SMALL_MODEL,
    "training.seq_len=64",
    "training.batch_size=4",
    "training.eval_batches=1",
    "schedule.warmup_steps=1",
    f"schedule.max_steps={STEPS}",
    "training.log_every=1",
    f"training.checkpoint_every={EVERY}",
    f"training.eval_every={EVERY}",
    "training.parallel=fsdp",
    "training.device=cpu",
]
ENV = {
    "CUDA_VISIBLE_DEVICES": "",
    "OMP_NUM_THREADS": "1",
    "PY": sys.executable,
    "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run / "final" / "model.safetensors")


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def one_launch(tmp_path_factory):
    "The reference: one torchrun launch of two processes (--standalone), uninterrupted."
    out = tmp_path_factory.mktemp("one_launch") / "run"
    r = run_cli(
        str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "--no-python",
        "cipher-train", *SETTINGS, "--out", str(out), "--quiet", env=ENV, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    return weights(out)


def two_nodes(shared: Path, job: str, *extra, fault_on_second: str = "", max_restarts: int = 0, timeout: int = 300):
    "launch/train_multinode.sh twice, as two one-process nodes rendezvousing on 127.0.0.1; their results."
    env = {
        **ENV,
        "NNODES": "2",
        "NPROC": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "JOB_ID": job,
        "SHARED": str(shared),
        "MAX_RESTARTS": str(max_restarts),
        "PREFLIGHT_ARGS": "--skip-gpu",
        "SHARDS": "0",  # the documents on the fly, as the one launch it is compared with reads them
    }
    cmd = ["bash", str(ROOT / "launch/train_multinode.sh"), *SETTINGS, *extra]
    nodes = [
        subprocess.Popen(
            cmd,
            env={**os.environ, **env, "TRAIN_ARGS": fault if i else ""},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a process group per node: a timeout ends the node's torchrun and ranks too
        )
        for i, fault in enumerate(["", fault_on_second])
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in nodes]
        return [(p.returncode, *o) for p, o in zip(nodes, outs)]
    finally:
        for p in nodes:
            if p.poll() is None:
                end_launch(p)


def test_two_nodes_on_one_machine_end_like_one_launch(tmp_path, one_launch):
    """Two torchrun launches (--nnodes 2, c10d rendezvous on 127.0.0.1, one process each), saving in the background:
    the weights of one launch that saved blocking."""
    res = two_nodes(tmp_path, "two-nodes", "training.background_save=true")
    for rc, out, err in res:
        assert rc == 0, err[-4000:]
        assert "preflight PASS" in out, out
    run = tmp_path / "runs/two-nodes"
    assert all((run / f"checkpoints/step_{s:07d}/COMPLETE").is_file() for s in (EVERY, STEPS))
    assert sorted(p.name for p in (run / f"checkpoints/step_{STEPS:07d}/sharded").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]  # each node's rank wrote its own shard into the shared run directory
    assert (tmp_path / "persist/two-nodes/checkpoints" / f"step_{STEPS:07d}/COMPLETE").is_file()  # the mirror
    assert same_weights(weights(run), one_launch)


def test_a_rank_killed_mid_run_restarts_the_group_to_the_same_end(tmp_path, one_launch):
    "SIGKILL of one rank right after the step-3 checkpoint, --max-restarts 1: both resume at 3, end bit-identical."
    res = two_nodes(tmp_path, "lost-rank", fault_on_second=f"--fault kill@{EVERY}", max_restarts=1)
    for rc, out, err in res:
        assert rc == 0, err[-4000:]
    errs = "".join(err for _, _, err in res)
    assert "no complete checkpoint" in errs  # the first attempt started at step 0 with the same --resume auto
    assert f"resumed from {tmp_path}/runs/lost-rank/checkpoints/step_{EVERY:07d} at step {EVERY}" in errs, errs[-4000:]
    assert same_weights(weights(tmp_path / "runs/lost-rank"), one_launch)


def test_train_node_stopped_by_sigterm_exits_0(tmp_path):
    """SIGTERM to launch/train_node.sh's process group (a scheduler's stop, Ctrl-C) reaches each worker once; the run
    saves its stop checkpoint, torchrun exits 1 as it does after any signal, and the launch exits 0."""
    env = {**ENV, "NPROC": "1", "PERSIST": str(tmp_path / "persist"), "RUN_NAME": "stop", "OUT": str(tmp_path / "run")}
    env |= {"SHARDS": "0", "PREFLIGHT_ARGS": "--skip-gpu --skip-plan"}
    cmd = ["bash", str(ROOT / "launch/train_node.sh"), *RESUME, "schedule.max_steps=100000", "training.device=cpu"]
    code, err = stop_once_saved(
        cmd, {**os.environ, **env}, tmp_path / f"run/checkpoints/step_{RESUME_EVERY:07d}/COMPLETE"
    )
    assert code == 0, err[-3000:]
    assert err.count("SIGTERM received") == 1, err[-3000:]  # once: not from the group and again from torchrun
    assert "after SIGTERM, and the run stopped cleanly" in err and "resume with" in err, err[-3000:]


def test_a_stop_that_saved_nothing_keeps_torchruns_code(tmp_path):
    "launch/stopped_cleanly.py: only a stop checkpoint written during the launch maps torchrun's exit to 0."
    sys.path.insert(0, str(ROOT / "launch"))
    from stopped_cleanly import stop_checkpoint

    from cipher_nb.persist.marker import write_marker

    ckpt = tmp_path / "run/checkpoints/step_0000004"
    ckpt.mkdir(parents=True)
    for tag, before, stopped in [("step", "", False), ("emergency", str(ckpt), False), ("emergency", "", True)]:
        (ckpt / "meta.json").write_text(json.dumps({"tag": tag, "step": 4}))
        (ckpt / "state.pt").write_bytes(b"state")
        write_marker(ckpt)
        assert stop_checkpoint(str(tmp_path / "run"), before) == (str(ckpt) if stopped else ""), (tag, before)


def supervise(*args, max_restarts=2):
    return run_cli(
        "bash", str(ROOT / "launch/supervise.sh"), *args,
        env={**ENV, "MAX_RESTARTS": str(max_restarts)}, timeout=300,
    )  # fmt: skip


def test_supervisor_restarts_a_killed_run_to_the_same_end(tmp_path, straight_run):
    "A single process killed after its half-way checkpoint: the supervisor restarts it to conftest's straight run."
    assert ENV["OMP_NUM_THREADS"] == ONE_THREAD["OMP_NUM_THREADS"]  # the straight run's threads: the same sums
    b = tmp_path / "supervised"
    kill = f"kill@{RESUME_EVERY}"
    r = supervise(str(BIN / "cipher-train"), *RESUME, "--out", str(b), "--resume", "auto", "--quiet", "--fault", kill)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"supervise: killed by signal {signal.SIGKILL}: restart 1 of 2" in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("supervise:") == 1 and "resumed from" in r.stderr and f"at step {RESUME_EVERY}" in r.stderr
    assert same_weights(weights(straight_run), weights(b))


@pytest.mark.parametrize("code, restarted", [(1, True), (3, False), (2, False), (0, False)])
def test_supervisor_follows_the_exit_code_contract(code, restarted):
    "1 restarts (until the restarts are spent); 3 (out of memory again), 2 and 0 end at once; the status comes back."
    r = supervise(sys.executable, "-c", f"print('attempt'); raise SystemExit({code})", max_restarts=2)
    assert r.returncode == code
    assert r.stdout.count("attempt") == (3 if restarted else 1), r.stdout
    assert ("restarts are spent" in r.stderr) == restarted


def test_supervisor_does_not_loop_on_a_config_error(tmp_path):
    r = supervise(str(BIN / "cipher-train"), "schedule.lr=0", "--out", str(tmp_path / "run"), "--resume", "auto")
    assert r.returncode == 2 and "schedule.lr" in r.stderr
    assert r.stderr.count("cipher-train:") == 1 and "not restarting" in r.stderr


ASYNC_WORKER = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from cipher_nb.persist.files import load_checkpoint, list_checkpoints, is_complete
    from cipher_nb.persist.checkpointer import Checkpointer, training_state

    dist.init_process_group('gloo')
    rank, run = dist.get_rank(), sys.argv[1]
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    for layer in (m[0], m[2]): fully_shard(layer)
    fully_shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

    def step():
        x = torch.randn(8, 16)
        loss = m(x).pow(2).mean(); opt.zero_grad(); loss.backward(); opt.step(); sched.step()

    for _ in range(2): step()
    state = lambda: training_state(m, opt, sched, step=2, tokens=32, data_state=dict(rank=rank))
    blocking = Checkpointer(f'{run}/blocking', keep_last=2)
    blocking.save(2, state(), dict(step=2))
    background = Checkpointer(f'{run}/background', keep_last=2, background=True)
    background.save(2, state(), dict(step=2))
    for _ in range(3): step()                     # training goes on, changing every tensor the save holds
    background.close()
    a, b = f'{run}/blocking/step_0000002', f'{run}/background/step_0000002'
    assert is_complete(b) and [s for s, _ in list_checkpoints(f'{run}/background')] == [2]

    def template():
        t = training_state(m, opt, step=0)
        return dict(model=t['model'], optimizer=t['optimizer'])

    def flat(x, k=''):
        if isinstance(x, dict): return [y for n, v in sorted(x.items(), key=str) for y in flat(v, f'{k}/{n}')]
        if isinstance(x, (list, tuple)): return [y for i, v in enumerate(x) for y in flat(v, f'{k}/{i}')]
        if hasattr(x, 'full_tensor'): x = x.full_tensor()
        return [(k, x.clone() if isinstance(x, torch.Tensor) else x)]

    live = flat(template()['model'])              # (loading below reads into these very tensors)
    got, want = flat(load_checkpoint(b, template())), flat(load_checkpoint(a, template()))
    assert [k for k, _ in got] == [k for k, _ in want]
    n = 0
    for (k, x), (_, y) in zip(got, want):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), k; n += 1
        else:
            assert x == y, (k, x, y)
    saved = flat(load_checkpoint(a, template())['model'])
    assert all(not torch.equal(x, y) for (_, x), (_, y) in zip(live, saved))  # the weights moved on since step 2
    print(f'rank {rank} ok {n} tensors equal', flush=True)
    dist.barrier()
    os._exit(0)  # no interpreter teardown: gloo's threads at shutdown sometimes abort a rank
""")


def test_background_sharded_save_equals_a_blocking_save(tmp_path):
    "FSDP2 on 2 gloo ranks: a background save of step 2, overlapped by three more steps, equals a blocking save."
    script = tmp_path / "worker.py"
    script.write_text(ASYNC_WORKER)
    r = run_cli(
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(script), str(tmp_path), env=ENV, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "rank 0 ok" in r.stdout and "rank 1 ok" in r.stdout, r.stdout
    ck = tmp_path / "background/step_0000002"
    assert sorted(p.name for p in (ck / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not list((tmp_path / "background").glob(".tmp-*"))
    assert "sharded/__1_0.distcp" in (ck / "COMPLETE").read_text()
