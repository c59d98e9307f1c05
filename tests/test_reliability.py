"""The reliability suite: bad inputs and faults, one row each, with the command, the exit code, the one line it must
print and what it must leave on disk.

Rows that need no real process (a refused config, preset, path or data source; a refused or fallen-back checkpoint)
call `cipher-train`'s own command-line entry in this process, which is fast. Rows that need a process of their own
(a signal in each phase, a kill, a second writer, a full disk, out of memory) run `cipher-train --fault ...` as a
subprocess. Every row checks the contract: 0 finished or stopped cleanly, 1 failed, 2 usage (nothing written), 3 out
of memory; one line, no traceback."""

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
from conftest import ROOT, SMALL_MODEL, deadline, rows, run_cli, run_in_process

TINY = [
    *SMALL_MODEL,
    "training.seq_len=64",
    "training.batch_size=4",
    "training.eval_batches=2",
    "schedule.warmup_steps=2",
    "training.eval_every=2",
    "training.checkpoint_every=2",
    "data.source=mock",
]


def script(name: str) -> str:
    found = shutil.which(name) or str(ROOT / ".venv/bin" / name)
    return found


@dataclass
class Result:
    code: int
    err: str
    out: str = ""

    @property
    def last(self) -> str:
        lines = [ln for ln in self.err.splitlines() if ln.strip()]
        return lines[-1] if lines else ""


def in_process(*args) -> Result:
    "`cipher-train ARGS` through its own command-line parser, in this process: the exit code and stderr."
    from cipher_nb.cli import parse_command
    from cipher_nb.train.cli import cipher_train

    err = io.StringIO()
    argv, sys.argv = sys.argv, ["cipher-train", *map(str, args)]
    code = 0
    with warnings.catch_warnings(record=True) as warned, deadline(120):  # a process prints warnings: so does this
        warnings.simplefilter("always")
        try:
            with contextlib.redirect_stderr(err):
                pargs, kwargs = parse_command(cipher_train.__wrapped__, sys.argv[1:], ["config"])
                cipher_train(*pargs, **kwargs)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
        finally:
            sys.argv = argv
    shown = "".join(f"{w.category.__name__}: {w.message}\n" for w in warned)
    return Result(code, shown + err.getvalue())


def exporter(*args) -> Result:
    "`cipher-export ARGS` in this process (`_export_forced` runs it as a process)."
    from cipher_nb.persist.hf import cipher_export

    r = run_in_process(cipher_export, *args, pos=["out"])  # OUT is an optional positional, as its script has it
    return Result(r.returncode, r.stderr, r.stdout)


def process(*args, cmd="cipher-train", timeout=120) -> Result:
    r = run_cli(script(cmd), *map(str, args), env={"OMP_NUM_THREADS": "1"}, timeout=timeout)
    return Result(r.returncode, r.stderr, r.stdout)


def started(*args, wait_for: str, cmd="cipher-train", timeout=120):
    "A `cipher-train` process started in the background, once `wait_for` appears in its stderr; (Popen, lines so far)."
    p = subprocess.Popen(
        [script(cmd), *map(str, args)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
    )
    seen, until = [], time.time() + timeout
    while time.time() < until:
        line = p.stderr.readline()
        if not line and p.poll() is not None:
            break
        seen.append(line)
        if wait_for in line:
            return p, seen
    p.kill()
    raise AssertionError(f"'{wait_for}' never appeared: {''.join(seen)[-2000:]}")


def finish(p, seen, timeout=120) -> Result:
    _, rest = p.communicate(timeout=timeout)
    return Result(p.returncode, "".join(seen) + rest)


def flip_byte(f: Path):
    "Change one byte in the middle of `f`, keeping its size (a bit flip, a bad sector)."
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0xFF
    f.write_bytes(bytes(b))


def leftovers(run: Path) -> list:
    "Temporary or half-installed directories a save left behind."
    return sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.name.startswith((".tmp-", ".old-")))


@dataclass
class Case:
    id: str
    run: Callable  # (tmp: Path, base: Path) -> Result; base: a finished tiny run to copy
    code: int
    says: str  # a fragment of the one line of an error (else of stderr)
    check: Callable = None  # (tmp: Path) -> None: what must (not) be left on disk
    one_line: bool = field(default=True)  # an error's one line: the last, starting with the command's name


