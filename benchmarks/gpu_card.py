#!/usr/bin/env python
"""The GPU bench card: one command, one table, within a short GPU lease (compilation included).

Rows, in the order they run (the most wanted first, in case the time limit cuts the tail):
  dense         examples/configs/gpu-card-dense.yaml: a 0.2B dense model at sequence 2048, bf16, blocks compiled
  moe           examples/configs/gpu-card-moe.yaml: its MoE twin of equal active FLOPs (8 experts, top-2 + 1 shared)
  moe-balanced  the same MoE with the router's choice overwritten by a round-robin assignment (every expert gets the
                same load): the MoE's cost without imbalance. A switch of this script only, never a config key
  h100          examples/configs/h100.yaml (the runbook's 32-expert MoE) at its shipped micro-batch
  ep            the MoE with `training.expert_parallel` over every GPU of the machine, under torchrun; a marked row
                when this version has no such key or the machine has one GPU
  h100-fp8      the h100 preset in fp8 (torchao), compiled: whether fp8 pays at the shipped micro-batch
Rows run only when named in `--rows`:
  wide, wide-fp8  examples/configs/wide-h100.yaml (a 0.8B dense model of width 2048, the shape where fp8 can pay) in
                bf16 and in fp8; the fp8 rows' note says how many linears converted

Each row builds its model and optimizer with the project's own builders (`build_model`, `build_optimization`: the
precision, compilation and wrappers a `cipher-train` run gets) and times `Trainer.train_step` with the loss-free
balancing callback, on random token batches already on the device (the data pipeline is not measured; "real"
routing is a freshly initialized router's choice on those tokens, not a trained one's; the steady state, without the
first steps' balance solve). Columns:
tokens/s; MFU = tokens/s x (6 x active parameters + causal attention) FLOPs per token over the GPU's dense bf16 peak
(`cipher_nb.monitor.metrics.PEAK_BF16_FLOPS`), no recomputation counted; the MoE/dense throughput ratio; the peak
memory of the timed steps beside `cipher-plan`'s prediction (`cipher_nb.train.plan.trace_step`, fake tensors on the
CPU); compile s = the warm-up steps' time beyond as many timed steps (compilation and autotuning).

Below the table, issue 49's step targets: the MoE block against the dense SwiGLU of equal active FLOPs, forward and
backward, at `benchmarks/moe.py`'s shapes of the targets (h100 preset, tiny-cpu, tiny-cpu-90s), with that script's
contenders and timer (bf16 on the GPU), in two runs, before the rows (it takes seconds).

`--limit` seconds: a row starts only when the time spent plus its estimated cost (the longest row so far, times
1.5 for an fp8 row; `FIRST_ROW_S` before any has run) stays within the limit; one that cannot is printed SKIPPED.
`--smoke` runs the same code at CPU-sized shapes, eagerly: the test of this script (tests/test_gpu_card.py).

    python benchmarks/gpu_card.py --out benchmarks/results/DATE-gpu-card.md   # one H100 / H200, under 8 minutes
    python benchmarks/gpu_card.py --rows dense,moe --steps 40
    python benchmarks/gpu_card.py --smoke                                     # CPU, tiny shapes, seconds
"""

import contextlib
import gc
import io
import itertools
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch
from fastcore.script import CliError

from cipher_nb.callbacks import run_callbacks
from cipher_nb.cli import run_command
from cipher_nb.config.load import TrainConfig, load_config
from cipher_nb.config.sizing import attention_flops_per_token, param_counts
from cipher_nb.core import dist_env
from cipher_nb.model.moe import MoE
from cipher_nb.monitor.metrics import device_peak_flops
from cipher_nb.persist.record import run_record
from cipher_nb.persist.stages import StageHooks
from cipher_nb.train.builder import MoEBalancing, build_model, build_optimization, open_device
from cipher_nb.train.plan import peak, trace_step
from cipher_nb.train.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "examples/configs"
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # moe.py's block contenders, also when loaded by path
import moe as moe_bench  # noqa: E402


@dataclass(frozen=True)
class Row:
    "One row of the card: a preset, its overrides, how it routes, and whether it is compared with the dense row."

    preset: str
    overrides: tuple = ()
    routing: str = "real"  # real: the router's choice; balanced: round-robin
    vs_dense: bool = False  # the MoE/dense column compares its tokens/s with the dense row's
    expert_parallel: bool = False  # over every GPU of the machine, under torchrun
    default: bool = True  # in the card when `--rows` is not given
    cost: float = 1.0  # its expected time over a bf16 row's: fp8 compiles and autotunes more


