#!/usr/bin/env python
"""GPU check: the H100 preset trained for a fixed number of steps in bf16 and in fp8, side by side.

For each mode: a fresh `CipherModel` from the preset, random token batches of the preset's shape, the precision
chosen by `cipher_nb.precision` (conversion report and the kernels one probe step really ran), the project's
optimizer, bf16 autocast. Prints tok/s, MFU (FLOPs per token from `cipher_nb.config.flops_per_token` against the
dense bf16 peak, 989 TFLOP/s for H100 and H200 SXM), peak memory and where the matmul FLOPs ran, with ratios to the
first mode. `--smoke` runs the same code on tiny shapes on a CPU (fp8 emulated by torchao) so it can be tested
before GPU minutes are spent.

    python benchmarks/gpu_check.py                                # bf16 vs fp8 on the H100 preset, 20 timed steps
    python benchmarks/gpu_check.py --modes bf16,fp8,fp8-dense,fp8:tensorwise --compile --out gpu_check.json
    python benchmarks/gpu_check.py --smoke                        # CPU, tiny shapes, seconds
"""

import json
import platform
import sys
import time
from pathlib import Path

import torch
from fastcore.script import CliError, call_parse

from cipher_nb.config import load_config
from cipher_nb.core import autocast, resolve_device, seed_everything
from cipher_nb.model import CipherModel
from cipher_nb.optim import build_optimizer
from cipher_nb.precision import convert_model, detect_precision, probe_device, probe_libs
from cipher_nb.sizing import flops_per_token, param_counts

ROOT = Path(__file__).resolve().parent.parent
SMOKE = [
    "model.vocab=272",
    "model.d_model=64",
    "model.n_layers=2",
    "model.attention.n_heads=4",
    "model.attention.n_kv_heads=2",
    "model.attention.head_dim=16",
    "model.moe.n_routed=4",
    "model.moe.top_k=2",
    "model.moe.n_shared=1",
    "model.moe.expert_d_ff=32",
    "training.seq_len=64",
    "training.batch_size=2",
    "model.moe.impl=grouped",
]  # the expert path the H100 takes (auto picks bmm on a CPU)


def parse_mode(spec: str) -> tuple:
    "'fp8' | 'fp8:tensorwise' | 'fp8-dense' (experts left in bf16) -> (mode, recipe, experts)."
    name, _, recipe = spec.partition(":")
    experts = not name.endswith("-dense")
    mode = name.removesuffix("-dense")
    if mode not in ("fp32", "fp16", "bf16", "fp8", "mxfp8", "nvfp4"):
        raise CliError(f"mode '{spec}' unknown: use bf16, fp8, fp8-dense, fp8:tensorwise, mxfp8, ...")
    return mode, recipe or "rowwise", experts


def random_batches(vocab: int, B: int, T: int, n: int, device) -> list:
    "`n` batches of random tokens, next-token labels."
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (B, T + 1), generator=g)
        out.append(dict(input_ids=x[:, :-1].to(device), labels=x[:, 1:].to(device)))
    return out


