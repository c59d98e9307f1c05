"""Loss-free balancing across ranks: two gloo processes see different tokens, and after `update_moe_biases` both hold
the bias that the summed counts of both ranks (over two micro-batches each) give, plus the first step's share of the
shift solved on each of the four micro-batches."""

import dataclasses
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from conftest import shift_by_hand

from cipher_nb.config.load import ModelConfig
from cipher_nb.model.moe import MoE, bias_rate, bias_step, moe_layers, set_solving, update_moe_biases

CFG = ModelConfig(d_model=16, moe=dict(n_routed=6, n_shared=0, top_k=2, expert_d_ff=8, bias_gamma=0.1))


def _model():
    "Two MoE layers where a model keeps them (`layers.{i}.ffn`), the second with top-1."
    torch.manual_seed(0)
    model = nn.Module()
    ffns = MoE(CFG), MoE(dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, top_k=1)))
    model.layers = nn.ModuleList(nn.ModuleDict({"ffn": f}) for f in ffns)
    assert set_solving(model, 1)  # step 1's forwards solve the shift its bias takes
    return model


def _batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(2, 7 + rank, CFG.d_model, generator=g) for _ in range(2)]  # ranks see different token counts


def _forward_all(model, x, loads: dict):
    "Each layer's forward of x, its counts and solved shift added to `loads` under their stats keys."
    for k, m in moe_layers(model).items():
        stats, shift = m(x)[2], k.replace("expert_counts", "balance_shift")
        loads[k] = loads.get(k, 0) + stats["expert_counts"]
        loads[shift] = loads.get(shift, 0) + stats["balance_shift"]


def _worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model, loads = _model().train(), {}
        for x in _batches(rank):
            _forward_all(model, x, loads)  # two micro-batches of one step
        n = update_moe_biases(model, loads, step=1, forwards=2)
        bias = [m.expert_bias.clone() for m in moe_layers(model).values()]
        torch.save({"n": n, "bias": bias}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_bias_update_sums_counts_over_ranks_and_micro_batches():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, f"{d}/init", d), nprocs=2, join=True)
        got = [torch.load(Path(d) / f"rank{r}.pt") for r in range(2)]
    # the same step in one process: every micro-batch of both ranks, then one update
    model, loads = _model().train(), {}
    for r in range(2):
        for x in _batches(r):
            _forward_all(model, x, loads)
    counts = {k: v.clone() for k, v in loads.items() if k.endswith("expert_counts")}
    update_moe_biases(model, loads, step=1, forwards=4)
    assert got[0]["n"] == got[1]["n"] == 2
    for layer, (k, m) in enumerate(moe_layers(model).items()):
        assert torch.equal(got[0]["bias"][layer], got[1]["bias"][layer])  # ranks agree bit for bit
        assert torch.allclose(got[0]["bias"][layer], m.expert_bias)  # and match one process's update of every batch
        # by hand: the bias step of the summed counts, then the shift solved on each micro-batch's sigmoid scores
        # (the bias was zero), averaged over all four, centred, at step 1 of 200
        xs = [x.reshape(-1, CFG.d_model) for r in range(2) for x in _batches(r)]
        shift = torch.stack([shift_by_hand(torch.sigmoid(x @ m.router.weight.T), m.cfg.moe.top_k) for x in xs]).mean(0)
        shift = (1 - 1 / CFG.moe.center_steps) * (shift - shift.mean())
        step = bias_step(counts[k], bias_rate(m.cfg.moe, 1), m.cfg.moe.bias_rule, m.cfg.moe.bias_gamma)
        assert shift.abs().sum() > 0 and torch.allclose(got[0]["bias"][layer], step + shift, atol=1e-6)
