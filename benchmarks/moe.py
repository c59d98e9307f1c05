"""Forward + backward time of cipher_nb's MoE block against a HF-style expert loop and a dense SwiGLU of the same
active FLOPs per token, side by side in one process, with ratios.

    python benchmarks/moe.py                      # CPU, fp32, about a minute on 2 cores
    python benchmarks/moe.py --device cuda --paths  # a GPU, bf16, every dispatch path, TFLOP/s and peak memory
    OMP_NUM_THREADS=1 python benchmarks/moe.py --shape tiny-cpu-90s --candidates  # the CPU speed candidates
    python benchmarks/moe.py --shape "h100 preset" --profile [--keep-freed]  # where ours - dense goes, by class
    python benchmarks/moe.py --clock wall         # elapsed time: a quiet machine, several threads

On CPU a step's time is the process's CPU time (`time.process_time`), so that other jobs on a shared machine do not
count; with OMP_NUM_THREADS=1 it equals the step's single-thread time. With more threads it also counts the time
OpenMP's workers spin between parallel regions, which weighs most on a step of many small operators: `--clock wall`
times elapsed seconds instead, for a machine with nothing else running. On CUDA it is the device time.
`--keep-freed` (CPU) has glibc's malloc keep freed memory for reuse, as CUDA's caching allocator does: by default
glibc returns every buffer over 32 MB to the system when it is freed, and the next step's buffer of that size pays
a page fault per 4 KB page as it is first written (the MoE's permutation buffers at the h100 preset's shape).

Contenders (all with the same shared experts, and the same loss `(y * g).sum()` on a fixed random `g`):
  ours[path]  cipher_nb.model.moe.MoE; `auto` is the path the config's default picks on this device
  hf-loop     the eager pattern of transformers' Mixtral block: one nn.Module per expert, a Python loop over the
              experts that received tokens, `index_add_` of each expert's gated output
  dense       a SwiGLU of width (top_k + n_shared) * expert_d_ff: the same matmul FLOPs per token, no routing

`--candidates` adds the variants the CPU speed work weighed, each a switch on the module as it stands:
  ours[grouped]+topk        route with `topk` instead of two max passes (`top_indices`)
  ours[grouped]+fused       gate and up as one product over the concatenated weights at any row count
  ours[grouped]+apart       gate and up as two products at any row count
  ours[grouped]+topk+fused  topk and always fused: the block as it was before these candidates
  ours[grouped]+stored      gate and up stored as one [E, 2h, d] weight: one product, no per-step concatenation
  ours[bmm] forced          one batched product, every expert padded to the largest load
  ours+solving              the block of a run's first steps, which also solves its balance shift (`MoE.solving`)
"""

import copy
import ctypes
import dataclasses
import statistics
import time
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from fastcore.script import CliError, call_parse

import cipher_nb.model.moe as moe_mod
from cipher_nb.config.load import ModelConfig
from cipher_nb.model.moe import (
    MOE_IMPLS,
    MoE,
    SwiGLU,
    _Combine,
    _Dispatch,
    _RowGates,
    expert_products,
    resolve_moe_impl,
)

BLOCK_TARGETS = {"h100 preset": 1.25, "tiny-cpu": 1.25, "tiny-cpu-90s": 1.4}  # issue 49: ours / dense at most
# name: (batch, seq, d_model, n_routed, top_k, expert_d_ff, n_shared)
SHAPES = {
    "cpu": {
        "h100 preset": (4, 2048, 512, 32, 4, 128, 2),
        "larger": (4, 2048, 768, 64, 6, 192, 2),
        "tiny-cpu": (16, 256, 128, 32, 2, 128, 1),  # the default cipher-train model's MoE layers
        # the 90-second recipe's MoE layers at its 12 x 64-byte step and width 128, where issue 49 set its target
        # (the preset is width 64 now; this shape stays the target's)
        "tiny-cpu-90s": (12, 64, 128, 8, 2, 128, 1),
        "h100 preset, 128 tokens": (1, 128, 512, 32, 4, 128, 2),
    },  # a short batch: 16 rows per expert
    "cuda": {"h100 preset": (4, 2048, 512, 32, 4, 128, 2), "larger": (8, 4096, 2048, 64, 8, 512, 2)},
}


