#!/usr/bin/env python
"""GPU check: the H100 preset and the wide preset trained for a few steps in each precision, compiled or not.

With no `--modes`, one run measures the whole plan (`PLAN` below): the H100 preset (a 100M MoE of width 512) in bf16
eager, bf16 compiled and fp8 compiled, then the wide preset (a 0.8B dense model of width 2048) in bf16 compiled, fp8
compiled and bf16 compiled with full activation checkpointing, and last the H100 preset in fp8 with the size filter
off (every layer converted). Each mode gets a fresh `CipherModel`, random token batches of the preset's shape, the
precision chosen by `cipher_nb.optim.precision` (the conversion keeps layers narrower than
`training.fp8_min_dim` in bf16,
and the report says which), the project's optimizer and autocast. A mode spec is `MODE[:recipe][+compile][+ac][+all]`:
`+compile` compiles each block (regional compilation), `+ac` checkpoints each block's activations, `+all` sets
`fp8_min_dim` to 0. The spec, not the preset's `training.compile`, decides compilation.

Printed per preset: tok/s, MFU (FLOPs per token from `cipher_nb.config.sizing.flops_per_token`, without the
recomputation of
activation checkpointing, against the dense bf16 peak, 989 TFLOP/s for H100 and H200 SXM, for every mode), peak
memory, the time of the first step (compilation and autotuning; the timed steps start after the warmup), the share
of matmul FLOPs that ran in low precision, and ratios to the preset's first mode. `--time-limit` skips the modes that
would start after it, so the run fits a short GPU lease. `--smoke` runs the same code on tiny shapes on a CPU (fp8
and MXFP8 emulated by torchao, compilation skipped unless `--cpu-compile`) so it can be tested before GPU minutes
are spent.

    python benchmarks/gpu_check.py                                # the whole plan, a few minutes on one H100
    python benchmarks/gpu_check.py --modes bf16,fp8+compile,fp8:tensorwise+compile --config examples/configs/h100.yaml
    python benchmarks/gpu_check.py --smoke                        # CPU, tiny shapes, seconds
"""

import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
from fastcore.script import CliError, call_parse
from torch.utils.checkpoint import checkpoint

from cipher_nb.config.load import load_config
from cipher_nb.config.sizing import flops_per_token, param_counts
from cipher_nb.core import autocast, resolve_device, seed_everything
from cipher_nb.model.lm import CipherModel
from cipher_nb.optim.optimizers import build_optimizer
from cipher_nb.optim.precision import convert_model, detect_precision, probe_device, probe_libs

try:  # the project's block-wise checkpointing and compilation, where this checkout has them
    from cipher_nb.optim.parallel import apply_ac, apply_compile
except ImportError:  # an older checkout: the script's own equivalents below
    apply_ac = apply_compile = None

ROOT = Path(__file__).resolve().parent.parent
PRESETS = dict(h100="examples/configs/h100.yaml", wide="examples/configs/wide-h100.yaml")
PLAN = (  # (preset, mode spec), in the order they run: the most wanted first, in case the time limit cuts the tail
    ("h100", "bf16"),
    ("h100", "bf16+compile"),
    ("h100", "fp8+compile"),
    ("wide", "bf16+compile"),
    ("wide", "fp8+compile"),
    ("wide", "bf16+compile+ac"),
    ("h100", "fp8+compile+all"),
)
SMOKE = [
    "model.vocab=272",
    "model.d_model=64",
    "model.n_layers=2",
    "model.attention.n_heads=4",
    "model.attention.n_kv_heads=2",
    "model.attention.head_dim=16",
    "training.seq_len=64",
    "training.batch_size=2",
    "training.fp8_min_dim=16",  # the tiny layers convert, so the smoke exercises conversion
]
SMOKE_MOE = [
    "model.moe.n_routed=4",
    "model.moe.top_k=2",
    "model.moe.n_shared=1",
    "model.moe.expert_d_ff=32",
    "model.moe.impl=grouped",  # the expert path the H100 takes (auto picks bmm on a CPU)
]
SMOKE_DENSE = ["model.d_ff=128"]
BLOCK_LISTS = ("hourglass.byte_in", "layers", "hourglass.byte_out")  # the ModuleLists of blocks in a CipherModel