FP8 = ("training.precision=fp8",)
ROWS = {
    "dense": Row("gpu-card-dense.yaml", vs_dense=True),
    "moe": Row("gpu-card-moe.yaml", vs_dense=True),
    "moe-balanced": Row("gpu-card-moe.yaml", routing="balanced", vs_dense=True),
    "h100": Row("h100.yaml"),
    "ep": Row("gpu-card-moe.yaml", expert_parallel=True),
    "h100-fp8": Row("h100.yaml", overrides=FP8, cost=1.5),
    "wide": Row("wide-h100.yaml", default=False),
    "wide-fp8": Row("wide-h100.yaml", overrides=FP8, default=False, cost=1.5),
}
FIRST_ROW_S = dict(gpu=150.0, smoke=30.0)  # a conservative cost of the first row: build, compile, plan and steps
SMOKE = [  # CPU-sized shapes; the dense FFN width stays the MoE's active width (3 x 32), so the pair keeps equal FLOPs
    "model.vocab=272",
    "model.d_model=64",
    "model.n_layers=2",
    "model.d_ff=96",
    "model.attention.n_heads=4",
    "model.attention.n_kv_heads=2",
    "model.attention.head_dim=16",
    "training.seq_len=64",
    "training.batch_size=2",
    "training.compile=false",  # compiling on two CPU cores costs more than the whole smoke
]


BLOCK_TARGETS = moe_bench.BLOCK_TARGETS  # issue 49: MoE block / dense at most, per shape of benchmarks/moe.py
SMOKE_BLOCK = {"smoke": (2, 32, 64, 8, 2, 32, 1)}  # (batch, seq, d_model, experts, top-k, expert width, shared)


def block_ratios(shapes: dict, device, reps: int, runs: int = 2) -> dict:
    "MoE block / dense time per shape, measured `runs` times by moe.py's `bench_shape` (its tables kept quiet)."
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = {name: [] for name in shapes}
    for _ in range(runs):
        for name, shape in shapes.items():
            with contextlib.redirect_stdout(io.StringIO()):
                med = moe_bench.bench_shape(name, shape, device, dtype, False, reps, warmup=2)
            ours = next(n for n in med if n.startswith("ours["))
            out[name].append(med[ours] / med["dense"])
    return out