class HFStyleMoE(nn.Module):
    "Router + a ModuleList of experts, looped over the hit experts with index_add_ (the Mixtral eager pattern)."

    def __init__(self, d, n_routed, top_k, hidden, n_shared):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(d, n_routed, bias=False)
        self.experts = nn.ModuleList(SwiGLU(d, hidden) for _ in range(n_routed))
        self.shared = SwiGLU(d, n_shared * hidden) if n_shared else None

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.gate(x).float().softmax(-1)
        w, sel = probs.topk(self.top_k, -1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        mask = F.one_hot(sel, len(self.experts)).permute(2, 1, 0)  # [E, k, N]
        for e in (mask.sum((1, 2)) > 0).nonzero().flatten().tolist():
            slot, tok = torch.where(mask[e])
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(shape)


def copy_weights(hf: HFStyleMoE, moe: MoE):
    "Give the HF-style block the MoE's weights (to check both compute the same function)."
    with torch.no_grad():
        hf.gate.weight.copy_(moe.router.weight)
        for e, ex in enumerate(hf.experts):
            ex.w_gate.weight.copy_(moe.experts.w_gate[e])
            ex.w_up.weight.copy_(moe.experts.w_up[e])
            ex.w_down.weight.copy_(moe.experts.w_down[e])
        if hf.shared is not None:
            hf.shared.load_state_dict(moe.shared.state_dict())


def check_same_function(device, dtype):
    "The HF-style baseline and every path of ours agree on a small case (so the race is between equals)."
    torch.manual_seed(0)
    cfg = ModelConfig(
        d_model=64, init_std=0.1, moe=dict(n_routed=8, top_k=2, expert_d_ff=32, n_shared=1, router_score="softmax")
    )  # Mixtral's
    moe = MoE(cfg).to(device)
    hf = HFStyleMoE(64, 8, 2, 32, 1).to(device)
    copy_weights(hf, moe)
    moe, hf = moe.to(dtype), hf.to(dtype)
    x = torch.randn(2, 16, 64, device=device, dtype=dtype)
    ref = hf(x).float()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for impl in MOE_IMPLS:
        moe.cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, impl=impl))
        err = ((moe(x)[0].float() - ref).abs().max() / ref.abs().max()).item()
        assert err < tol, f"ours[{impl}] differs from the HF-style block: relative error {err:.1e}"
        for topk, fused in VARIANTS.values():
            with variant(topk, fused):
                err = ((moe(x)[0].float() - ref).abs().max() / ref.abs().max()).item()
            assert err < tol, f"ours[{impl}] topk={topk} fused={fused}: relative error {err:.1e}"
    err = ((stored(moe)(x)[0].float() - ref).abs().max() / ref.abs().max()).item()
    assert err < tol, f"ours[grouped]+stored: relative error {err:.1e}"


@contextmanager
def variant(topk: bool = False, fused: bool | None = None):
    "Run the block with `topk` routing, and the gate/up product fused always (True), never (False) or by the rule."
    saved = moe_mod.top_indices, moe_mod.FUSED_GATE_UP_ROWS
    if topk:
        moe_mod.top_indices = lambda s, k: s.topk(k, dim=-1).indices
    if fused is not None:
        moe_mod.FUSED_GATE_UP_ROWS = 0 if fused else 2**62
    try:
        yield
    finally:
        moe_mod.top_indices, moe_mod.FUSED_GATE_UP_ROWS = saved


VARIANTS = {  # name suffix: (topk, fused)
    "+topk": (True, None),
    "+fused": (False, True),
    "+apart": (False, False),
    "+topk+fused": (True, True),
}


