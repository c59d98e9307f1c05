"""torch.compile of a transformer block holding an MoE (CPU, float32, the tiny-cpu preset's widths): the compiled
block equals the eager one forward and backward, breaks its graph only where documented in nbs/05_model_moe.ipynb, and
does not recompile on a second call with the same shapes."""

import copy
import dataclasses

import pytest
import torch

from cipher_nb.config.load import ModelConfig
from cipher_nb.model.lm import Block, rope_frequencies, rope_tables
from cipher_nb.model.moe import MoE, moe_kernels_used

CFG = ModelConfig()  # the tiny-cpu preset
B, T = 2, 32  # a short batch keeps the compile cheap; the shapes are those of the preset's layers


def _inputs(seed=0):
    torch.manual_seed(seed)
    x = torch.randn(B, T, CFG.d_model)
    inv, scale = rope_frequencies(CFG.attention.head_dim)
    cos, sin = rope_tables(torch.arange(T)[None], inv, scale)
    return x, cos, sin


def _block(impl: str):
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, impl=impl, z_loss_weight=1e-3))
    torch.manual_seed(1)
    blk = Block(cfg, moe=True).train()
    with torch.no_grad():
        blk.ffn.expert_bias.copy_(torch.linspace(-0.02, 0.02, cfg.moe.n_routed))  # uneven loads
    return blk


def _fwd_bwd(blk, x, cos, sin, g):
    x = x.clone().requires_grad_()
    y, aux, stats = blk(x, cos, sin)
    ((y * g).sum() + sum(aux.values())).backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in blk.named_parameters()}
    blk.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads, stats["expert_counts"]


@pytest.mark.parametrize("impl", ["auto", "bmm"])
def test_compiled_block_equals_eager(impl):
    torch._dynamo.reset()
    eager = _block(impl)
    comp = copy.deepcopy(eager)
    fn = torch.compile(comp, backend="inductor" if impl == "auto" else "aot_eager")  # bmm: the graph, not codegen
    x, cos, sin = _inputs()
    g = torch.randn_like(x)
    ye, xge, ge, ce = _fwd_bwd(eager, x, cos, sin, g)
    yc, xgc, gc, cc = _fwd_bwd(fn, x, cos, sin, g)
    torch.testing.assert_close(yc, ye, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(xgc, xge, rtol=1e-4, atol=1e-5)
    for n in ge:
        torch.testing.assert_close(gc[n], ge[n], rtol=1e-4, atol=1e-5, msg=n)
    torch.testing.assert_close(cc, ce)
    assert comp.ffn.kernel == ("grouped" if impl == "auto" else "bmm")
    assert moe_kernels_used(comp) == comp.ffn.kernel
    # the load count ran eagerly, once per forward, as in the eager block
    torch.testing.assert_close(comp.ffn.pending_load, eager.ffn.pending_load)


def test_graph_breaks_as_documented():
    "Eval: one graph. Training: the load count runs eagerly, one break in the MoE (two in the Block that inlines it)."
    x, cos, sin = _inputs()
    blk = _block("auto")
    for train, graphs, breaks in ((False, 1, 0), (True, 3, 2)):
        torch._dynamo.reset()
        ex = torch._dynamo.explain(blk.train(train))(x, cos, sin)
        assert (ex.graph_count, ex.graph_break_count) == (graphs, breaks), (train, ex.break_reasons)
        assert all("_add_load" in str(r.reason) for r in ex.break_reasons)
    torch._dynamo.reset()
    ex = torch._dynamo.explain(MoE(CFG).train())(x)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0)  # the count is the block's last call


def test_no_recompile_on_second_call():
    torch._dynamo.reset()
    blk = _block("auto")
    fn = torch.compile(blk, backend="aot_eager")
    x, cos, sin = _inputs()
    g = torch.randn_like(x)
    _fwd_bwd(fn, x, cos, sin, g)
    with torch._dynamo.config.patch(error_on_recompile=True):
        x2, _, _ = _inputs(seed=3)  # new values, same shapes: new routing, no new graph
        _fwd_bwd(fn, x2, cos, sin, g)
        blk.ffn.update_bias()
        _fwd_bwd(fn, x, cos, sin, g)


def test_eval_block_compiles_to_one_graph():
    "Without the training-only load count, the whole MoE traces as one graph (fullgraph=True would fail otherwise)."
    torch._dynamo.reset()
    m = MoE(CFG).eval()
    x, _, _ = _inputs()
    y = torch.compile(m, backend="aot_eager", fullgraph=True)(x)[0]
    torch.testing.assert_close(y, m(x)[0], rtol=1e-5, atol=1e-6)


def test_load_counted_once_with_checkpointing():
    "Checkpointing around a compiled MoE, or inside a compiled function, recomputes the forward but counts it once."
    from torch.utils.checkpoint import checkpoint

    torch._dynamo.reset()
    m = MoE(CFG).train()
    x = torch.randn(2, 16, CFG.d_model, requires_grad=True)
    mc = torch.compile(m, backend="aot_eager")

    def inner(x):
        return checkpoint(m, x, use_reentrant=False)

    runs = {
        "checkpoint(compiled), non-reentrant": lambda: checkpoint(mc, x, use_reentrant=False),
        "checkpoint(compiled), reentrant": lambda: checkpoint(mc, x, use_reentrant=True),
        "compiled(checkpoint)": lambda: torch.compile(inner, backend="aot_eager")(x),
    }
    for name, run in runs.items():
        m.take_load()
        y, _, stats = run()
        y.sum().backward()
        assert torch.equal(m.take_load(), stats["expert_counts"].long()), name