def nothing_written(tmp: Path):
    assert not (tmp / "run").exists(), f"a refused run left {list((tmp / 'run').rglob('*'))[:5]}"


def usage(id, *args, says, prepare=None):
    "A refused command line: exit 2, its one line, and no run directory."

    def run(tmp, base):
        if prepare:
            prepare(tmp)
        return in_process("--out", tmp / "run", "--quiet", *[str(a).format(tmp=tmp) for a in args])

    return Case(id, run, 2, says, nothing_written)


# ---------------------------------------------------------------------------------------------------------- config
def _write(rel: str, text):
    def prep(tmp):
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text if isinstance(text, bytes) else text.encode())

    return prep


def _mkdir(rel: str):
    return lambda tmp: (tmp / rel).mkdir(parents=True, exist_ok=True)


CONFIG = [
    usage("preset not YAML", "{tmp}/bad.yaml", *TINY, says="not valid YAML", prepare=_write("bad.yaml", "a: [\n")),
    usage("preset missing", "{tmp}/missing.yaml", *TINY, says="does not exist"),
    usage("preset is a directory", "{tmp}/presets", *TINY, says="presets", prepare=_mkdir("presets")),
    usage(
        "preset is a YAML list", "{tmp}/list.yaml", *TINY, says="list.yaml", prepare=_write("list.yaml", "- 1\n- 2\n")
    ),
    usage(
        "preset with a duplicated key",
        "{tmp}/dup.yaml",
        *TINY,
        says="training",
        prepare=_write("dup.yaml", "training:\n  lr: 1.0e-3\ntraining:\n  lr: 2.0e-3\n"),
    ),
    usage(
        "preset section not a mapping",
        "{tmp}/five.yaml",
        *TINY,
        says="training",
        prepare=_write("five.yaml", "training: 5\n"),
    ),
    usage("unknown key", *TINY, "model.moe.topk=2", says="did you mean 'model.moe.top_k'"),
    usage("learning rate of 0", *TINY, "schedule.lr=0", says="schedule.lr (0.0) must be positive"),
    usage("wrong type", *TINY, "training.batch_size=many", says="training.batch_size: expected int"),
    usage("unknown choice", *TINY, "training.precision=fp7", says="training.precision = 'fp7': choose one of"),
    usage("negative steps", *TINY, "--max-steps", "-3", says="schedule.max_steps"),
    usage("zero steps", *TINY, "schedule.max_steps=0", says="schedule.max_steps"),
    usage("a negative gradient clip", *TINY, "optim.grad_clip=-1", says="optim.grad_clip (-1.0) must lie in [0, inf)"),
    usage("an endless epoch budget", *TINY, "schedule.epochs=inf", says="schedule.epochs (inf) must lie in [0, inf)"),
    usage("a negative balancing rate", *TINY, "model.moe.bias_gamma=-1e-3", says="model.moe.bias_gamma (-0.001)"),
    usage("log_every 0", *TINY, "--max-steps", "4", "training.log_every=0", says="training.log_every"),
    usage("batch_size 0", *TINY, "--max-steps", "4", "training.batch_size=0", says="training.batch_size"),
    usage("grad_accum 0", *TINY, "--max-steps", "4", "training.grad_accum=0", says="training.grad_accum"),
    usage("a bad --fault spec", *TINY, "--max-steps", "2", "--fault", "explode@3", says="--fault 'explode@3'"),
    usage("--device cuda without a GPU", *TINY, "--max-steps", "2", "--device", "cuda", says="no CUDA GPU"),
    usage("token codec without a tokenizer", *TINY, "data.codec=tokenizer", says="cipher-tokenizer"),
    usage(
        "an unreadable tokenizer file",
        *TINY,
        "data.codec=tokenizer",
        "data.tokenizer={tmp}/tok.json",
        "model.vocab=300",
        says="tok.json",
        prepare=_write("tok.json", "not json at all"),
    ),
    usage("refinement without --init", *TINY, "--stage", "refinement", says="--init"),
    usage("an --init that does not exist", *TINY, "--init", "{tmp}/nowhere/final", says="nowhere"),
    usage("a --resume path that does not exist", *TINY, "--resume", "{tmp}/nowhere/step_0000002", says="nowhere"),
]