def parse_mode(spec: str) -> dict:
    "'fp8:tensorwise+compile+ac' -> mode, recipe, experts, compile, ac, all (fp8-dense: experts left in bf16)."
    name, *flags = spec.split("+")
    unknown = set(flags) - {"compile", "ac", "all"}
    name, _, recipe = name.partition(":")
    mode = name.removesuffix("-dense")
    if unknown or mode not in ("fp32", "fp16", "bf16", "fp8", "mxfp8", "nvfp4"):
        raise CliError(
            f"mode '{spec}' unknown: use bf16, fp8, fp8-dense, fp8:tensorwise, mxfp8, with +compile, +ac, +all"
        )
    return dict(
        mode=mode,
        recipe=recipe or "rowwise",
        experts=not name.endswith("-dense"),
        compile="compile" in flags,
        ac="ac" in flags,
        all="all" in flags,
    )


class Checkpointed(nn.Module):  # the fallback when cipher_nb.optim.parallel is missing
    "A block whose activations are recomputed in the backward pass instead of kept (full activation checkpointing)."

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def block_lists(model: nn.Module) -> list:
    found = []
    for path in BLOCK_LISTS:
        m = model
        for part in path.split("."):
            m = getattr(m, part, None)
        found += [m] if isinstance(m, nn.ModuleList) else []
    return found


def checkpoint_blocks(model: nn.Module) -> int:
    "Wrap every block in `Checkpointed`; return how many."
    n = 0
    for blocks in block_lists(model):
        for i in range(len(blocks)):
            blocks[i] = Checkpointed(blocks[i])
            n += 1
    return n


def compile_blocks(model: nn.Module) -> int:
    "torch.compile every block in place (regional compilation: identical blocks share one compiled graph)."
    n = 0
    for blocks in block_lists(model):
        for blk in blocks:
            blk.compile()
            n += 1
    return n


def random_batches(vocab: int, B: int, T: int, n: int, device) -> list:
    "`n` batches of random tokens, next-token labels."
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (B, T + 1), generator=g)
        out.append(dict(input_ids=x[:, :-1].to(device), labels=x[:, 1:].to(device)))
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_planned = {}  # (preset config, checkpointing) -> the planner's peak in GiB


def copy_rates(cfg, device, rounds: int = 20) -> dict:
    "GB/s of one training batch of `cfg`'s shape (token ids and targets) copied to `device`, pinned and not."
    B, T = cfg.training.batch_size, cfg.training.seq_len
    batch = {k: torch.randint(0, cfg.model.vocab, (B, T)) for k in ("input_ids", "labels")}
    size = sum(t.numel() * t.element_size() for t in batch.values())
    rates = {}
    for kind in ("unpinned", "pinned"):
        if kind == "pinned" and device.type != "cuda":
            rates[kind] = None  # pinned host memory needs an accelerator
            continue
        host = {k: t.pin_memory() for k, t in batch.items()} if kind == "pinned" else batch
        sync(device)
        t0 = time.perf_counter()
        for _ in range(rounds):
            {k: t.to(device, non_blocking=True) for k, t in host.items()}
        sync(device)
        rates[kind] = rounds * size / (time.perf_counter() - t0) / 1e9
    return rates


def planned_gib(cfg, ac: bool) -> float | None:
    "cipher-plan's bf16 peak on one GPU at the preset's micro-batch (fake tensors, on the CPU), beside the GPU's."
    from dataclasses import replace

    from cipher_nb.train.plan import trace_step

    key = (id(cfg), ac)
    if key not in _planned:
        t = replace(cfg.training, activation_checkpoint="full" if ac else "none")
        try:
            phases = trace_step(cfg.model, t, cfg.optim, t.batch_size, 1, dtype=torch.bfloat16)
            _planned[key] = max(sum(by.values()) for by in phases.values()) / 2**30
        except Exception as e:  # the planner's failure is reported, the GPU check goes on
            print(f"  planner failed for this mode: {type(e).__name__}: {str(e)[:200]}")
            _planned[key] = None
    return _planned[key]