def block_text(ratios: dict, reps: int) -> list:
    "The block section's lines: each shape's ratio per run, whether the runs agree within 10%, and its target."
    runs = len(next(iter(ratios.values())))
    head = ["shape", *(f"run {i + 1}" for i in range(runs)), "runs within 10%", "target", "met"]
    lines = [
        "",
        "MoE block / dense SwiGLU of equal active FLOPs, forward + backward, `benchmarks/moe.py`'s contenders and "
        f"timer (median of {reps} interleaved repetitions a run; met: every run at or under the target and the runs "
        "within 10% of each other):",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for name, rs in ratios.items():
        agree, target = max(rs) <= 1.1 * min(rs), BLOCK_TARGETS.get(name)
        met = "-" if target is None else "yes" if agree and max(rs) <= target else "no"
        cells = [name, *(f"{r:.2f}x" for r in rs), "yes" if agree else "no", fmt(target, ".2f"), met]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def smoke_moe(cfg) -> list:
    "The tiny MoE of a smoke row: at most 8 experts of width 32, top-2 plus one shared (two populations stay two)."
    m = cfg.model.moe
    if not m.n_routed:
        return []
    n = min(m.n_routed, 8)
    tiny = [f"model.moe.n_routed={n}", "model.moe.top_k=2", "model.moe.n_shared=1", "model.moe.expert_d_ff=32"]
    return tiny + [f"model.moe.n_pop_a={min(m.n_pop_a, n // 2)}"]


def row_config(row: Row, smoke: bool, device: str, extra: tuple = ()):
    "The row's config: its preset and overrides, shrunk for `--smoke`, on `device`."
    # the steady state: a long run's first steps also solve their balance shift (`MoE.solving`), 200 of thousands
    steady = ["model.moe.center_steps=0"]
    path, overrides = CONFIGS / row.preset, [*steady, *row.overrides, f"training.device={device}", *extra]
    if not smoke:
        return load_config(path, overrides)
    return load_config(path, [*SMOKE, *smoke_moe(load_config(path)), *overrides])


def card_flops_per_token(m, seq_len: int) -> float:
    "6 x active parameters + causal attention (half of full attention's score and value products) per token."
    # the card's presets have no recurrence and no boundary predictor, whose extra passes this does not count
    pc = param_counts(m)
    return (
        6 * (pc["active_non_embedding"] + m.vocab * m.d_model) + m.n_layers * attention_flops_per_token(m, seq_len) / 2
    )


def round_robin(n_tokens: int, k: int, n_experts: int, device) -> torch.Tensor:
    "Chosen experts [N, k]: assignment i goes to expert i mod E (distinct experts per token, equal loads)."
    return (torch.arange(n_tokens * k, device=device) % n_experts).view(n_tokens, k)


def force_balanced(model) -> int:
    "Overwrite every MoE's routing choice with `round_robin` (gates re-read from its scores); return how many."
    blocks = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in blocks:

        def select(xf, _select=moe.select, c=moe.cfg.moe):
            logits, scores, idx, _ = _select(xf)
            idx = round_robin(idx.shape[0], c.top_k, c.n_routed, idx.device)
            gates = scores.gather(-1, idx)
            if c.router_renorm:
                gates = gates / gates.sum(-1, keepdim=True)
            return logits, scores, idx, gates * c.route_scale

        moe.select = select
    return len(blocks)


def random_batches(vocab: int, B: int, T: int, device, n: int = 4) -> list:
    "`n` batches of random tokens with next-token labels, on `device`."
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, vocab, (B, T + 1), generator=g) for _ in range(n)]
    return [dict(input_ids=x[:, :-1].to(device), labels=x[:, 1:].to(device)) for x in xs]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def planned_gib(cfg, cache: dict):
    "cipher-plan's peak (GiB) of one step on one GPU at the config's micro-batch, from fake tensors on the CPU."
    t = cfg.training
    key = json.dumps([cfg.model.__repr__(), t.__repr__(), cfg.optim.__repr__()])
    if key not in cache:
        phases = trace_step(cfg.model, t, cfg.optim, t.batch_size, 1, dtype=torch.bfloat16)
        cache[key] = sum(peak(phases)[1].values()) / 2**30
    return cache[key]


def precision_note(choice, record) -> str:
    "What the precision column does not say: a fallback, or how much a low precision converted."
    if choice.requested not in ("auto", choice.mode):
        return f"{choice.requested} fell back to {choice.mode}"
    layers = record.precision.get("layers", {})
    if not layers:
        return ""
    experts = layers.get("experts", {}).get("path", "-")
    return f"{len(layers.get('converted', []))} linears in {choice.mode}; experts: {experts}"


def build_step(cfg, routing: str):
    "A trainer built as `cipher-train` builds its model and optimizer, fed random batches: its step and what ran."
    env = dist_env()
    device, _ = open_device(cfg, env)  # the run's allocator settings, and the process group under torchrun
    record = run_record(cfg, world_size=env.world_size, data={})
    model, choice = build_model(cfg, StageHooks(), env, device, record)
    balanced = force_balanced(model) if routing == "balanced" else 0
    optimizer, _ = build_optimization(model, cfg, env, record)
    t, callbacks = cfg.training, [MoEBalancing()]
    loader = itertools.cycle(random_batches(cfg.model.vocab, t.batch_size, t.seq_len, device))
    tr = Trainer(cfg, model, optimizer, loader, device=device, env=env, dtype=choice.dtype, callbacks=callbacks)

    def step():
        run_callbacks(callbacks, "before_step", tr)
        res = tr.train_step()
        run_callbacks(callbacks, "after_step", tr)
        return res

    compiled = bool(record.kernels.get("compiled"))
    ran = dict(precision=choice.mode, compiled=compiled, balanced=balanced, note=precision_note(choice, record))
    return step, device, env, ran


def timed(step, device, n: int) -> tuple:
    "Seconds for `n` steps (the device synchronized) and the last step's result."
    t0, res = time.perf_counter(), None
    for _ in range(n):
        res = step()
    sync(device)
    return time.perf_counter() - t0, res


