"""cipher-train as a process: the run directory, clean stops and resume, exact resume after a kill, skipped steps,
injected faults (--fault), torchrun. Refused starts and short runs read only by their outcome run the same command in
this process (`train_in_process`): a process costs seconds of imports."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    ONE_THREAD,
    RESUME,
    RESUME_EVERY,
    ROOT,
    SMALL_MODEL,
    TINY,
    rows,
    run_cli,
    run_in_process,
    same_weights,
    script,
    weights,
)

SMALL = [
    *SMALL_MODEL,
    "training.seq_len=64",
    "training.batch_size=4",
    "training.eval_batches=2",
    "schedule.warmup_steps=2",
]


def cli():
    return script("cipher-train")


def train(out, *args, env=None, timeout=600):
    return run_cli(cli(), "--out", str(out), "--quiet", *args, env=env, timeout=timeout)


def train_in_process(out, *args):
    """cipher-train ARGS in this process, for a run refused at its start or a short one whose outcome is all a test
    reads (no signal, no kill): the same command without seconds of imports per run."""
    from cipher_nb.train.cli import cipher_train

    return run_in_process(cipher_train, "--out", str(out), "--quiet", *args, pos=["config"])


def test_default_run_writes_the_run_directory(tmp_path):
    """The default model and data (tiny-cpu on the standard library) for 100 steps of smaller batches, its warmup
    as shipped: the run directory, the loss falls; with the early bias boost, no health warning (without it the
    routing collapses after warmup, truly: "expert collapse at step 35")."""
    run = tmp_path / "run"
    r = train(
        run,
        "--max-steps",
        "100",
        "training.batch_size=8",
        "training.seq_len=128",
        "training.log_every=5",
        "training.eval_every=50",
        "training.checkpoint_every=50",
        "training.eval_batches=2",
        "model.moe.bias_boost_steps=200",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for f in (
        "config.yaml",
        "metrics.jsonl",
        "record.json",
        "final/model.safetensors",
        "final/config.json",
        "checkpoints/step_0000100/COMPLETE",
        "checkpoints/step_0000050/COMPLETE",
    ):
        assert (run / f).exists(), f
    m = [x for x in rows(run) if "loss" in x]
    assert m[-1]["loss"] < m[0]["loss"] - 0.3, (m[0]["loss"], m[-1]["loss"])
    assert "run directory" in r.stderr and str(run) in r.stderr
    rec = json.loads((run / "record.json").read_text())
    assert rec["export"] and rec["evals"] and rec["precision"]["mode"] == "fp32"
    # what ran, read from the model after its first step
    kernels = {"compiled": False, "activation_checkpoint": "none", "attention": "sdpa", "moe": "grouped"}
    kernels["allocator"] = "default (not CUDA)"  # expandable segments on CUDA
    assert rec["kernels"] == kernels, rec["kernels"]
    assert rec["optimizer"]["kind"] == "adamw"
    assert rec["warnings"] == [] and "warning" not in r.stderr  # lr 1e-3 breaks no rule in fp32 (auto on a CPU)
    assert "HealthWarning" not in r.stderr, r.stderr[-3000:]


def test_sigterm_saves_and_resume_auto_finishes(tmp_path):
    run = tmp_path / "run"
    steps = 100  # the signal lands at step 3 or soon after: the rest is the margin, and what the resume trains
    p = subprocess.Popen(
        [
            cli(),
            "--out",
            str(run),
            "--quiet",
            "--max-steps",
            str(steps),
            "training.log_every=1",
            "training.checkpoint_every=1000",
            "training.eval_every=1000",
            *SMALL,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    deadline = time.time() + 300
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and len(rows(run)) >= 3):
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    stopped = rows(run)[-1]["step"]
    assert 3 <= stopped < steps and (run / f"checkpoints/step_{stopped:07d}/COMPLETE").exists(), err[-2000:]
    assert "SIGTERM received" in err and "resume with" in err
    r = train(run, "--resume", "auto", *SMALL)  # the config comes back from RUN/config.yaml
    assert r.returncode == 0, r.stderr[-3000:]
    logged = [x["step"] for x in rows(run)]
    assert logged[-1] == steps and logged == sorted(set(logged)), logged[-5:]
    assert "resumed from" in r.stderr and (run / "final/model.safetensors").exists()


def test_kill_and_resume_is_bit_identical(straight_run, tmp_path):
    "N steps straight == k steps, SIGKILL, resume to N: the same losses and the same final weights, bit for bit."
    b = tmp_path / "killed"  # the straight run is conftest's, shared with test_scale_out's supervisor test
    r = train(b, *RESUME, "--fault", f"kill@{RESUME_EVERY}", env=ONE_THREAD)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert not (b / "final").exists() and (b / f"checkpoints/step_{RESUME_EVERY:07d}/COMPLETE").exists()
    r = train(b, "--resume", "auto", *RESUME, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr[-3000:]
    la, lb = [(x["step"], x.get("loss")) for x in rows(straight_run)], [(x["step"], x.get("loss")) for x in rows(b)]
    assert la == lb
    assert same_weights(weights(straight_run / "final"), weights(b / "final"))


def test_nonfinite_step_is_skipped_and_the_run_continues(tmp_path):
    run = tmp_path / "run"
    r = train_in_process(run, "--max-steps", "8", "training.log_every=1", *SMALL, "--fault", "nonfinite@3")
    assert r.returncode == 0, r.stderr[-3000:]
    m = [x for x in rows(run) if "loss" in x]
    assert m[-1]["step"] == 8 and m[-1]["skipped_total"] == 1
    assert [x["skipped_at"] for x in m if x["skipped"]] == [[3]]  # counted in its window, with its step
    assert "non-finite" in r.stderr and all(x["loss"] == x["loss"] for x in m)  # no NaN reached a logged step


def test_kill_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path):
    "--fault kill-in-save@4: the save of step 4 dies half-written; resume auto continues from step 2."
    run = tmp_path / "run"
    args = ["--max-steps", "6", "training.checkpoint_every=2", "training.eval_every=100", *SMALL]
    r = train(run, *args, "--fault", "kill-in-save@4")
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert (run / "checkpoints/step_0000002/COMPLETE").exists()
    assert not (run / "checkpoints/step_0000004/COMPLETE").exists()
    r = train(run, "--resume", "auto", *args)
    assert r.returncode == 0 and "resumed from" in r.stderr and "step_0000002" in r.stderr, r.stderr[-2000:]
    assert rows(run)[-1]["step"] == 6


def test_out_of_memory_exits_3_and_keeps_the_last_checkpoint(tmp_path):
    run = tmp_path / "run"
    r = train(run, "--max-steps", "6", "training.checkpoint_every=2", *SMALL, "--fault", "oom@3")
    assert r.returncode == 3, r.stderr[-2000:]
    assert "out of memory at step 3 (peak" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "batch 4 x 64 tokens" in r.stderr and "1. training.batch_size=2 training.grad_accum=2" in r.stderr
    assert "2. training.activation_checkpoint=selective" in r.stderr
    assert (run / "checkpoints/step_0000002/COMPLETE").exists() and not (run / "final").exists()
    r = train(run, "--resume", "auto", "training.activation_checkpoint=selective")  # the second fix resumes it
    assert r.returncode == 0 and "step_0000002" in r.stderr, r.stderr[-2000:]


def test_a_short_smoke_run_without_heldout_data(tmp_path):
    """--max-steps 3 with the default 30 warmup steps runs, and says it shortened the warmup (to none: the start line
    says so, and the runbook's warmup rail does not warn about the warmup the run itself shortened); in bf16 at lr 1e-3
    the learning-rate rail warns on stderr and in the record, and the run goes on; with no held-out data it says so and
    logs no val/* metrics (one run checks all three: each run costs seconds)."""
    run = tmp_path / "run"
    short = ["--max-steps", "3", "--precision", "bf16", *SMALL_MODEL, "training.seq_len=64", "training.batch_size=4"]
    r = train_in_process(run, *short, "training.eval_batches=2", "data.heldout_frac=0", "training.eval_every=2")
    assert r.returncode == 0 and "warmup_steps shortened from 30 to 0" in r.stderr, r.stderr[-2000:]
    said = [line.removeprefix("cipher-train: warning: ") for line in r.stderr.splitlines() if " warning: " in line]
    assert [w.split(" = ")[0] for w in said] == ["schedule.lr"], r.stderr[-2000:]
    assert "training.precision = bf16" in said[0] and "no warmup (a run under 10 steps" in r.stderr, r.stderr[-2000:]
    assert json.loads((run / "record.json").read_text())["warnings"] == said
    assert "no held-out data" in r.stderr, r.stderr[-2000:]
    assert not any(k.startswith("val/") for x in rows(run) for k in x)
    assert "held-out" not in r.stderr.split("run finished")[-1]  # no held-out figure in the summary


BYTE_LEVEL = ["model.boundary.enabled=true", "optim.bp_freeze_steps=3"]  # frozen for 3 of the 6 steps, then trained


@pytest.mark.parametrize("parallel,extra", [("ddp", []), ("fsdp", []), ("ddp", BYTE_LEVEL), ("fsdp", BYTE_LEVEL)])
def test_torchrun_two_ranks_end_identical(tmp_path, parallel, extra):
    """torchrun --nproc_per_node=2 on CPU (gloo): both ranks train and end with identical weights, a boundary predictor
    held still and then trained by its callback included (its gradients dropped, never its `requires_grad` switched)."""
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    r = run_cli(
        torchrun,
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "tests/dist_train.py"),
        str(tmp_path),
        parallel,
        *extra,
        env={"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    h = [(tmp_path / f"rank{i}.json").read_text() for i in range(2)]
    assert h[0] == h[1]
    info = json.loads(h[0])
    assert info["step"] == 6 and info["loss_last"] < info["loss_first"]


def test_a_single_file_corpus_with_a_held_out_tail(tmp_path):
    "One local file: its tail is the held-out set (a real held-out bpb); with nothing held out, no val/* at all."
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((Path(json.__file__).read_text() * 3)[:120_000])
    args = ["--max-steps", "4", *SMALL, "data.source=files", f"data.path={corpus}", "training.eval_every=4"]
    r = train_in_process(tmp_path / "tail", *args, "data.heldout_tail_bytes=4000", "data.max_bytes=0")
    assert r.returncode == 0, r.stderr[-2000:]
    bpb = [x["val/bpb"] for x in rows(tmp_path / "tail") if "val/bpb" in x]
    assert bpb and all(0 < b < 20 for b in bpb), bpb
    r = train_in_process(tmp_path / "none", *args, "data.heldout_frac=0")
    assert r.returncode == 0 and "no held-out data" in r.stderr, r.stderr[-2000:]
    assert not any(k.startswith("val/") for x in rows(tmp_path / "none") for k in x)


def test_refinement_on_differently_cut_data_is_refused(straight_run, tmp_path):
    "data.max_bytes changes which bytes the model sees, so it changes the data fingerprint refinement must match."
    stage = ["--stage", "refinement", "--init", str(straight_run / "final")]  # conftest's pretraining run
    r = train_in_process(tmp_path / "ref", *RESUME, "--max-steps", "2", "data.max_bytes=100", *stage)
    assert r.returncode == 2 and "refinement data differs" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "ref").exists()  # refused before anything was written
    assert train(tmp_path / "same", *RESUME, "--max-steps", "2", *stage, env=ONE_THREAD).returncode == 0


def test_a_time_budget_plans_the_steps_and_records_them(tmp_path):
    "The planned steps, never the budget's cap, in the progress line, the record and the model card; the sizes too."
    run = tmp_path / "run"
    r = train_in_process(run, *SMALL, "training.log_every=5", "--time-budget", "4s")
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads((run / "record.json").read_text())
    sched, last = rec["schedule"], rows(run)[-1]["step"]
    assert sched["time_budget_s"] == 4.0 and sched["max_steps"] == last > 5, sched
    assert yaml_max_steps(run) == 10**9  # the budget decided, not the preset's max_steps (a cap, shown nowhere)
    out = r.stdout + r.stderr
    shown = [int(ln.split("/")[1].split()[0]) for ln in out.splitlines() if ln.startswith("step ") and "/?" not in ln]
    assert shown and shown[-1] == last and max(shown) < 10**6, shown  # each line: the plan as it stood
    assert f"'max_steps': {last}," in (run / "final/README.md").read_text()
    assert str(10**9) not in out and "for 4s" in r.stderr, r.stderr[-2000:]
    assert rec["parameters"]["total"] == rec["parameters"]["trainable"] > rec["parameters"]["active"] > 0
    assert f"parameters: {rec['parameters']['total']:,} total" in r.stderr


def test_a_cap_that_cuts_a_token_budget_says_by_how_much(tmp_path):
    """schedule.max_steps beside a token budget caps it: the start of the run and the record say what it cut. A budget
    shorter than the warmup shortens it, and says so; two budgets are refused. Worked by hand: 2 windows x 64 tokens a
    step, so 1,280 tokens buy 10 steps, and a cap of 4 trains 40.0% of them; a warmup of 30 in 10 steps becomes 1."""
    tiny = [*TINY, "data.source=mock", "training.eval_batches=1", "schedule.target_tokens=1280"]
    run = tmp_path / "capped"
    r = train_in_process(run, *tiny, "schedule.max_steps=4", "schedule.warmup_steps=1")
    assert r.returncode == 0, r.stderr[-2000:]
    cut = "schedule.max_steps = 4 caps schedule.target_tokens = 1,280 (10 steps): the run trains 4 steps, 40.0% of the"
    assert (
        f"cipher-train: warning: {cut}" in r.stderr and "training 4 steps (schedule.target_tokens = 1,280)" in r.stderr
    )
    sched = json.loads((run / "record.json").read_text())["schedule"]
    assert (sched["budget_steps"], sched["max_steps"]) == (10, 4) and sched["warnings"][0].startswith(cut), sched
    r = train_in_process(tmp_path / "short", *tiny, "schedule.warmup_steps=30")
    warmup = "the warmup (30 steps) does not fit in the 10 steps of schedule.target_tokens = 1,280: shortened to 1"
    assert r.returncode == 0 and warmup in r.stderr and "training 10 steps" in r.stderr, r.stderr[-2000:]
    r = train_in_process(tmp_path / "both", *tiny, "--time-budget", "8s")
    assert r.returncode == 2 and "schedule.target_tokens and schedule.time_budget are both set" in r.stderr
    assert not (tmp_path / "both").exists()


def yaml_max_steps(run) -> int:
    import yaml

    return yaml.safe_load((run / "config.yaml").read_text())["schedule"]["max_steps"]


def test_early_stopping_ends_the_run_at_its_patience(tmp_path):
    "A held-out loss that cannot fall (a rate of 1e-30 leaves a dense model's weights as they are): exit 0 at step 6."
    from cipher_nb.train.cli import cipher_train

    run = tmp_path / "run"
    flat = ["model.moe.n_routed=0", "schedule.lr=1e-30", "schedule.min_lr=0", "data.source=mock"]
    cadence = ["training.eval_every=2", "training.eval_batches=1", "training.early_stop_patience=2"]
    ema = ["optim.ema=0.9"]  # final/ then holds best/'s average, and its meta says so
    r = run_in_process(cipher_train, "--out", run, "--quiet", "--max-steps", "40", *TINY, *flat, *cadence, *ema)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "early stop at step 6" in r.stderr and "run finished at step 6" in r.stderr, r.stderr[-2000:]
    stop = json.loads((run / "record.json").read_text())["schedule"]["early_stop"]
    assert (stop["step"], stop["best_step"], stop["exported_step"]) == (6, 2, 2), stop
    assert rows(run)[-1]["step"] == 6 and (run / "final/model.safetensors").exists()
    meta = json.loads((run / "final/meta.json").read_text())
    assert meta["step"] == 2 and meta["averaged"] == dict(decay=0.9, updates=2), meta  # the step and kind of weights

    # stopped by a signal at step 4 (one evaluation without improvement), then resumed: the count goes on from 1
    cut = tmp_path / "cut"
    args = ("--out", cut, "--quiet", "--max-steps", "40", *TINY, *flat, *cadence)
    r = run_in_process(cipher_train, *args, "--fault", "sigterm@4")
    assert r.returncode == 0 and "early stop" not in r.stderr, r.stderr[-3000:]
    r = run_in_process(cipher_train, *args, "--resume", "auto")
    assert r.returncode == 0 and "early stop at step 6" in r.stderr, r.stderr[-3000:]


TINY_RUN = ("schedule.max_steps=2", "schedule.warmup_steps=1")  # should the refusal fail, a short run


@pytest.mark.parametrize("precision", ["fp8", "mxfp8", "nvfp4"])
def test_8bit_adamw_with_an_fp8_family_precision_is_refused_on_a_cpu_too(tmp_path, precision):
    "Judged on the precision asked for, before the CPU's fallback to fp32: one line, exit 2, nothing written."
    run = tmp_path / "run"
    r = train_in_process(run, f"training.precision={precision}", "optim.name=adamw8bit", *TINY_RUN)
    refusal = f"cipher-train: optim.name = adamw8bit with training.precision = {precision}: 8-bit AdamW trains bf16"
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(refusal), r.stderr[-2000:]
    assert not run.exists()


def text_log(run) -> list:
    "RUN/train.log's lines, oldest first: the rotated pieces from the highest number down, then train.log itself."
    n = len(list(Path(run).glob("train.log.*")))
    pieces = [Path(run) / f"train.log.{k}" for k in range(n, 0, -1)] + [Path(run) / "train.log"]
    return "".join(p.read_text() for p in pieces).splitlines()


def test_the_console_is_kept_in_train_log_rotated_and_appended_on_resume(tmp_path):
    "What cipher-train prints, each line timed, in RUN/train.log; rotated at 500 bytes into pieces; resume appends."
    run = tmp_path / "run"
    r = train_in_process(run, *TINY, *TINY_RUN, "training.log_every=1", "logging.text_log_mb=0.0005")
    assert r.returncode == 0, r.stderr[-2000:]
    first = text_log(run)
    said = [line.split(" | ", 1)[1] for line in first]
    assert all(line[:4].isdigit() and " | " in line for line in first)  # each line opens with its time
    assert f"training 2 steps (schedule.max_steps = 2), run directory: {run}" in said
    assert any(s.startswith("step      2/2 | loss") for s in said) and "run finished at step 2" in " ".join(said)
    assert (run / "train.log.2").is_file() and all(p.stat().st_size < 800 for p in run.glob("train.log*"))  # + a line
    r = train_in_process(run, "--resume", "auto")
    assert r.returncode == 0, r.stderr[-2000:]
    again = text_log(run)
    assert again[: len(first)] == first and any("resumed from" in line for line in again[len(first) :])