CONFIG += [  # issue 52, round two: the key or file named, and what to do
    usage(
        "a shards manifest that is not JSON",
        *TINY,
        "data.source=shards",
        "data.path={tmp}/shards",
        says="shards/manifest.json is not a shards manifest: prepare it again with",
        prepare=_write("shards/manifest.json", "{"),
    ),
    usage(
        "a text file given as shards",
        *TINY,
        "data.source=shards",
        "data.path={tmp}/notes.txt",
        says="is a file, not a folder of prepared shards: train on it with data.source=files",
        prepare=_write("notes.txt", "plain text\n"),
    ),
    usage(
        "an old and a new name of one key", *TINY, "training.lr=1e-3", "schedule.lr=2e-3", says="keep only schedule.lr"
    ),
]


def _planned(*args) -> Result:
    from cipher_nb.train.plan import cipher_plan

    with deadline(60):  # a micro-batch traced without a bound runs for hours
        r = run_in_process(cipher_plan, *args, pos=["path"])
    return Result(r.returncode, r.stderr, r.stdout)


def _short_run(tmp, base):
    r = in_process("--out", tmp / "run", "--quiet", "--max-steps", "2", *TINY)  # its 2 warmup steps: cut to 0
    assert "DO NOT skip warmup" not in r.err, r.err[-2000:]  # not for the warmup the run itself shortened
    return r


CONFIG += [
    Case(
        "cipher-plan of a mistyped micro-batch",
        lambda tmp, base: _planned("examples/configs/tiny-cpu.yaml", "training.batch_size=100000"),
        2,
        "256",
    ),
    Case("a run under 10 steps has no warmup", _short_run, 0, "no warmup (a run under 10 steps", one_line=False),
]


def _out_is_a_file(tmp, base):
    (tmp / "run").write_text("my notes")
    return in_process("--out", tmp / "run", "--quiet", *TINY)


def _keeps_file(tmp):
    assert (tmp / "run").read_text() == "my notes"


CONFIG += [
    Case("--resume auto without --out", lambda tmp, base: in_process("--resume", "auto", "--quiet", *TINY), 2, "--out"),
    Case("--out is a file", _out_is_a_file, 2, "is a file", _keeps_file),
    Case(
        "--out cannot be written",
        lambda tmp, base: in_process("--out", "/sys/cipher-nb-run", "--quiet", *TINY),
        2,
        "cannot write there",
    ),
]


def _cadence_zero(key):
    def run(tmp, base):
        return in_process("--out", tmp / "run", "--quiet", *TINY, "--max-steps", "4", f"training.{key}=0")

    return run


def _only_final(tmp):
    assert [p.name for p in (tmp / "run/checkpoints").glob("step_*")] == ["step_0000004"]  # the final one


def _one_evaluation(tmp):
    assert [r["step"] for r in rows(tmp / "run") if "val/loss" in r] == [4]  # at the last step only


CONFIG += [  # a cadence of 0 means "at the last step only"
    Case("checkpoint_every 0", _cadence_zero("checkpoint_every"), 0, "run finished", _only_final, False),
    Case("eval_every 0", _cadence_zero("eval_every"), 0, "run finished", _one_evaluation, False),
]

# ------------------------------------------------------------------------------------------------------------ data


def files_run(*extra, prepare=None):
    def run(tmp, base):
        if prepare:
            prepare(tmp)
        return in_process("--out", tmp / "run", "--quiet", "--max-steps", "2", *TINY, "data.source=files", *extra)

    return run


DATA = [
    Case(
        "data path missing",
        files_run("data.path=/nonexistent/corpus.txt"),
        2,
        "/nonexistent/corpus.txt",
        nothing_written,
    ),
    Case(
        "an empty file",
        lambda tmp, base: files_run(f"data.path={tmp}/empty.txt", prepare=_write("empty.txt", b""))(tmp, base),
        2,
        "empty.txt",
        nothing_written,
    ),
    Case(
        "a folder of empty files",
        lambda tmp, base: files_run(
            f"data.path={tmp}/corpus", prepare=lambda t: [_write(f"corpus/{i}.txt", b"")(t) for i in range(3)]
        )(tmp, base),
        2,
        "corpus",
        nothing_written,
    ),
    Case(
        "a held-out tail larger than the file",
        lambda tmp, base: files_run(
            f"data.path={tmp}/small.txt", "data.heldout_tail_bytes=4096", prepare=_write("small.txt", "x = 1\n" * 100)
        )(tmp, base),
        2,
        "data.heldout_tail_bytes",
        nothing_written,
    ),
]