def measure(cfg, routing: str, steps: int, warmup: int) -> dict:
    "Warm-up steps (compilation), then `steps` timed steps: throughput, compile time, peak memory, losses."
    torch._dynamo.reset()  # each row compiles from scratch, so its warm-up shows the whole compile time
    cuda = torch.cuda.is_available() and cfg.training.device != "cpu"
    held = torch.cuda.memory_allocated() if cuda else 0  # what earlier rows left allocated, not this row's
    step, device, env, ran = build_step(cfg, routing)
    warm_s, first = timed(step, device, warmup)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    dt, last = timed(step, device, steps)
    if first is None or last is None:
        raise RuntimeError("a non-finite loss or gradient norm: a step was skipped")
    t = cfg.training
    return dict(
        ran,
        tok_s=t.batch_size * t.seq_len * env.world_size * steps / dt,
        step_ms=1000 * dt / steps,
        compile_s=max(0.0, warm_s - warmup * dt / steps),
        mem_gib=(torch.cuda.max_memory_allocated(device) - held) / 2**30 if cuda else None,
        loss=(float(first["loss"]), float(last["loss"])),
    )


def estimate_s(walls: list, first_s: float, cost: float = 1.0) -> float:
    "A row's estimated cost: `cost` x the longest row so far (per unit of cost), or `first_s` before any ran."
    return cost * (max(walls) if walls else first_s)


def skip_reason(elapsed: float, walls: list, first_s: float, limit: float, cost: float = 1.0) -> str:
    "Why a row must not start ('' when it can finish within `limit`)."
    need = estimate_s(walls, first_s, cost)
    if elapsed + need <= limit:
        return ""
    return f"SKIPPED: {elapsed:.0f} s spent + about {need:.0f} s for this row > --limit {limit:.0f} s"


def ep_blocker(n_gpus: int) -> str:
    "Why the expert-parallel row cannot run here ('' when it can)."
    if not hasattr(TrainConfig, "expert_parallel"):
        return "not available in this version (TrainConfig has no expert_parallel)"
    if n_gpus < 2:
        return f"needs >1 GPU (this machine has {n_gpus})"
    return ""


def ep_degree(world: int, n_routed: int) -> int:
    "The expert-parallel degree over `world` ranks: the largest that divides both the ranks and the routed experts."
    return math.gcd(world, n_routed)