class StoredGateUp(nn.Module):
    "The routed experts with `w_gate` and `w_up` stored as one [E, 2h, d] weight (the grouped path only)."

    def __init__(self, experts):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.cat([experts.w_gate.detach(), experts.w_up.detach()], 1))
        self.w_down = nn.Parameter(experts.w_down.detach().clone())

    def forward(self, x, idx, gates, impl="grouped", counts=None):
        p, mm = expert_products(idx, self.w_down.shape[0], "grouped", counts)
        by_gather = x.device.type != "cpu"
        g = _RowGates.apply(gates.flatten().to(x.dtype), p)[:, None]
        a, b = mm(_Dispatch.apply(x, p, by_gather), self.w_gate_up).chunk(2, -1)
        return _Combine.apply(mm(F.silu(a) * b * g, self.w_down), p, by_gather)


def stored(moe: MoE) -> MoE:
    "A copy of `moe` on the grouped path whose routed experts are `StoredGateUp` (the same weights)."
    m = copy.deepcopy(moe)
    m.cfg = dataclasses.replace(m.cfg, moe=dataclasses.replace(m.cfg.moe, impl="grouped"))
    m.experts = StoredGateUp(m.experts)
    return m


def candidates(cfg, device, dtype):
    "The CPU speed candidates: name -> (module, forward)."
    m = stored(MoE(cfg).to(device, dtype))
    out = {"ours[grouped]+stored": (m, lambda x, m=m: _with_aux(m(x)))}
    m = MoE(cfg).to(device, dtype)
    m.solving = True  # as in the first steps of a long run (`set_solving`)
    out["ours+solving"] = (m, lambda x, m=m: _with_aux(m(x)))
    for suffix, (topk, fused) in VARIANTS.items():
        m = MoE(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, impl="grouped"))).to(device, dtype)

        def fwd(x, m=m, topk=topk, fused=fused):
            with variant(topk, fused):
                return _with_aux(m(x))

        out["ours[grouped]" + suffix] = (m, fwd)
    return out


def contenders(shape, device, dtype, paths, compile=False, cands=False):
    "name -> (module, forward returning the tensor the loss is taken on)."
    B, T, d, E, k, h, s = shape
    cfg = ModelConfig(
        d_model=d, moe=dict(n_routed=E, top_k=k, expert_d_ff=h, n_shared=s, router_score="softmax")
    )  # as the HF-style block
    auto = resolve_moe_impl("auto", device, dtype, d, h)
    out = {}
    impls = ["auto"] + list(MOE_IMPLS) if paths else ["auto", "bmm"] if cands else ["auto"]
    for impl in impls:
        m = MoE(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, impl=impl))).to(device, dtype)
        out[f"ours[{auto}]" if impl == "auto" else f"ours[{impl}] forced"] = (m, lambda x, m=m: _with_aux(m(x)))
    if cands:
        out.update(candidates(cfg, device, dtype))
    hf = HFStyleMoE(d, E, k, h, s).to(device, dtype)
    for p in hf.parameters():
        nn.init.normal_(p, std=cfg.init_std)
    out["hf-loop"] = (hf, hf)
    dense = SwiGLU(d, (k + s) * h).to(device, dtype)
    out["dense"] = (dense, dense)
    if compile:
        m = MoE(cfg).to(device, dtype)
        mc = torch.compile(m)
        out[f"ours[{auto}]+compile"] = (m, lambda x: _with_aux(mc(x)))
        out["dense+compile"] = (dense, torch.compile(dense))
    return out


def _with_aux(res):
    y, aux, _ = res
    return y, sum(aux.values())


def flops(shape, dense: bool) -> float:
    "Matmul FLOPs of forward + backward (6 per multiply-add-weight per token); the router counts for the MoEs."
    B, T, d, E, k, h, s = shape
    per_tok = 3 * d * (k + s) * h + (0 if dense else d * E)
    return 6 * B * T * per_tok


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    "Have glibc's malloc keep freed memory (no mmap, no trim), so a fresh buffer reuses pages; False off glibc."
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**30))
    except (OSError, AttributeError):
        return False


