import io
import json
import os
import signal
import subprocess
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# the smallest run the viz and launch tests draw: a top-1 MoE on 64-byte windows
TINY = [
    "model.d_model=32",
    "model.attention.n_heads=2",
    "model.attention.n_kv_heads=1",
    "model.attention.head_dim=16",
    "model.n_layers=2",
    "model.moe.n_routed=4",
    "model.moe.top_k=1",
    "model.moe.expert_d_ff=32",
    "training.seq_len=64",
    "training.batch_size=2",
]

# a model small enough for a process-level test to train in seconds
SMALL_MODEL = [
    "model.d_model=64",
    "model.n_layers=2",
    "model.attention.n_heads=2",
    "model.attention.n_kv_heads=1",
    "model.attention.head_dim=32",
    "model.moe.n_routed=4",
    "model.moe.expert_d_ff=64",
]


def run_cli(*args, timeout=600, env=None, cwd=None):
    "Run a console script (or python -m module) in a subprocess; return the CompletedProcess."
    e = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=e, cwd=cwd or ROOT)


def run_in_process(command, *args, pos: list = None):
    "A `cipher-*` command (made by `cipher_nb.cli.command`) run on ARGS in this process, as `run_cli` runs it in one."
    from cipher_nb.cli import run_command

    out, err, argv = io.StringIO(), io.StringIO(), [str(a) for a in args]
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = run_command(command.__wrapped__, argv, pos) or 0  # what its console script passes to sys.exit
        except SystemExit as e:  # a usage error (2), or a command that exits itself
            code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess([command.__name__, *argv], code, out.getvalue(), err.getvalue())


def rows(run) -> list:
    "The complete rows of a run's metrics: a line the run is still writing (no newline yet) is left out."
    return [json.loads(r) for r in (Path(run) / "metrics.jsonl").read_text().split("\n")[:-1] if r.strip()]


@pytest.fixture
def root():
    return ROOT


@contextmanager
def deadline(seconds: int = 20):
    "Fail with TimeoutError instead of hanging when the code inside loops for ever (what empty data once did)."

    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s: an endless loop")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
