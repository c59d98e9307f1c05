"""torch.compile of a transformer block holding an MoE (CPU, float32, the tiny-cpu preset's widths): the compiled
block equals the eager one forward and backward, compiles to one graph with no break in training as in evaluation, and
does not recompile after its first call with the same shapes, not even when an expert gets no token; so does the block
of every compiled token-level preset at CPU-sized widths, with or without activation checkpointing. The byte preset's
segment count, which changes with the text, is a marked dynamic dimension of its main blocks: new counts recompile
nothing, break nothing and give the eager losses. The counts for
balancing leave the graph as an output: a checkpointed forward's recomputation hands none back. The kernels the layers
took are noted by the block before its (checkpointed) forward, so the compiled forward holds no side effect."""

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import yaml
from conftest import ROOT
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from cipher_nb.config.load import ModelConfig, load_config
from cipher_nb.model.lm import Block, CipherModel, rope_frequencies, rope_tables
from cipher_nb.model.moe import MoE, moe_kernels_used, update_moe_biases
from cipher_nb.optim.parallel import AC_MODES, apply_ac, apply_compile, compile_count, kernels_in_use
from cipher_nb.train.builder import MoEBalancing

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
    return y.detach(), x.grad, grads, stats.get("expert_counts")  # None for a dense block


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


def _stack(blk):
    "`blk` as the one block of a model, so `apply_ac` and `kernels_in_use` treat it as the trainer's."
    model = nn.Module()
    model.layers = nn.ModuleList([blk])
    return model