def _big_file(tmp, base):
    lines = "".join(f"line {i:06d}\n" for i in range(20000))  # 240 KB: 30 documents of max_bytes 8192
    (tmp / "big.txt").write_text(lines)
    return in_process(
        "--out", tmp / "run", "--quiet", "--max-steps", "2", *TINY, "data.source=files", f"data.path={tmp}/big.txt"
    )


def _big_file_whole(tmp):
    rec = json.loads((tmp / "run/record.json").read_text())
    assert "truncated" in json.dumps(rec), "the record does not count truncated documents"
    assert all(r.get("data/truncated", 0) == 0 for r in rows(tmp / "run")), "a big file was truncated"


DATA += [Case("a big single-file corpus is read whole", _big_file, 0, "run finished", _big_file_whole, one_line=False)]

# ------------------------------------------------------------------------------------------------ checkpoints, resume


def copy_of(base: Path, tmp: Path) -> Path:
    run = tmp / "run"
    shutil.copytree(base, run)
    return run


def _resume_flipped(tmp, base):
    run = copy_of(base, tmp)
    flip_byte(run / "checkpoints/step_0000004/state.pt")
    return in_process("--out", run, "--quiet", "--resume", run / "checkpoints/step_0000004", *TINY)


def _resume_auto_flipped(tmp, base):
    run = copy_of(base, tmp)
    flip_byte(run / "checkpoints/step_0000004/state.pt")
    shutil.rmtree(run / "final")
    return in_process("--out", run, "--quiet", "--resume", "auto", "--max-steps", "4", *TINY)


def _fell_back(tmp):
    r = rows(tmp / "run")
    assert r[-1]["step"] == 4 and (tmp / "run/final/COMPLETE").exists()


def _init_flipped(tmp, base):
    run = copy_of(base, tmp)
    flip_byte(run / "final/model.safetensors")
    return in_process("--out", tmp / "next", "--quiet", "--init", run / "final", "--stage", "refinement", *TINY)


def _no_marker(tmp, base):
    run = copy_of(base, tmp)
    (run / "checkpoints/step_0000004/COMPLETE").unlink()
    return in_process("--out", run, "--quiet", "--resume", run / "checkpoints/step_0000004", *TINY)


def _old_marker(tmp, base):
    "A marker written before checksums (sizes only) still resumes, with a note that it was not verified."
    run = copy_of(base, tmp)
    ckpt = run / "checkpoints/step_0000002"
    m = json.loads((ckpt / "COMPLETE").read_text())
    m["files"] = {k: (v["size"] if isinstance(v, dict) else v) for k, v in m["files"].items()}
    for k in ("sha256", "checksums", "hash", "digest"):
        m.pop(k, None)
    (ckpt / "COMPLETE").write_text(json.dumps(m))
    shutil.rmtree(run / "final")
    r = in_process("--out", run, "--quiet", "--resume", ckpt, "--max-steps", "4", *TINY)
    assert r.err.count("predates checksums") == 1, r.err[-2000:]  # one note, not one per file or per load
    return r


def _other_shape(tmp, base):
    return in_process(
        "--out", tmp / "run", "--quiet", "--init", base / "final", "--stage", "refinement", *TINY, "model.d_model=96"
    )


def _changed_lr(tmp, base):
    run = copy_of(base, tmp)
    return in_process("--out", run, "--quiet", "--resume", "auto", *TINY, "schedule.lr=1e-2")


def _untouched(tmp):
    assert (tmp / "run/final/COMPLETE").exists() and (tmp / "run/checkpoints/step_0000004/COMPLETE").exists()


CHECKPOINTS = [
    Case("explicit resume of a changed checkpoint", _resume_flipped, 2, "state.pt"),
    Case("resume auto skips a changed checkpoint", _resume_auto_flipped, 0, "run finished", _fell_back, False),
    Case("--init from a changed export", _init_flipped, 2, "model.safetensors"),
    Case("resume of a checkpoint without its marker", _no_marker, 2, "COMPLETE"),
    Case("resume of a checkpoint with an old marker", _old_marker, 0, "predates checksums", _fell_back, False),
    Case("--init into a model of another shape", _other_shape, 2, "do not fit", nothing_written),
    Case("resume with a changed learning rate", _changed_lr, 2, "schedule.lr", _untouched, False),
]