def run_ranks(name: str, n: int, a: dict, timeout: float) -> dict:
    "Row `name` measured by `n` ranks under torchrun (this script in `--worker` mode); rank 0's result."
    flags = [f"--steps={a['steps']}", f"--warmup={a['warmup']}", f"--device={a['device']}"] + ["--smoke"] * a["smoke"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", __file__]
    p = subprocess.run([*cmd, "--worker", f"--rows={name}", *flags], capture_output=True, text=True, timeout=timeout)
    lines = [x for x in p.stdout.splitlines() if x.startswith("CARD_ROW ")]
    if p.returncode or not lines:
        raise RuntimeError(f"torchrun exited {p.returncode}: {(p.stderr.strip().splitlines() or ['-'])[-1][:300]}")
    return json.loads(lines[-1].removeprefix("CARD_ROW "))


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


HEAD = ["row", "preset", "precision", "compiled", "routing", "micro-batch", "GFLOP/tok", "tok/s", "MFU", "MoE/dense"]
HEAD += ["peak GiB", "plan GiB", "compile s", "ms/step", "loss", "note"]


def table_line(name: str, r: dict, dense_tok_s, peak_flops) -> str:
    "One markdown row of the card."
    row, tok_s = ROWS[name], r.get("tok_s")
    mfu = tok_s * r["flops"] / (peak_flops * r.get("ranks", 1)) if tok_s and peak_flops else None
    ratio = tok_s / dense_tok_s if tok_s and dense_tok_s and row.vs_dense else None
    loss = f"{r['loss'][0]:.3f} -> {r['loss'][1]:.3f}" if "loss" in r else "-"
    cells = [
        name,
        row.preset.removesuffix(".yaml"),
        r.get("precision", "-"),
        {True: "yes", False: "no"}.get(r.get("compiled"), "-"),
    ]
    cells += [row.routing, str(r["micro_batch"]), fmt(r["flops"] / 1e9, ".4g"), fmt(tok_s, ",.0f"), fmt(mfu, ".1%")]
    cells += [fmt(ratio, ".3f"), fmt(r.get("mem_gib"), ".2f"), fmt(r.get("plan_gib"), ".2f")]
    cells += [fmt(r.get("compile_s"), ".1f"), fmt(r.get("step_ms"), ".1f"), loss, r.get("note", "")]
    return "| " + " | ".join(cells) + " |"


def card_text(results: dict, header: list, peak_flops) -> str:
    "The card: its header lines and one markdown table, a line per row in `ROWS`' order."
    dense = results.get("dense", {}).get("tok_s")
    lines = [*header, "", "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    return "\n".join(lines + [table_line(n, results[n], dense, peak_flops) for n in ROWS if n in results]) + "\n"


def parse_rows(rows: str) -> list:
    "The row names `--rows` gives (all when empty), in the card's order; a `CliError` naming an unknown one."
    names = [x.strip() for x in rows.split(",") if x.strip()] or [n for n, r in ROWS.items() if r.default]
    bad = [x for x in names if x not in ROWS]
    if bad:
        raise CliError(f"gpu_card: unknown row(s) {', '.join(bad)} in --rows; choose from {', '.join(ROWS)}")
    return [n for n in ROWS if n in names]


def pick_device(device: str, smoke: bool) -> str:
    "The device rows run on ('cpu' or 'auto', which is each rank's own GPU), or a `CliError` when it cannot be."
    if device not in ("auto", "cpu", "cuda"):
        raise CliError(f"gpu_card: --device {device} unknown; use auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise CliError("gpu_card: --device cuda, but torch sees no CUDA GPU: run with --smoke on a CPU")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    if device == "cpu" and not smoke:
        raise CliError("gpu_card: no CUDA GPU here (or --device cpu): the card's shapes need one; run with --smoke")
    return "auto" if device == "cuda" else "cpu"


def run_row(name: str, cfg, a: dict, plans: dict, timeout: float) -> dict:
    "Measure one row (in this process, or under torchrun for the expert-parallel one) and plan its memory."
    if ROWS[name].expert_parallel:
        n = torch.cuda.device_count()
        return dict(run_ranks(name, n, a, timeout), ranks=n)
    r = measure(cfg, ROWS[name].routing, a["steps"], a["warmup"])
    return dict(r, plan_gib=planned_gib(cfg, plans))


def failure(e: BaseException) -> dict:
    "A row that did not finish: out of memory or failed, with the error's first line."
    oom = isinstance(e, torch.OutOfMemoryError)
    return dict(
        status="oom" if oom else "failed", note=f"{'OOM' if oom else 'FAILED'}: {type(e).__name__}: {str(e)[:200]}"
    )


def measure_rank(name: str, a: dict):
    "Under torchrun: measure row `name` on this rank with expert parallelism over all ranks; rank 0 prints it."
    env, row = dist_env(), ROWS[name]
    n_routed = row_config(row, a["smoke"], a["device"]).model.moe.n_routed
    ep = f"training.expert_parallel={ep_degree(env.world_size, n_routed)}"
    r = measure(row_config(row, a["smoke"], a["device"], (ep,)), row.routing, a["steps"], a["warmup"])
    if env.is_main:
        print("CARD_ROW " + json.dumps(r), flush=True)


def run_card(names: list, a: dict, limit: float) -> dict:
    "Each row in turn, or SKIPPED when it could not finish within `limit` seconds: name -> its results."
    t_start, walls, plans, results = time.perf_counter(), [], {}, {}
    n_gpus = torch.cuda.device_count() if a["device"] == "auto" else 0
    first_s = FIRST_ROW_S["smoke" if a["smoke"] else "gpu"]
    for name in names:
        row = ROWS[name]
        cfg = row_config(row, a["smoke"], a["device"])
        r = dict(micro_batch=cfg.training.batch_size, flops=card_flops_per_token(cfg.model, cfg.training.seq_len))
        elapsed = time.perf_counter() - t_start
        reason = ep_blocker(n_gpus) if row.expert_parallel else ""
        reason = reason or skip_reason(elapsed, walls, first_s, limit, row.cost)
        if reason:
            results[name] = dict(r, status="skipped", note=reason)
        else:
            t0 = time.perf_counter()
            try:
                results[name] = dict(r, status="ran", **run_row(name, cfg, a, plans, limit - elapsed))
            except Exception as e:  # the row's failure goes in the table; the other rows still run
                results[name] = dict(r, **failure(e))
            results[name]["wall_s"] = time.perf_counter() - t0
            walls.append(results[name]["wall_s"] / row.cost)
            torch._dynamo.reset()  # its caches hold the row's compiled blocks and, through them, its weights
            gc.collect()
            if a["device"] == "auto":
                torch.cuda.empty_cache()
        r = results[name]
        took = f" in {r['wall_s']:.0f} s" if "wall_s" in r else ""
        print(f"{name}: {r['status']}{took} {r.get('note', '')}".rstrip(), flush=True)
    return results


def card_header(a: dict, peak_flops, seconds: float) -> list:
    "The lines above the table: the machine, the peak MFU is taken against, and what the columns mean."
    name = torch.cuda.get_device_name() if a["device"] == "auto" else "CPU (smoke shapes)"
    tflops = fmt(peak_flops and peak_flops / 1e12, ".0f")
    return [
        f"# GPU bench card, {date.today()}",
        "",
        f"device: {name}; torch {torch.__version__}; dense bf16 peak {tflops} TFLOP/s; {a['warmup']} warm-up + "
        f"{a['steps']} timed steps a row; {seconds:.0f} s in all",
        "MFU: tok/s x (6 x active parameters + causal attention) FLOPs per token / the dense bf16 peak (fp8 rows too), "
        "no recomputation counted. compile s: the warm-up steps' time beyond as many timed steps (the first compiled "
        "row's includes the compiler's start in this process). plan GiB: "
        "cipher-plan's peak for the row's micro-batch on one GPU.",
    ]


def main(
    rows: str = "",  # comma-separated rows (default: all but wide, wide-fp8): dense, moe, moe-balanced, h100, ...
    limit: float = 450,  # seconds: a row that could not finish within this is skipped
    steps: int = 20,  # timed steps per row
    warmup: int = 3,  # untimed steps first: compilation and autotuning happen here
    device: str = "auto",  # auto, cuda or cpu (cpu only with --smoke)
    smoke: bool = False,  # CPU-sized shapes, eager: the test of this script
    out: str = "",  # also write the card (markdown) to this file
    block_reps: int = 20,  # repetitions a run in the MoE block section (0: leave it out)
    peak: float = 0,  # dense bf16 FLOP/s of one GPU for MFU; 0: the GPU's own from PEAK_BF16_FLOPS
    worker: bool = False,  # internal: one rank of the expert-parallel row under torchrun
):
    "Dense vs MoE (real and forced-balanced routing), the h100 preset and expert parallelism: one table."
    names, dev = parse_rows(rows), pick_device(device, smoke)
    if smoke:
        steps, warmup = min(steps, 3), min(warmup, 1)
    a = dict(steps=steps, warmup=max(1, warmup), device=dev, smoke=smoke)
    if worker:
        return measure_rank(names[0], a)
    t0 = time.perf_counter()
    block, block_status = [], "ran"
    if block_reps > 0:
        shapes = SMOKE_BLOCK if smoke else {n: moe_bench.SHAPES["cpu"][n] for n in BLOCK_TARGETS}
        reps = min(block_reps, 3) if smoke else block_reps
        try:
            ratios = block_ratios(shapes, torch.device("cuda" if dev == "auto" else "cpu"), reps)
        except Exception as e:  # as a row's failure: a line in the card, and the rows still run
            fail = failure(e)
            block, block_status = ["", f"MoE block section: {fail['note']}"], fail["status"]
        else:
            for name, rs in ratios.items():
                print(f"block {name}: MoE / dense " + ", ".join(f"{r:.2f}x" for r in rs), flush=True)
            block = block_text(ratios, reps)
    results = run_card(names, a, limit - (time.perf_counter() - t0))
    peak_flops = peak or (device_peak_flops() if dev == "auto" else None)
    text = card_text(results, card_header(a, peak_flops, time.perf_counter() - t0), peak_flops)
    text += "\n".join(block) + ("\n" if block else "")
    print("\n" + text, end="")
    if out:
        Path(out).write_text(text)
    status = {r["status"] for r in results.values()} | {block_status}
    return 1 if "failed" in status else 3 if "oom" in status else 0


if __name__ == "__main__":
    sys.exit(run_command(main))
