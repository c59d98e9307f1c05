"""Shared-projection experts (`model.moe.kind = 'shared_projection'`, nbs/05_model_moe.ipynb): every path against a
float64 loop that materialises each expert's full matrices (forward and backward), dropless under a skewed load, the
sizing formulas against a hand count and the real module, a whole model that trains, and a compiled block."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from cipher_nb.config.load import ModelConfig
from cipher_nb.config.sizing import flops_per_token, param_counts
from cipher_nb.model.lm import Block, CipherModel, rope_frequencies, rope_tables
from cipher_nb.model.moe import MoE, SharedProjectionExperts, moe_kernels_used

SP = dict(kind="shared_projection", n_routed=6, n_shared=1, top_k=2, expert_d_ff=8, shared_inter=24, expert_rank=8)
CFG = ModelConfig(d_model=16, init_std=0.3, moe=dict(SP, router_score="softmax"))


def _cfg(**moe):
    return dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, **moe))


def _swiglu64(x, wg, wu, wd):
    return wd @ (F.silu(wg @ x) * (wu @ x))


def _reference(x, m: MoE):
    "float64, token by token: route on score + bias, each chosen expert as a SwiGLU of its full materialised matrices."
    c, P = m.cfg.moe, {n: p.double() for n, p in m.named_parameters()}
    full = [
        [P[f"experts.w_{n}.weight"] + P[f"experts.{n}_b"][e] @ P[f"experts.{n}_a"][e] for n in ("gate", "up", "down")]
        for e in range(c.n_routed)
    ]
    out = []
    for xt in x.double().reshape(-1, m.cfg.d_model):
        logit = P["router.weight"] @ xt
        s = logit.softmax(-1) if c.router_score == "softmax" else logit.sigmoid()
        choice = s + m.expert_bias.double() if c.bias_balance else s
        chosen = sorted(range(c.n_routed), key=lambda e: -choice[e].item())[: c.top_k]
        g = torch.stack([s[e] for e in chosen])
        g = c.route_scale * (g / g.sum() if c.router_renorm else g)
        y = sum(g[j] * _swiglu64(xt, *full[e]) for j, e in enumerate(chosen))
        if c.n_shared:
            y = y + _swiglu64(xt, *(P[f"shared.w_{n}.weight"] for n in ("gate", "up", "down")))
        out.append(y)
    return torch.stack(out).view(x.shape)


def _check(cfg, x, bias=None, dtype=torch.float32, tol=1e-5):
    torch.manual_seed(0)
    m = MoE(cfg).to(dtype)
    if bias is not None:
        m.expert_bias.copy_(bias)
    x = x.detach().clone().to(dtype).requires_grad_()
    y, _, stats = m(x)
    gy = torch.randn(y.shape, dtype=torch.float64)
    (y * gy.to(dtype)).sum().backward()
    params = dict(m.named_parameters())
    for p in params.values():  # the reference reads the same parameters; keep the block's gradients apart
        p.grad, p._block_grad = None, p.grad
    x64 = x.detach().double().requires_grad_()
    ref = _reference(x64, m)
    (ref * gy).sum().backward()

    def rel(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()

    errs = {"y": rel(y.detach(), ref.detach()), "x.grad": rel(x.grad, x64.grad)}
    errs |= {n: rel(p._block_grad, p.grad) for n, p in params.items() if n != "router.weight"}
    assert max(errs.values()) < tol, errs
    return m, stats


@pytest.mark.parametrize("impl", ["grouped", "bmm", "loop"])
@pytest.mark.parametrize(
    "moe", [{}, dict(top_k=1, router_renorm=False, n_shared=0), dict(router_score="sigmoid", route_scale=2.5)]
)
def test_matches_float64_reference(impl, moe):
    m, _ = _check(_cfg(impl=impl, **moe), torch.randn(3, 5, CFG.d_model))
    assert m.kernel == impl and moe_kernels_used(m) == impl


def test_float64_block_is_exact():
    _check(_cfg(impl="bmm"), torch.randn(2, 4, CFG.d_model), dtype=torch.float64, tol=1e-12)


@pytest.mark.parametrize("impl", ["grouped", "bmm"])
def test_dropless_under_skewed_load(impl):
    "A bias sends nearly every token to experts 0 and 1 (and none to 5): every token still gets both its choices."
    bias = torch.tensor([5.0, 5.0, 0, 0, 0, -9.0])
    m, stats = _check(_cfg(impl=impl, top_k=2), torch.randn(4, 8, CFG.d_model), bias=bias)
    counts = stats["expert_counts"]
    assert counts.sum().item() == 4 * 8 * 2 and counts[:2].tolist() == [32.0, 32.0] and counts[5].item() == 0
    assert m.experts.down_b.grad[5].abs().sum().item() == 0.0  # an expert that got no token gets no gradient


def test_sizing_against_hand_count_and_module():
    "d=16, S=24, r=8, E=6, k=2: shared projection 3*16*24 = 1152, each expert 3*8*(16+24) = 960."
    c = dataclasses.replace(_cfg(), n_layers=2, vocab=32)
    attn = c.d_model * c.attention.head_dim * (2 * c.attention.n_heads + 2 * c.attention.n_kv_heads)
    dense = attn + 2 * 16 + 3 * 16 * c.dense_d_ff  # layer 0 (n_dense_layers = 1)
    fixed = attn + 2 * 16 + 16 * 6 + 3 * 16 * 8 + 1152  # router, one shared expert of width 8, shared projection
    moe_total, moe_active = fixed + 6 * 960, fixed + 2 * 960
    pc = param_counts(c)
    assert pc["non_embedding"] == dense + moe_total + 16
    assert pc["active_non_embedding"] == dense + moe_active + 16
    assert pc["total"] == pc["non_embedding"] + 32 * 16
    assert sum(p.numel() for p in CipherModel(c).parameters()) == pc["total"]
    assert sum(p.numel() for p in MoE(c).experts.parameters()) == 1152 + 6 * 960
    attn_flops = 12 * 2 * c.attention.n_heads * c.attention.head_dim * 7
    assert flops_per_token(c, 7) == 6 * (dense + moe_active + 16 + 32 * 16) + attn_flops


def test_model_trains():
    "A 2-layer byte model with shared-projection experts fits a fixed batch: the loss falls."
    c = ModelConfig(d_model=32, n_layers=2, moe=dict(SP, n_routed=4, shared_inter=32), loss_chunk=0)
    torch.manual_seed(0)
    model = CipherModel(c).train()
    assert isinstance(model.layers[1].ffn.experts, SharedProjectionExperts)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 256, (4, 33))
    losses = []
    for _ in range(25):
        out = model(ids[:, :-1], labels=ids[:, 1:])
        (out.loss + sum(out.aux.values())).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    assert moe_kernels_used(model) == "grouped"


def test_compiled_block_equals_eager():
    "torch.compile (aot_eager: the graph, cheap on CPU) of a block with shared-projection experts: equal to eager."
    torch._dynamo.reset()
    c = ModelConfig(moe=dict(kind="shared_projection", shared_inter=64, expert_rank=16, n_routed=8))
    B, T = 2, 16
    torch.manual_seed(1)
    eager = Block(c, moe=True).train()
    with torch.no_grad():
        eager.ffn.expert_bias.copy_(torch.linspace(-0.02, 0.02, 8))
    comp = copy.deepcopy(eager)
    fn = torch.compile(comp, backend="aot_eager")
    x = torch.randn(B, T, c.d_model)
    cos, sin = rope_tables(torch.arange(T)[None], *rope_frequencies(c.attention.head_dim))
    g = torch.randn_like(x)
    res = []
    for blk in (eager, fn):
        xi = x.clone().requires_grad_()
        y, aux, stats = blk(xi, cos, sin)
        ((y * g).sum() + sum(aux.values())).backward()
        grads = {n.removeprefix("_orig_mod."): p.grad for n, p in blk.named_parameters()}
        res.append((y.detach(), xi.grad, grads, stats["expert_counts"]))
    (ye, xe, ge, ce), (yc, xc, gc, cc) = res
    torch.testing.assert_close(yc, ye, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(xc, xe, rtol=1e-4, atol=1e-5)
    for n in ge:
        torch.testing.assert_close(gc[n], ge[n], rtol=1e-4, atol=1e-5, msg=n)
    assert comp.ffn.kernel == "grouped"
    torch.testing.assert_close(cc, ce)  # the counts for balancing, an output of the graph


@pytest.mark.parametrize("preset", ["tiny-cpu-90s", "tiny-cpu"])
def test_bench_contenders_match_the_routed_experts(preset):
    "benchmarks/spmoe.py sizes its shared projections from the base config: parameters, then active FLOPs, within 1%."
    import importlib.util

    from conftest import ROOT as root

    from cipher_nb.config.load import load_config

    spec = importlib.util.spec_from_file_location("spmoe", root / "benchmarks/spmoe.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    base = load_config(str(root / f"examples/configs/{preset}.yaml"))
    ref = bench.moe_sizes(base)
    for name, i in (("sp-params", 0), ("sp-flops", 1)):
        cfg = load_config(str(root / f"examples/configs/{preset}.yaml"), bench.contenders(base)[name])
        assert cfg.model.moe.kind == "shared_projection"
        assert sum(p.numel() for p in MoE(cfg.model).experts.parameters()) == bench.moe_sizes(cfg)[0]
        assert abs(bench.moe_sizes(cfg)[i] / ref[i] - 1) < 0.01, (name, bench.moe_sizes(cfg), ref)
