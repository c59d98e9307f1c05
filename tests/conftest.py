import os
import signal
import subprocess
from contextlib import contextmanager
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