def _eval_flipped(tmp, base):
    run = copy_of(base, tmp)
    flip_byte(run / "final/model.safetensors")
    return process(run / "final", "--docs", "0", "--prompt", "x", "--max-new", "2", cmd="cipher-eval")


def _export_into_own_final(tmp, base):
    run = copy_of(base, tmp)
    return exporter(run, "--format", "hf", run / "final")


def _export_into_checkpoints(tmp, base):
    run = copy_of(base, tmp)
    return exporter(run, "--format", "hf", run / "checkpoints/hf")


def _export_into_nonempty(tmp, base):
    run = copy_of(base, tmp)
    (tmp / "hf").mkdir()
    (tmp / "hf/notes.txt").write_text("mine")
    return exporter(run, "--format", "hf", tmp / "hf")


def _export_forced(tmp, base):
    _export_into_nonempty(tmp, base)
    return process(tmp / "run", "--format", "hf", tmp / "hf", "--force", cmd="cipher-export")


def _forced(tmp):
    names = sorted(p.name for p in (tmp / "hf").iterdir())
    assert "notes.txt" not in names and "model.safetensors" in names and "config.json" in names, names
    assert not [p for p in tmp.iterdir() if p.name.startswith((".tmp-", ".old-", ".hf"))]


def _export_kept(tmp):
    from cipher_nb.persist.export import load

    load(tmp / "run/final")  # still loads: nothing replaced it
    assert not (tmp / "run/checkpoints/hf").exists()
    if (tmp / "hf").exists():
        assert [p.name for p in (tmp / "hf").iterdir()] == ["notes.txt"]


EXPORT = [
    Case("cipher-eval on a changed export", _eval_flipped, 2, "model.safetensors", one_line=False),
    Case("cipher-export over the run's own export", _export_into_own_final, 2, "final", _export_kept, one_line=False),
    Case("cipher-export into the run's checkpoints", _export_into_checkpoints, 2, "checkpoints", _export_kept, False),
    Case("cipher-export into a folder that is not empty", _export_into_nonempty, 2, "--force", _export_kept, False),
    Case("cipher-export --force replaces a folder's contents", _export_forced, 0, "written to", _forced, False),
]


def _files_run_to_resume(tmp) -> Path:
    "A 4-step run on a files corpus, its final/ removed so that step 2's checkpoint is resumed; the corpus's path."
    corpus = tmp / "corpus.txt"
    corpus.write_text("".join(f"line {i:05d}\n" for i in range(4000)))
    r = in_process(
        "--out", tmp / "run", "--quiet", "--max-steps", "4", *TINY, "data.source=files", f"data.path={corpus}"
    )
    assert r.code == 0, r.err[-2000:]
    shutil.rmtree(tmp / "run/final")
    return corpus


def _resume_files(tmp, corpus):
    ckpt = tmp / "run/checkpoints/step_0000002"
    return in_process(
        "--out",
        tmp / "run",
        "--quiet",
        "--resume",
        ckpt,
        "--max-steps",
        "4",
        *TINY,
        "data.source=files",
        f"data.path={corpus}",
    )


def _data_replaced(tmp, base):
    corpus = _files_run_to_resume(tmp)
    corpus.write_text("".join(f"other {i:05d}\n" for i in range(4000)))  # the same path and size, other bytes
    return _resume_files(tmp, corpus)


def _data_moved(tmp, base):
    corpus = _files_run_to_resume(tmp)
    (tmp / "elsewhere").mkdir()
    return _resume_files(tmp, corpus.rename(tmp / "elsewhere" / corpus.name))  # moved, not renamed


CHECKPOINTS += [
    Case("resume after the data was replaced", _data_replaced, 2, "its data changed since it was saved"),
    Case("resume after the corpus was moved", _data_moved, 0, "run finished", one_line=False),
]

# ------------------------------------------------------------------------------------------- overwrite and backups


def _overwrite_twice(tmp, base):
    run = copy_of(base, tmp)
    shutil.copytree(base, tmp / "run.prev")  # a backup of an earlier --overwrite
    return in_process("--out", run, "--quiet", "--overwrite", "--max-steps", "2", *TINY)


