"""A compiled block whose MoE splits its experts over two gloo ranks (`training.expert_parallel = 2` with
`training.compile`): one graph per block, no break (the split sizes are read inside it, once per layer), no recompile
after the first call, a step where one rank's experts get no token included, and the eager block's losses and
gradients."""

import copy
import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._dynamo.testing import CompileCounterWithBackend

from cipher_nb.config.load import ModelConfig
from cipher_nb.model.lm import Block, rope_frequencies, rope_tables
from cipher_nb.optim.expert_parallel import ExpertParallelExperts

BREAKS_PER_BLOCK = 0  # graph breaks of a compiled block with split experts: this test fails if it grows
B, T = 2, 32


def _worker(rank, world, init_file, out_dir, impl):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = ModelConfig()  # the tiny-cpu preset's widths
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, impl=impl))
        torch.manual_seed(1)
        eager = Block(cfg, moe=True).train()
        comp = copy.deepcopy(eager)
        group = dist.new_group([0, 1])
        for blk in (eager, comp):
            blk.ffn.experts = ExpertParallelExperts(blk.ffn.experts, group, 2, rank)
        inv, scale = rope_frequencies(cfg.attention.head_dim)
        cos, sin = rope_tables(torch.arange(T)[None], inv, scale)
        torch.manual_seed(10 + rank)  # each rank its own tokens
        xs = [torch.randn(B, T, cfg.d_model) for _ in range(3)]
        ex = torch._dynamo.explain(comp)(xs[0], cos, sin)
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")  # the graph, not codegen
        fn = torch.compile(comp, backend=counter, dynamic=False)  # as `apply_compile` compiles a token-level block
        losses, grads, starved = [], [], []
        for i, x in enumerate(xs):
            if i == 2:  # rank 0's experts (0-3 of 8) are never chosen: it receives no row
                for blk in (eager, comp):
                    with torch.no_grad():
                        blk.ffn.expert_bias[:4] = -10.0
            step = []
            for blk, f in ((eager, eager), (comp, fn)):
                y, aux, stats = f(x, cos, sin)
                loss = y.square().mean() + sum(aux.values())
                loss.backward()
                step.append((loss.detach(), {n: p.grad.clone() for n, p in blk.named_parameters()}))
                blk.zero_grad(set_to_none=True)
            starved.append(stats["expert_counts"][:4].sum())
            losses.append([s[0] for s in step])
            grads.append([s[1] for s in step])
        out = dict(breaks=ex.graph_break_count, graphs=ex.graph_count, reasons=[str(r) for r in ex.break_reasons])
        out.update(frames=counter.frame_count, losses=losses, grads=grads, starved=starved)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("impl", ["grouped", "bmm"])
def test_compiled_expert_parallel_block_has_no_graph_breaks(impl):
    "Both ranks: one graph, BREAKS_PER_BLOCK breaks, one compile over three steps, the eager losses (1e-5)."
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, f"{d}/init", d, impl), nprocs=2, join=True)
        got = [torch.load(Path(d) / f"rank{r}.pt") for r in range(2)]
    for r, o in enumerate(got):
        assert (o["graphs"], o["breaks"], o["reasons"]) == (1, BREAKS_PER_BLOCK, []), (r, o["reasons"])
        assert o["frames"] == 1, (r, o["frames"])  # no recompile after the first call
        for (le, lc), (ge, gc) in zip(o["losses"], o["grads"]):
            torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-5)
            for n in ge:
                torch.testing.assert_close(gc[n], ge[n], rtol=1e-5, atol=1e-5, msg=n)
    assert sum(o["starved"][2] for o in got) == 0  # the last step: rank 0's experts got no token