def run_mode(cfg, spec: str, device, steps: int, warmup: int, compile: bool, emulate: bool) -> dict:
    "Train a fresh model for `warmup` + `steps` steps in mode `spec`; return its measurements."
    mode, recipe, experts = parse_mode(spec)
    choice = detect_precision(mode, recipe=recipe, emulate=emulate)
    row = dict(spec=spec, mode=choice.mode, reason=choice.reason)
    if choice.mode != mode:
        return dict(row, error=f"fell back to {choice.mode}: {choice.tried[-1][1] if choice.tried else choice.reason}")
    seed_everything(cfg.training.seed)
    model = CipherModel(cfg.model).to(device)
    B, T = cfg.training.batch_size, cfg.training.seq_len
    batches = random_batches(cfg.model.vocab, B, T, 4, device)

    def micro(m, b):
        with autocast(device, choice.dtype):
            out = m(**b)
            loss = out.loss + sum(out.aux.values())
        loss.backward()
        return out.loss.detach()

    report = convert_model(model, choice, experts=experts, probe=lambda m: micro(m, batches[0]))
    opt = build_optimizer(model, cfg)
    train = torch.compile(model) if compile else model
    params = [p for p in model.parameters() if p.requires_grad]

    def step(i):
        loss = micro(train, batches[i % len(batches)])
        torch.nn.utils.clip_grad_norm_(params, cfg.training.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    cuda = device.type == "cuda"
    losses = [step(i) for i in range(warmup)]
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    losses += [step(warmup + i) for i in range(steps)]
    if cuda:
        torch.cuda.synchronize(device)
    dt = time.perf_counter() - t0
    losses = [loss.item() for loss in losses]
    if not all(map(lambda v: v == v and abs(v) != float("inf"), losses)):
        return dict(row, error=f"non-finite loss: {losses}")
    tok_s = B * T * steps / dt
    return dict(
        row,
        tok_s=tok_s,
        step_ms=1000 * dt / steps,
        mem_gb=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        loss_first=losses[0],
        loss_last=losses[-1],
        experts=report["experts"].get("path", f"{choice.mode} autocast"),
        lowp_share=report["kernels"].get("lowp_share", 0.0),
        kernels=report["kernels"].get("calls", {}),
        n_converted=len(report["converted"]),
        optimizer=type(opt).__name__ + (" (fused)" if opt.defaults.get("fused") else ""),
    )


def table(rows: list, fpt: float, peak: float) -> str:
    "The side-by-side table, with ratios to the first mode that ran."
    base = next((r for r in rows if "tok_s" in r), None)
    head = (
        f"{'mode':<16}{'tok/s':>12}{'MFU':>8}{'ms/step':>9}{'peak GB':>9}{'lowp FLOPs':>11}{'tok/s x':>9}{'mem x':>7}"
        "  experts"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if "tok_s" not in r:
            lines.append(f"{r['spec']:<16}  FAILED: {r['error']}")
            continue
        mfu = fpt * r["tok_s"] / peak
        mem = f"{r['mem_gb']:.2f}" if r["mem_gb"] is not None else "-"
        memx = f"{r['mem_gb'] / base['mem_gb']:.2f}" if r["mem_gb"] and base["mem_gb"] else "-"
        lines.append(
            f"{r['spec']:<16}{r['tok_s']:>12,.0f}{mfu:>8.1%}{r['step_ms']:>9.1f}{mem:>9}{r['lowp_share']:>11.0%}"
            f"{r['tok_s'] / base['tok_s']:>9.2f}{memx:>7}  {r['experts']}"
        )
    return "\n".join(lines)


@call_parse
def main(
    config: str = "examples/configs/h100.yaml",  # the preset to train
    modes: str = "bf16,fp8",  # comma-separated: bf16, fp8, fp8-dense, fp8:tensorwise, mxfp8, ...
    steps: int = 20,  # timed steps per mode
    warmup: int = 5,  # untimed steps first (kernel selection, allocator, compile)
    compile: bool = False,  # torch.compile the model (torchao's fp8 casts fuse only when compiled)
    peak: float = 989e12,  # dense bf16 FLOP/s of one GPU for MFU (H100 / H200 SXM)
    smoke: bool = False,  # tiny shapes on the CPU, fp8 emulated: a test of this script
    out: str = "",  # also write the results as JSON here
):
    "bf16 against fp8 (and other modes) on a preset: tok/s, MFU, peak memory, side by side."
    path = Path(config) if Path(config).is_absolute() or Path(config).exists() else ROOT / config
    cfg = load_config(path, SMOKE if smoke else ())
    if smoke:
        steps, warmup = min(steps, 2), min(warmup, 1)
    device = resolve_device("cpu" if smoke else "auto")
    if device.type != "cuda" and not smoke:
        raise CliError("no CUDA GPU: run with --smoke for the CPU test of this script")
    caps, libs = probe_device(device), probe_libs()
    fpt = flops_per_token(cfg.model, cfg.training.seq_len)
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
    pc = param_counts(cfg.model)
    print(
        f"preset: {path.name}{' (smoke shapes)' if smoke else ''}: {pc['total'] / 1e6:.1f}M params, "
        f"{pc['active'] / 1e6:.1f}M active, "
        f"batch {cfg.training.batch_size} x {cfg.training.seq_len} tokens a step, {fpt / 1e9:.2f} GFLOP/token, "
        f"moe_impl {cfg.model.moe.impl}, optimizer {cfg.optim.name}, {warmup} warmup + {steps} timed steps"
        f"{', compiled' if compile else ''}"
    )
    rows = []
    for spec in [m.strip() for m in modes.split(",") if m.strip()]:
        try:
            r = run_mode(cfg, spec, device, steps, warmup, compile, emulate=smoke)
        except Exception as e:
            r = dict(spec=spec, error=f"{type(e).__name__}: {str(e)[:400]}")
        rows.append(r)
        print(
            f"  {spec}: "
            + (
                f"{r['tok_s']:,.0f} tok/s, loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}, {r['optimizer']}, "
                f"{r['n_converted']} layers converted, kernels {r['kernels']}"
                if "tok_s" in r
                else f"FAILED {r['error']}"
            ),
            flush=True,
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print()
    print(table(rows, fpt, peak))
    if out:
        Path(out).write_text(
            json.dumps(
                dict(
                    device=caps.name,
                    torch=torch.__version__,
                    torchao=ao,
                    preset=str(path),
                    flops_per_token=fpt,
                    peak=peak,
                    rows=rows,
                ),
                indent=1,
                default=str,
            )
        )
    if any("error" in r for r in rows):
        sys.exit(1)