@pytest.mark.parametrize("ac,backend", [("selective", "inductor"), ("full", "aot_eager")])  # full: the graph alone
def test_checkpointed_compiled_block_equals_eager(ac, backend):
    """Checkpointed, then compiled, as `parallelize` does: one graph and the eager block's outputs, gradients and
    counts; the kernels noted as the eager block notes them; the balancing callback counts each token once."""
    torch._dynamo.reset()
    eager = _block("auto")
    comp = copy.deepcopy(eager)
    model = apply_ac(_stack(comp), ac)
    comp.compile(backend=backend, dynamic=False)
    graphs = compile_count()
    x, cos, sin = _inputs()
    g = torch.randn_like(x)
    ye, xge, ge, ce = _fwd_bwd(eager, x, cos, sin, g)
    balance = MoEBalancing()
    xc = x.clone().requires_grad_()
    yc, aux, stats = comp(xc, cos, sin)
    balance.after_forward(None, SimpleNamespace(stats=stats))  # as the trainer hands it the step's stats
    ((yc * g).sum() + sum(aux.values())).backward()  # the backward recomputes the forward, counts included
    torch.testing.assert_close(yc.detach(), ye, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(xc.grad, xge, rtol=1e-4, atol=1e-5)
    for n, p in comp.named_parameters():
        torch.testing.assert_close(p.grad, ge[n.removeprefix("_orig_mod.")], rtol=1e-4, atol=1e-5, msg=n)
    assert torch.equal(balance.load["expert_counts"], ce.long()) and ce.sum() == B * T * CFG.moe.top_k
    want = {"compiled": ["layers.0"], "activation_checkpoint": ac, "attention": "sdpa", "moe": "grouped"}
    assert kernels_in_use(model) == want
    assert compile_count() == graphs + 1  # a block that ran eagerly (a refused side effect) adds none


def test_compiled_step_has_no_graph_breaks():
    "The Block (and the MoE alone) in training, solving or not, and in evaluation: one graph, no break, no reason."
    x, cos, sin = _inputs()
    blk = _block("auto")
    for train in (True, False):
        torch._dynamo.reset()
        ex = torch._dynamo.explain(blk.train(train))(x, cos, sin)
        assert (ex.graph_count, ex.graph_break_count, ex.break_reasons) == (1, 0, []), train
        torch._dynamo.reset()
        ex = torch._dynamo.explain(MoE(CFG).train(train))(x)
        assert (ex.graph_count, ex.graph_break_count, ex.break_reasons) == (1, 0, []), train
    blk.ffn.solving = True  # the first steps' forwards also solve their balance shift: still one graph
    torch._dynamo.reset()
    ex = torch._dynamo.explain(blk.train())(x, cos, sin)
    assert (ex.graph_count, ex.graph_break_count, ex.break_reasons) == (1, 0, [])


@pytest.mark.parametrize("impl", ["auto", "bmm"])
def test_no_recompile_after_the_second_call(impl):
    "New values, a bias update, then experts that get no token: the graph of the first call serves them all."
    torch._dynamo.reset()
    blk = _block(impl)
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(blk, backend=counter)
    x, cos, sin = _inputs()
    g = torch.randn_like(x)
    _fwd_bwd(fn, x, cos, sin, g)
    x2, _, _ = _inputs(seed=3)  # new values, same shapes: new routing, no new graph
    counts = _fwd_bwd(fn, x2, cos, sin, g)[3]
    with torch._dynamo.config.patch(error_on_recompile=True):
        update_moe_biases(blk.ffn, {"expert_counts": counts})  # a balancing step between two calls
        _fwd_bwd(fn, x, cos, sin, g)
        with torch.no_grad():
            blk.ffn.expert_bias[[0, 7]] = -10.0  # never chosen: experts 0 and 7 get no token
        counts = _fwd_bwd(fn, x2, cos, sin, g)[3]
    assert counts[[0, 7]].sum() == 0 and counts.sum() == B * T * CFG.moe.top_k
    assert counter.frame_count == 1, counter.frame_count


def _compiled_presets() -> list:
    "The token-level presets that compile their blocks (`training.compile`): the GPU ones, the byte model's aside."
    out = []
    for path in sorted((ROOT / "examples/configs").glob("*.yaml")):
        d = yaml.safe_load(path.read_text())
        boundary = (d.get("model") or {}).get("boundary") or {}
        if (d.get("training") or {}).get("compile") and not boundary.get("enabled"):
            out.append(path.stem)
    return out


SHRINK = ["model.d_model=64", "model.attention.head_dim=16", "model.moe.expert_d_ff=32", "model.d_ff=128"]


@pytest.mark.parametrize("ac", AC_MODES)
@pytest.mark.parametrize("preset", _compiled_presets())
def test_compiled_presets_have_no_graph_breaks(preset, ac):
    """A compiled preset's block at CPU-sized widths, checkpointed each way: one graph, no break; one compile, a step
    starving an expert too; the kernels the layers took noted on them."""
    c = load_config(ROOT / f"examples/configs/{preset}.yaml", [*SHRINK, "training.device=cpu"]).model
    torch.manual_seed(0)
    blk = Block(c, moe=c.moe.n_routed > 0).train()
    model = apply_ac(_stack(blk), ac)
    inv, scale = rope_frequencies(c.attention.head_dim)
    cos, sin = rope_tables(torch.arange(T)[None], inv, scale)
    xs = [torch.randn(B, T, c.d_model) for _ in range(3)]
    torch._dynamo.reset()
    ex = torch._dynamo.explain(blk)(xs[0], cos, sin)
    assert (ex.graph_count, ex.graph_break_count, ex.break_reasons) == (1, 0, [])
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(blk, backend=counter, dynamic=False)  # as `apply_compile` compiles a token-level block
    for i, x in enumerate(xs):
        if i == 2 and c.moe.n_routed:
            with torch.no_grad():
                blk.ffn.expert_bias[0] = -10.0  # expert 0 gets no token
        _fwd_bwd(fn, x, cos, sin, torch.ones_like(x))
    assert counter.frame_count == 1, counter.frame_count
    moe = "grouped" if c.moe.n_routed else "none"  # auto on a CPU in float32 at aligned widths
    assert (kernels_in_use(model)["attention"], kernels_in_use(model)["moe"]) == ("sdpa", moe)


def test_moe_compiles_to_one_graph():
    "The whole MoE traces as one graph in training and in evaluation (fullgraph=True fails on any break)."
    x, _, _ = _inputs()
    for train in (True, False):
        torch._dynamo.reset()
        m = MoE(CFG).train(train)
        y, _, stats = torch.compile(m, backend="aot_eager", fullgraph=True)(x)
        y_eager, _, stats_eager = m(x)
        torch.testing.assert_close(y, y_eager, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(stats["expert_counts"], stats_eager["expert_counts"])


def test_load_counted_once_with_checkpointing():
    """Checkpointing around a compiled MoE, or inside a compiled function, recomputes the forward in the backward; the
    balancing callback, handed the forward's stats as the trainer hands them, counts each token once."""
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
    with torch.no_grad():  # by hand: each token's top-k, counted
        want = torch.bincount(m.select(x.reshape(-1, CFG.d_model))[2].flatten(), minlength=CFG.moe.n_routed)
    for name, run in runs.items():
        balance = MoEBalancing()
        y, _, stats = run()
        balance.after_forward(None, SimpleNamespace(stats=stats))
        y.sum().backward()
        assert torch.equal(balance.load["expert_counts"], want), name


def test_byte_preset_segments_compile_without_recompiles(monkeypatch):
    """The byte preset at CPU size, checkpointed whole as flexitokens-h100 is and compiled by `apply_compile`: four
    training steps with four segment counts compile in the first step only, one graph per kind of block (the byte
    blocks over T bytes, the dense first layer and the MoE layers over a dynamic S), with no graph break, and give
    the eager model's losses."""
    cfg = load_config(ROOT / "examples/configs/flexitokens-cpu.yaml", ["training.seq_len=64", "training.device=cpu"])
    torch.manual_seed(0)
    eager = CipherModel(cfg.model).train()
    comp = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("aot_eager")  # the graphs, not codegen
    compile_ = nn.Module.compile
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: compile_(self, backend=counter, **kw))
    torch._dynamo.reset()
    counters.clear()
    apply_compile(apply_ac(comp, "full"))
    seen, frames = [], []
    comp.hourglass.boundary.register_forward_hook(lambda mod, args, seg: seen.append(seg.n_segments))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, comp)]
    for step in range(4):
        ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(step))
        losses = []
        for m, opt in zip((eager, comp), opts):
            torch.manual_seed(step)  # the same boundary noise for both
            out = m(ids, labels=ids)
            losses.append(out.loss + sum(out.aux.values()))
            losses[-1].backward()
            opt.step()
            opt.zero_grad()
        frames.append(counter.frame_count)
        torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-5)
    assert len(set(seen)) == 4, seen
    assert frames == [3] * 4 and not counters["graph_break"], (frames, dict(counters["graph_break"]))
