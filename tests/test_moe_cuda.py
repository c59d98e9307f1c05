"""The MoE block's CUDA paths against a float64 per-token reference, and the no-host-sync promise (skipped without
a GPU)."""

import dataclasses

import pytest
import torch

from cipher_nb.config.load import ModelConfig
from cipher_nb.model.moe import MOE_IMPLS, MoE, resolve_moe_impl

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEV = "cuda"


def _swiglu(x, wg, wu, wd):
    a, b = wg @ x, wu @ x
    return wd @ (a * torch.sigmoid(a) * b)


def reference(x, m: MoE):
    "float64, one token at a time: route on score + bias, gate with the unbiased score, add the shared experts."
    c, P = m.cfg, {n: p.detach().double().cpu() for n, p in m.named_parameters()}
    bias = m.expert_bias.double().cpu()
    out = []
    for xt in x.detach().double().cpu().reshape(-1, c.d_model):
        logit = P["router.weight"] @ xt
        s = logit.softmax(-1) if c.moe.router_score == "softmax" else logit.sigmoid()
        chosen = (s + bias).topk(c.moe.top_k).indices.tolist()
        g = s[chosen] / (s[chosen].sum() if c.moe.router_renorm else 1) * c.moe.route_scale
        y = sum(
            g[j] * _swiglu(xt, P["experts.w_gate"][e], P["experts.w_up"][e], P["experts.w_down"][e])
            for j, e in enumerate(chosen)
        )
        if c.moe.n_shared:
            y = y + _swiglu(xt, P["shared.w_gate.weight"], P["shared.w_up.weight"], P["shared.w_down.weight"])
        out.append(y)
    return torch.stack(out).view(x.shape)


BASE = ModelConfig(d_model=64, init_std=0.2, moe=dict(n_routed=8, n_shared=1, top_k=2, expert_d_ff=32))


@cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("impl", MOE_IMPLS)
def test_paths_match_reference(impl, dtype, tol):
    torch.manual_seed(0)
    m = MoE(dataclasses.replace(BASE, moe=dataclasses.replace(BASE.moe, impl=impl))).to(DEV, dtype)
    m.expert_bias[[0, 7]] = -9.0  # two experts receive nothing
    x = torch.randn(3, 17, BASE.d_model, device=DEV, dtype=dtype, requires_grad=True)
    y, aux, stats = m(x)
    y.sum().backward()  # the zero-stride upstream gradient
    ref = reference(x, m)
    err = ((y.double().cpu() - ref).abs().max() / ref.abs().max()).item()
    assert err < tol, f"{impl} {dtype}: relative error {err:.1e}"
    assert stats["expert_counts"][[0, 7]].sum().item() == 0
    assert m.experts.w_down.grad[[0, 7]].abs().sum().item() == 0
    assert torch.isfinite(x.grad).all()


@cuda
def test_paths_agree_on_gradients():
    torch.manual_seed(0)
    x = torch.randn(4, 64, BASE.d_model, device=DEV)
    g = torch.randn_like(x)
    grads = {}
    for impl in MOE_IMPLS:
        torch.manual_seed(1)
        m = MoE(dataclasses.replace(BASE, moe=dataclasses.replace(BASE.moe, impl=impl))).to(DEV)
        xi = x.clone().requires_grad_()
        y, aux, _ = m(xi)
        ((y * g).sum() + sum(aux.values())).backward()
        grads[impl] = [xi.grad] + [p.grad for p in m.parameters()]
    for impl in ("grouped", "bmm"):
        for a, b in zip(grads[impl], grads["loop"]):
            assert ((a - b).abs().max() / b.abs().max()).item() < 1e-4, impl


@cuda
def test_grouped_forward_backward_never_syncs():
    torch.manual_seed(0)
    m = (
        MoE(
            dataclasses.replace(
                BASE, moe=dataclasses.replace(BASE.moe, impl="grouped", n_pop_a=4, balance_loss_weight=1e-3)
            )
        )
        .to(DEV, torch.bfloat16)
        .train()
    )
    x = torch.randn(2, 128, BASE.d_model, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    m(x)  # warm up (lazy initialisation may sync once)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y, aux, stats = m(x)
        ((y.float() ** 2).mean() + sum(aux.values())).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@cuda
def test_auto_picks_grouped_on_hopper_bf16():
    major, _ = torch.cuda.get_device_capability()
    want = "grouped" if major >= 9 else "bmm"
    assert resolve_moe_impl("auto", DEV, torch.bfloat16, 512, 128) == want
    assert resolve_moe_impl("auto", DEV, torch.float32, 512, 128) == "bmm"


@cuda
@pytest.mark.parametrize("impl", ["auto", "bmm"])
def test_compiled_block_matches_eager_bf16(impl):
    "torch.compile of the block in bf16: the same output and gradients as eager, one graph in evaluation."
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = dataclasses.replace(BASE, moe=dataclasses.replace(BASE.moe, impl=impl))
    m = MoE(cfg).to(DEV, torch.bfloat16).train()
    x = torch.randn(2, 128, BASE.d_model, device=DEV, dtype=torch.bfloat16)
    grads = []
    for fn in (m, torch.compile(m)):
        xi = x.clone().requires_grad_()
        y, aux, _ = fn(xi)
        ((y.float() ** 2).mean() + sum(aux.values())).backward()
        grads.append((y.detach().float(), xi.grad.float(), m.experts.w_gate.grad.float()))
        m.zero_grad(set_to_none=True)
    for a, b in zip(*grads):
        assert ((a - b).abs().max() / b.abs().max()).item() < 3e-2
    torch._dynamo.reset()
    ex = torch._dynamo.explain(m.eval())(x)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