def _backups_kept(tmp):
    assert (tmp / "run.prev/final/COMPLETE").exists() and (tmp / "run.prev.2/final/COMPLETE").exists()
    assert rows(tmp / "run")[-1]["step"] == 2


def _fresh_over_a_run(tmp, base):
    copy_of(base, tmp)
    return in_process("--out", tmp / "run", "--quiet", "--max-steps", "2", *TINY)


def _dead_start(tmp, base):
    (tmp / "run").mkdir()
    (tmp / "run/config.yaml").write_text("left by a run killed at its start\n")
    return in_process("--out", tmp / "run", "--quiet", "--max-steps", "2", *TINY)


DIRS = [
    Case("a second --overwrite keeps the first backup", _overwrite_twice, 0, "run finished", _backups_kept, False),
    Case("a fresh run over a run", _fresh_over_a_run, 2, "--resume auto, or start again with --overwrite", _untouched),
    Case("a fresh run over a run that never started", _dead_start, 0, "run finished", None, False),
]

# ------------------------------------------------------------------------------------------------ concurrent writers


@contextlib.contextmanager
def live_run(out: Path):
    "A run that holds `out`: its checkpoint of step 2 is written, then it stalls until the block ends (SIGKILL)."
    p, _ = started("--out", out, *TINY, "--max-steps", "4", "--fault", "stall@2", wait_for="training ")
    try:
        while not (out / "checkpoints/step_0000002/COMPLETE").exists() and p.poll() is None:
            time.sleep(0.05)
        yield p
    finally:
        p.kill()
        p.wait()


def _second_writer(*extra):
    def run(tmp, base):
        with live_run(tmp / "run"):
            return in_process("--out", tmp / "run", "--quiet", *TINY, "--max-steps", "4", *extra)

    return run


def _first_run_intact(tmp):
    run = tmp / "run"
    assert (run / "checkpoints/step_0000002/COMPLETE").exists() and not (tmp / "run.prev").exists()
    assert {r["step"] for r in rows(run)} <= {2}, "the second writer appended to the first run's log"


def _stale_lock(tmp, base):
    with live_run(tmp / "run"):
        pass  # SIGKILL at the end of the block: no cleanup at all, the lock file stays
    assert (tmp / ".run.lock").exists()
    r = process("--out", tmp / "run", "--quiet", "--resume", "auto", *TINY, "--max-steps", "4")
    assert "took over the lock of process" in r.err, r.err[-1500:]
    return r


def _export_into_live_run(tmp, base):
    shutil.copytree(base / "final", tmp / "model")
    with live_run(tmp / "run"):
        return exporter(tmp / "model", "--format", "hf", tmp / "run/hf")


WRITERS = [
    Case("a fresh run beside a live one", _second_writer(), 2, "is being written by process", _first_run_intact),
    Case("--resume auto beside a live run", _second_writer("--resume", "auto"), 2, "being written", _first_run_intact),
    Case("--overwrite beside a live run", _second_writer("--overwrite"), 2, "being written", _first_run_intact),
    Case("a lock left by a killed run is taken over", _stale_lock, 0, "run finished", None, False),
    Case("cipher-export into a live run", _export_into_live_run, 2, "being written", _first_run_intact),
]

# ----------------------------------------------------------------------------------------------- signals, each phase


def _signal_at_start(tmp, base):
    p, seen = started("--out", tmp / "run", *TINY, "--max-steps", "4", "--fault", "stall@0", wait_for="training ")
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)  # one SIGTERM, as a scheduler sends
    return finish(p, seen, timeout=30)


def _faulted(*fault, steps=6, extra=()):
    def run(tmp, base):
        return process("--out", tmp / "run", "--quiet", "--max-steps", steps, "--fault", ",".join(fault), *TINY, *extra)

    return run


def _complete(*ckpts, final=False):
    def check(tmp):
        run = tmp / "run"
        for c in ckpts:
            assert (run / "checkpoints" / c / "COMPLETE").exists(), c
        assert (run / "final/COMPLETE").exists() == final
        assert not leftovers(run), leftovers(run)

    return check