def run_mode(cfg, spec: str, device, steps: int, warmup: int, emulate: bool, cpu_compile: bool) -> dict:
    "Train a fresh model for `warmup` + `steps` steps in mode `spec`; return its measurements."
    m = parse_mode(spec)
    choice = detect_precision(m["mode"], recipe=m["recipe"], emulate=emulate)
    compiled = m["compile"] and (device.type == "cuda" or cpu_compile)
    row = dict(spec=spec, mode=choice.mode, reason=choice.reason, compiled=compiled, ac=m["ac"])
    if choice.mode != m["mode"]:
        return dict(row, error=f"fell back to {choice.mode}: {choice.tried[-1][1] if choice.tried else choice.reason}")
    seed_everything(cfg.training.seed)
    model = CipherModel(cfg.model).to(device)
    B, T = cfg.training.batch_size, cfg.training.seq_len
    batches = random_batches(cfg.model.vocab, B, T, 4, device)

    def micro(mdl, b):
        with autocast(device, choice.dtype):
            out = mdl(**b)
            loss = out.loss + sum(out.aux.values())
        loss.backward()
        return out.loss.detach()

    min_dim = 0 if m["all"] else cfg.training.fp8_min_dim
    report = convert_model(
        model, choice, experts=m["experts"], probe=lambda mdl: micro(mdl, batches[0]), min_dim=min_dim
    )
    # before wrapping: the optimizer's parameter names stay the model's own
    opt = build_optimizer(model, cfg.optim, cfg.schedule.lr)
    if m["ac"]:
        if apply_ac is not None:
            apply_ac(model, "full")
        else:
            checkpoint_blocks(model)
    if compiled:
        torch._dynamo.reset()  # each mode compiles from scratch, so its first step shows the whole compile time
        if apply_compile is not None:
            apply_compile(model)
        else:
            compile_blocks(model)
    params = [p for p in model.parameters() if p.requires_grad]

    def step(i):
        loss = micro(model, batches[i % len(batches)])
        torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    cuda = device.type == "cuda"
    sync(device)
    t0 = time.perf_counter()
    losses = [step(0)]
    sync(device)
    first_s = time.perf_counter() - t0
    losses += [step(1 + i) for i in range(warmup - 1)]
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    losses += [step(warmup + i) for i in range(steps)]
    sync(device)
    dt = time.perf_counter() - t0
    losses = [loss.item() for loss in losses]
    if not all(v == v and abs(v) != float("inf") for v in losses):
        return dict(row, error=f"non-finite loss: {losses}")
    s = report.get("summary", {})
    return dict(
        row,
        tok_s=B * T * steps / dt,
        step_ms=1000 * dt / steps,
        first_s=first_s,
        mem_gb=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        plan_gb=planned_gib(cfg, m["ac"]),
        loss_first=losses[0],
        loss_last=losses[-1],
        experts=report["experts"].get("path", f"{choice.mode} autocast"),
        lowp_share=report["kernels"].get("lowp_share", 0.0),
        kernels=report["kernels"].get("calls", {}),
        n_converted=s.get("n_converted", 0),
        skipped=s.get("skipped", {}),
        min_dim=report.get("min_dim", 0),
        optimizer=type(opt).__name__ + (" (fused)" if opt.defaults.get("fused") else ""),
    )


