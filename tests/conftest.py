import io
import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from contextlib import contextmanager, redirect_stderr, redirect_stdout, suppress
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# a two-layer model of width 32 with four routed experts: the tests' smallest model (add the rest per test)
WIDTH_32 = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.attention.n_heads=2",
    "model.attention.n_kv_heads=1",
    "model.attention.head_dim=16",
    "model.moe.n_routed=4",
    "model.moe.expert_d_ff=32",
]

# the smallest run the viz and launch tests draw: a top-1 MoE on 64-byte windows
TINY = [*WIDTH_32, "model.moe.top_k=1", "training.seq_len=64", "training.batch_size=2"]

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


# the uninterrupted run every single-process kill-and-resume test compares with (test_train, test_scale_out's
# supervisor): a checkpoint and an evaluation half way, where the faults land; with dropout, whose masks come from the
# torch RNG that a checkpoint must restore for the resume to be exact
RESUME_STEPS, RESUME_EVERY = 6, 3
RESUME = [
    *SMALL_MODEL,
    "training.seq_len=64",
    "training.batch_size=4",
    "training.eval_batches=1",
    "schedule.warmup_steps=1",
    f"schedule.max_steps={RESUME_STEPS}",
    "training.log_every=1",
    f"training.checkpoint_every={RESUME_EVERY}",
    f"training.eval_every={RESUME_EVERY}",
    "model.dropout=0.1",
]
# a tiny byte-level model with every feature the plots show: two expert populations, a recurrent core,
# a boundary predictor
FEATURES = [
    "model.d_model=32",
    "model.attention.n_heads=2",
    "model.attention.n_kv_heads=1",
    "model.attention.head_dim=16",
    "model.n_layers=3",
    "model.recurrence.n_prelude=1",
    "model.recurrence.n_core=1",
    "model.recurrence.n_coda=1",
    "model.recurrence.n_loops=2",
    "model.boundary.enabled=true",
    "model.moe.n_routed=4",
    "model.moe.n_pop_a=2",
    "model.moe.top_k=1",
    "model.moe.expert_d_ff=32",
    "model.moe.n_dense_layers=0",
    "training.seq_len=64",
    "training.batch_size=2",
    "schedule.warmup_steps=2",
    "training.log_every=2",
    "training.eval_every=3",
    "training.eval_batches=2",
    "training.checkpoint_every=3",
    "schedule.max_steps=6",
]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # tiny models train faster on one thread; runs compared bit for bit share it


def script(name: str) -> str:
    "The path of a console script installed beside this interpreter (or on PATH)."
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name) or str(ROOT / ".venv/bin" / name)


def run_cli(*args, timeout=600, env=None, cwd=None):
    "Run a console script (or python -m module) in a subprocess; return the CompletedProcess."
    e = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=e, cwd=cwd or ROOT)


@contextmanager
def warnings_as_a_process(err):
    "Warnings written on `err` under a fresh process's filters, as a console script prints them (not kept by pytest)."

    def show(message, category, filename, lineno, file=None, line=None):
        err.write(warnings.formatwarning(message, category, filename, lineno, line))

    formatwarning = warnings.formatwarning  # a command may set its own (cipher-train does): put it back after
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # once per place, as in a new process
        for quiet in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", quiet)  # Python's default filters
        warnings.showwarning = show
        try:
            yield
        finally:
            warnings.formatwarning = formatwarning


def run_in_process(command, *args, pos: list = None):
    "A `cipher-*` command (made by `cipher_nb.cli.command`) run on ARGS in this process, as `run_cli` runs it in one."
    from cipher_nb.cli import run_command

    out, err, argv = io.StringIO(), io.StringIO(), [str(a) for a in args]
    with redirect_stdout(out), redirect_stderr(err), warnings_as_a_process(err):
        try:
            code = run_command(command.__wrapped__, argv, pos) or 0  # what its console script passes to sys.exit
        except SystemExit as e:  # a usage error (2), or a command that exits itself
            code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess([command.__name__, *argv], code, out.getvalue(), err.getvalue())


def rows(run) -> list:
    "The complete rows of a run's metrics: a line the run is still writing (no newline yet) is left out."
    return [json.loads(r) for r in (Path(run) / "metrics.jsonl").read_text().split("\n")[:-1] if r.strip()]


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory) -> Path:
    "RESUME trained from start to end in one process: the reference of the kill-and-resume tests, trained once."
    out = tmp_path_factory.mktemp("straight") / "run"
    r = run_cli(script("cipher-train"), *RESUME, "--out", str(out), "--quiet", env=ONE_THREAD, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture
def one_thread():
    "One intra-op thread, as the processes of `straight_run` and the other runs here have: the same sums, bit for bit."
    import torch

    was = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(was)


@pytest.fixture(scope="session")
def features_run(tmp_path_factory) -> Path:
    "FEATURES trained for 6 steps, with an export: the run the plot tests draw (test_viz, test_notebook_kernel)."
    out = tmp_path_factory.mktemp("features") / "run"
    train = [sys.executable, "-m", "cipher_nb.train"]  # `python -m`: the console script's other door, kept in use
    r = run_cli(*train, *FEATURES, "--out", str(out), "--quiet", env=ONE_THREAD, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def weights(folder) -> dict:
    "The tensors of an export folder (`RUN/final`, `RUN/checkpoints/best`)."
    from safetensors.torch import load_file

    return load_file(Path(folder) / "model.safetensors")


def shift_by_hand(choice, k: int, iters: int = 10, rate: float = 0.005):
    """An MoE's solved balance shift (`cipher_nb.model.moe.balance_shift`, 10 steps of 0.005) in float64 Python: each
    token's top-k of `choice` [N, E] plus the shift picked in a plain loop, the shift stepped expert by expert."""
    import math

    import torch

    rows, E = choice.double().tolist(), choice.shape[1]
    b = [0.0] * E
    for _ in range(iters):
        load = [0] * E
        for row in rows:
            for e in sorted(range(E), key=lambda e: -(row[e] + b[e]))[:k]:  # ties to the lower index
                load[e] += 1
        b = [x - rate * math.log(max(n * E / sum(load), 0.1)) for x, n in zip(b, load)]
    return torch.tensor([x - sum(b) / E for x in b], dtype=torch.float32)


def same_weights(a: dict, b: dict) -> bool:
    "Bit for bit: the same names, the same tensors."
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


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


def end_launch(p: subprocess.Popen):
    "SIGKILL a launch script's process group and its torchrun's, which runs in a session of its own."
    import psutil

    inner = psutil.Process(p.pid).children(recursive=True)
    os.killpg(p.pid, signal.SIGKILL)
    for c in inner:
        with suppress(psutil.NoSuchProcess):
            c.kill()


def stop_once_saved(cmd: list, env: dict, saved: Path) -> tuple:
    """Start a launch script in a process group of its own, send the group SIGTERM once `saved` exists (a checkpoint's
    COMPLETE marker: training is under way) or the script has ended, and return (exit code, stderr)."""
    import time

    p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)  # fmt: skip
    try:
        for _ in range(1200):  # at most two minutes to the first checkpoint
            if saved.exists() or p.poll() is not None:
                break
            time.sleep(0.1)
        os.killpg(p.pid, signal.SIGTERM)
        err = p.communicate(timeout=120)[1]
    finally:
        if p.poll() is None:
            end_launch(p)
    return p.returncode, err