SIGNALS = [
    Case("SIGTERM before the first step", _signal_at_start, 0, "nothing was saved", nothing_written),
    Case("SIGTERM between steps", _faulted("sigterm@3"), 0, "resume with", _complete("step_0000003"), False),
    Case("SIGINT between steps", _faulted("sigint@3"), 0, "resume with", _complete("step_0000003"), False),
    Case(
        "SIGTERM in a save",
        _faulted("sigterm-in-save:rename@2"),  # the save of best/ at step 2: it finishes, then the run stops
        0,
        "resume with",
        _complete("step_0000002", "best"),
        False,
    ),
    Case(
        "SIGINT in a save",
        _faulted("sigint-in-save:write@2"),
        0,
        "resume with",
        _complete("step_0000002", "best"),
        False,
    ),
    Case(
        "SIGTERM in the final save",
        _faulted("sigterm-in-save:marker@4", steps=4, extra=["training.checkpoint_every=100"]),
        0,
        "run finished",
        _complete("step_0000004", final=True),
        False,
    ),
    Case(
        "SIGTERM in the export",
        _faulted("sigterm-in-export@4", steps=4, extra=["training.checkpoint_every=100"]),
        0,
        "run finished",
        _complete("step_0000004", final=True),
        False,
    ),
    Case(
        "a second signal in a save exits once it is written",
        _faulted("sigterm-in-save:write@2", "sigterm-in-save:marker@2"),
        128 + signal.SIGTERM,  # both reach the save of best/ at step 2: it is written, then the process exits
        "the save is complete: exiting",
        _complete("best"),
        False,
    ),
]

# ---------------------------------------------------------------------------------------------- disk full, memory


def _intact_after_disk_full(*ckpts):
    def check(tmp):
        run = tmp / "run"
        assert not leftovers(run), leftovers(run)
        from cipher_nb.persist.files import latest_checkpoint

        assert latest_checkpoint(run).name == ckpts[-1]

    return check


DISK = [
    Case(
        "disk full writing a checkpoint",
        _faulted("enospc-in-save:write@4"),
        1,
        "step_0000002; free space, then resume with: cipher-train --out",
        _intact_after_disk_full("step_0000002"),
    ),
    Case(
        "disk full before the rename",
        _faulted("enospc-in-save:rename@4"),
        1,
        "the last intact checkpoint is",
        _intact_after_disk_full("step_0000002"),
    ),
    Case(
        "disk full before the marker",
        _faulted("enospc-in-save:marker@4"),
        1,
        "the last intact checkpoint is",
        _intact_after_disk_full("step_0000002"),
    ),
    # out of memory prints its advice on the lines after its first: the fixes in the order to try them
    Case(
        "too many non-finite steps in a row",
        _faulted("nonfinite@2", extra=["training.max_nonfinite=1"]),
        1,
        "non-finite steps in a row",
        _complete("step_0000002"),
    ),
    Case(
        "out of memory (CUDA's error)", _faulted("oom@3"), 3, "training.parallel=fsdp", _complete("step_0000002"), False
    ),
    Case(
        "out of memory (the CPU allocator)", _faulted("alloc@3"), 3, "parallel=fsdp", _complete("step_0000002"), False
    ),
]

CASES = CONFIG + DATA + CHECKPOINTS + EXPORT + DIRS + WRITERS + SIGNALS + DISK


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    "A finished tiny run: checkpoints at steps 2 and 4, best/, final/."
    run = tmp_path_factory.mktemp("base") / "run"
    r = process("--out", run, "--quiet", *TINY, "--max-steps", "4")
    assert r.code == 0, r.err[-3000:]
    return run


def test_the_suite_covers_every_area():
    assert len(CASES) >= 60, len(CASES)
    assert len({c.id for c in CASES}) == len(CASES), "two rows share an id"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_reliability(case, base, tmp_path):
    r = case.run(tmp_path, base)
    assert r.code == case.code, f"{case.id}: exit {r.code}, expected {case.code}\n{r.err[-3000:]}"
    assert "Traceback" not in r.err, f"{case.id}: a traceback\n{r.err[-3000:]}"
    if case.one_line:  # an error: its one line is the last, and names the bad thing
        assert case.says in r.last, f"{case.id}: the last line does not say {case.says!r}:\n{r.err[-2000:]}"
        assert r.last.startswith(("cipher-train: ", "cipher-eval: ", "cipher-export: ", "cipher-plan: ")), r.err[-2000:]
    else:
        assert case.says in r.err + r.out, f"{case.id}: the output does not say {case.says!r}:\n{r.err[-2000:]}"
    if case.check:
        case.check(tmp_path)