def timeit(fn, device, clock: str = "cpu"):
    "Seconds `fn` takes: device time on CUDA; on CPU this process's CPU time (`clock` 'cpu') or elapsed ('wall')."
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    now = time.process_time if clock == "cpu" else time.perf_counter  # CPU seconds: other jobs do not count
    t0 = now()
    fn()
    return now() - t0


def bench_shape(
    name, shape, device, dtype, paths, reps, warmup, compile=False, profile=False, cands=False, clock="cpu"
):
    torch.manual_seed(0)
    B, T, d = shape[:3]
    x = torch.randn(B, T, d, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(B, T, d, device=device, dtype=dtype)
    cs = contenders(shape, device, dtype, paths, compile, cands)

    def step(mod, fwd):
        r = fwd(x)
        y, extra = r if isinstance(r, tuple) else (r, 0.0)
        ((y * g).float().sum() + extra).backward()
        mod.zero_grad(set_to_none=True)
        x.grad = None

    times, mem = {n: [] for n in cs}, {}
    for n, (mod, fwd) in cs.items():
        for _ in range(warmup):
            step(mod, fwd)
    names = list(cs)
    for r in range(reps):  # round-robin, so drifting machine load hits every contender alike
        for n in names[r % len(names) :] + names[: r % len(names)]:  # each round starts with the next contender
            mod, fwd = cs[n]
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times[n].append(timeit(lambda: step(mod, fwd), device, clock))
            if device.type == "cuda":
                mem[n] = torch.cuda.max_memory_allocated(device) / 2**30
    med = {n: statistics.median(t) for n, t in times.items()}
    ours = next(n for n in cs if n.startswith("ours[") and not n.endswith("forced"))
    B, T, d, E, k, h, s = shape
    print(
        f"\n{name}: tokens {B}x{T}, d_model {d}, {E} experts top-{k}, expert_d_ff {h}, {s} shared "
        f"({device.type}, {str(dtype).replace('torch.', '')}, median of {reps})"
    )
    head = f"{'contender':<26}{'ms fwd+bwd':>12}{'x ours':>9}{'TFLOP/s':>9}" + (f"{'peak GB':>9}" if mem else "")
    print(head)
    print("-" * len(head))
    for n, t in med.items():
        row = f"{n:<26}{t * 1e3:>12.2f}{t / med[ours]:>9.2f}{flops(shape, n == 'dense') / t / 1e12:>9.3f}"
        print(row + (f"{mem[n]:>9.2f}" if mem else ""))
    print(
        f"ours vs hf-loop: {med['hf-loop'] / med[ours]:.1f}x faster; "
        f"ours / dense: {med[ours] / med['dense']:.2f}x"
        + (f" (issue 49's target <= {BLOCK_TARGETS[name]}x)" if name in BLOCK_TARGETS else "")
    )
    if cands:
        time_routing(B * T, E, k, device, reps)
    if profile:
        profile_step({"ours": lambda: step(*cs[ours]), "dense": lambda: step(*cs["dense"])}, device, reps)
    return med


def time_routing(n, E, k, device, reps):
    "The choice alone, on [n, E] scores: `top_indices` (two max passes for k <= 2) against `topk`."
    s = torch.rand(n, E, device=device)
    t = {}
    for name, fn in (("top_indices", lambda: moe_mod.top_indices(s, k)), ("topk", lambda: s.topk(k, -1).indices)):
        fn()
        t[name] = statistics.median(timeit(lambda: [fn() for _ in range(20)], device) / 20 for _ in range(reps))
    print(
        f"choice of top-{k} over [{n}, {E}] scores: top_indices {t['top_indices'] * 1e6:.0f} us, "
        f"topk {t['topk'] * 1e6:.0f} us ({t['topk'] / t['top_indices']:.1f}x)"
    )


OP_CLASSES = {  # the classes of `--profile`'s split of ours - dense; any other aten op is "other aten"
    "matmul": ("aten::mm", "aten::bmm", "aten::addmm", "aten::_grouped_mm"),
    "elementwise": ("aten::mul", "aten::mul_", "aten::silu", "aten::silu_backward", "aten::add", "aten::add_",
                    "aten::sub", "aten::div", "aten::sigmoid", "aten::sigmoid_backward", "aten::pow", "aten::xlogy"),
    "gather / scatter": ("aten::index_select", "aten::scatter_add_", "aten::index_add_", "aten::gather",
                         "aten::scatter", "aten::index", "aten::_index_put_impl_", "aten::cat"),
    "routing": ("aten::max", "aten::sort", "aten::topk", "aten::_softmax", "aten::logsumexp", "aten::cumsum"),
}  # fmt: skip


def op_class(key: str) -> str:
    "The class of a profiler row: one of OP_CLASSES, 'other aten', or 'autograd / python' (the rest)."
    return next((c for c, ops in OP_CLASSES.items() if key in ops), "other aten" if key.startswith("aten::") else
                "autograd / python")  # fmt: skip


def profile_step(fns: dict, device, steps: int):
    "Where ours spends a forward + backward (its top operators), and where its time beyond dense's goes, by class."
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    by = {}
    for name, fn in fns.items():
        with profile(activities=acts) as prof:
            for _ in range(steps):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        rows = prof.key_averages()
        if name == "ours":
            print(rows.table(sort_by=key, row_limit=15, max_name_column_width=40))
        by[name] = {}
        for r in rows:
            by[name][op_class(r.key)] = by[name].get(op_class(r.key), 0.0) + getattr(r, key) / steps / 1e3
    gap = sum(by["ours"].values()) - sum(by["dense"].values())
    print(f"where ours - dense goes: ms of self time per step (mean of {steps} profiled steps each), gap {gap:.2f} ms")
    print(f"{'class':<20}{'ours':>10}{'dense':>10}{'gap':>10}{'share':>8}")
    for c in [*OP_CLASSES, "other aten", "autograd / python"]:
        o, d = by["ours"].get(c, 0.0), by["dense"].get(c, 0.0)
        print(f"{c:<20}{o:>10.2f}{d:>10.2f}{o - d:>10.2f}{(o - d) / gap if gap else 0.0:>8.0%}")


@call_parse
def main(
    device: str = "cpu",  # cpu | cuda (bf16, more repetitions, TFLOP/s and peak memory)
    paths: bool = False,  # also time every forced dispatch path of ours (grouped, bmm, loop)
    reps: int = 0,  # timed repetitions per contender; 0 = 3 on CPU, 20 on CUDA
    shape: str = "",  # only this shape (a name in SHAPES, e.g. 'h100 preset'); empty = all of the device's
    compile: bool = False,  # also time torch.compile'd versions of ours and of the dense FFN
    profile: bool = False,  # print ours' top operators and where its time beyond dense's goes (--reps steps each)
    candidates: bool = False,  # also time the CPU speed candidates (see the module docstring)
    keep_freed: bool = False,  # CPU: glibc's malloc keeps freed memory for reuse, as CUDA's caching allocator does
    clock: str = "cpu",  # CPU: cpu (this process's CPU time) | wall (elapsed time, for a machine with nothing else)
):
    "Print the MoE speed table(s)."
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    reps = reps or (20 if dev.type == "cuda" else 3)
    warmup = 3 if dev.type == "cuda" else 1
    if clock not in ("cpu", "wall"):
        raise CliError(f"moe.py: --clock {clock} unknown; use cpu or wall")
    if keep_freed and not keep_freed_memory():
        raise SystemExit("--keep-freed needs glibc's malloc (mallopt), which this process does not have")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
        + (f", {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else "")
        + (", glibc keeps freed memory (--keep-freed)" if keep_freed else "")
        + (", elapsed time (--clock wall)" if clock == "wall" and dev.type == "cpu" else "")
    )
    check_same_function(dev, dtype)
    for name, shp in SHAPES[dev.type].items():
        if shape and name != shape:
            continue
        bench_shape(name, shp, dev, dtype, paths, reps, warmup, compile, profile, candidates, clock)