def table(rows: list, fpt: float, peak: float) -> str:
    "The side-by-side table of one preset, with ratios to its first mode that ran."
    base = next((r for r in rows if "tok_s" in r), None)
    head = (
        f"{'mode':<18}{'tok/s':>12}{'MFU':>8}{'ms/step':>9}{'peak GB':>9}{'plan GB':>9}{'lowp FLOPs':>11}{'tok/s x':>9}"
        f"{'mem x':>7}"
        f"{'1st step s':>11}{'converted':>10}  experts"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if "tok_s" not in r:
            lines.append(f"{r['spec']:<18}  FAILED: {r['error']}")
            continue
        mfu = fpt * r["tok_s"] / peak
        mem = f"{r['mem_gb']:.2f}" if r["mem_gb"] is not None else "-"
        plan = f"{r['plan_gb']:.2f}" if r.get("plan_gb") is not None else "-"
        memx = f"{r['mem_gb'] / base['mem_gb']:.2f}" if r["mem_gb"] and base["mem_gb"] else "-"
        lines.append(
            f"{r['spec']:<18}{r['tok_s']:>12,.0f}{mfu:>8.1%}{r['step_ms']:>9.1f}{mem:>9}{plan:>9}{r['lowp_share']:>11.0%}"
            f"{r['tok_s'] / base['tok_s']:>9.2f}{memx:>7}{r['first_s']:>11.1f}{r['n_converted']:>10}  {r['experts']}"
        )
    return "\n".join(lines)


def preset_config(path: Path, smoke: bool):
    "The preset, shrunk to tiny shapes for `--smoke` (MoE presets keep a tiny MoE, dense ones a tiny SwiGLU)."
    if not smoke:
        return load_config(path)
    moe = load_config(path).model.moe
    pops = [f"model.moe.n_pop_a={min(moe.n_pop_a, 2)}"]  # a preset's two populations stay two in the tiny MoE
    return load_config(path, SMOKE + (SMOKE_MOE + pops if moe.n_routed else SMOKE_DENSE))


def describe(name: str, cfg, fpt: float, smoke: bool, warmup: int, steps: int) -> str:
    pc = param_counts(cfg.model)
    return (
        f"preset {name}{' (smoke shapes)' if smoke else ''}: {pc['total'] / 1e6:.1f}M params, "
        f"{pc['active'] / 1e6:.1f}M active, batch {cfg.training.batch_size} x {cfg.training.seq_len} tokens a step, "
        f"{fpt / 1e9:.2f} GFLOP/token, moe {cfg.model.moe.impl if cfg.model.moe.n_routed else 'none (dense)'}, "
        f"fp8_min_dim {cfg.training.fp8_min_dim}, optimizer {cfg.optim.name}, {warmup} warmup + {steps} timed steps"
    )


@call_parse
def main(
    modes: str = "",  # comma-separated specs on --config: bf16, fp8+compile, bf16+compile+ac, ...; empty: PLAN
    config: str = "",  # the preset for --modes (default: the H100 preset)
    steps: int = 10,  # timed steps per mode
    warmup: int = 2,  # untimed steps first; the first one compiles (its time is printed on its own)
    compile: bool = False,  # add +compile to every --modes spec
    peak: float = 989e12,  # dense bf16 FLOP/s of one GPU for MFU (H100 / H200 SXM)
    time_limit: float = 360,  # seconds: a mode that would start after this is skipped
    smoke: bool = False,  # tiny shapes on the CPU, low precision emulated: a test of this script
    cpu_compile: bool = False,  # with --smoke: compile the +compile modes on the CPU too (slow)
    out: str = "",  # also write the results as JSON here
):
    "bf16, fp8, compiled and checkpointed training side by side: tok/s, MFU, peak memory, compile time."
    if modes:
        path = Path(config or PRESETS["h100"])
        specs = [s.strip() + ("+compile" if compile and "+compile" not in s else "") for s in modes.split(",")]
        plan = [(path, s) for s in specs if s.strip()]
    else:
        plan = [(Path(PRESETS[p]), s) for p, s in PLAN]
    plan = [(p if p.is_absolute() or p.exists() else ROOT / p, s) for p, s in plan]
    for _, s in plan:
        parse_mode(s)  # a typo fails before any GPU time is spent
    if smoke:
        steps, warmup = min(steps, 2), min(warmup, 1)
    warmup = max(warmup, 1)
    device = resolve_device("cpu" if smoke else "auto")
    if device.type != "cuda" and not smoke:
        raise CliError("no CUDA GPU: run with --smoke for the CPU test of this script")
    caps, libs = probe_device(device), probe_libs()
    try:
        import torchao

        ao = torchao.__version__
    except Exception:
        ao = "missing"
    print(
        f"device: {caps.name} (capability {caps.capability[0]}.{caps.capability[1]}), torch {torch.__version__}, "
        f"torchao {ao}, python {platform.python_version()}"
    )
    print(
        f"libraries: {', '.join(k for k in ('float8', 'fp8_grouped', 'mxfp8', 'nvfp4', 'triton') if getattr(libs, k))}"
        + (f"; missing: {libs.why}" if libs.why else "")
    )
    where = (
        "cipher_nb.optim.parallel"
        if apply_compile is not None
        else "this script's fallback (no cipher_nb.optim.parallel)"
    )
    print(f"compile and activation checkpointing: {where}")
    if smoke and not cpu_compile:
        print("smoke: +compile modes run eagerly (pass --cpu-compile to compile on the CPU)")
    presets, rows, copies = {}, {}, {}
    t_start = time.perf_counter()
    for path, spec in plan:
        if path not in presets:
            cfg = preset_config(path, smoke)
            fpt = flops_per_token(cfg.model, cfg.training.seq_len)
            presets[path] = (cfg, fpt)
            print(describe(path.name, cfg, fpt, smoke, warmup, steps))
        cfg, _ = presets[path]
        if path not in copies:  # the loader's pinned memory (data.pin_memory) against plain host memory
            copies[path] = copy_rates(cfg, device)
            print(
                "  batch to device, GB/s: "
                + ", ".join(f"{k} {v:.2f}" if v else f"{k} n/a (no GPU)" for k, v in copies[path].items())
                + (f"; pinned x{c['pinned'] / c['unpinned']:.2f}" if (c := copies[path])["pinned"] else "")
            )
        elapsed = time.perf_counter() - t_start
        if elapsed > time_limit:
            r = dict(spec=spec, error=f"skipped: {elapsed:.0f} s spent, over --time-limit {time_limit:.0f} s")
        else:
            t0 = time.perf_counter()
            try:
                r = run_mode(cfg, spec, device, steps, warmup, emulate=smoke, cpu_compile=cpu_compile)
            except Exception as e:
                r = dict(spec=spec, error=f"{type(e).__name__}: {str(e)[:400]}")
            r["wall_s"] = time.perf_counter() - t0
        rows.setdefault(path, []).append(r)
        print(
            f"  {path.stem} {spec}: "
            + (
                f"{r['tok_s']:,.0f} tok/s, first step {r['first_s']:.1f} s, loss {r['loss_first']:.3f} -> "
                f"{r['loss_last']:.3f}, {r['optimizer']}, {r['n_converted']} layers converted "
                f"(fp8_min_dim {r['min_dim']}), kept: {r['skipped']}, kernels {r['kernels']}, {r['wall_s']:.0f} s"
                if "tok_s" in r
                else f"FAILED {r['error']}"
            ),
            flush=True,
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    for path, rs in rows.items():
        cfg, fpt = presets[path]
        print(f"\n{path.name}: ratios to {rs[0]['spec']}")
        print(table(rs, fpt, peak))
    if out:
        Path(out).write_text(
            json.dumps(
                dict(
                    device=caps.name,
                    torch=torch.__version__,
                    torchao=ao,
                    peak=peak,
                    presets={
                        str(p): dict(flops_per_token=presets[p][1], rows=rs, copy_gb_s=copies[p])
                        for p, rs in rows.items()
                    },
                ),
                indent=1,
                default=str,
            )
        )
    if any("error" in r for rs in rows.values() for r in rs):
        sys.exit(1)
