"""Loss-free balancing across ranks: two gloo processes see different tokens, and after `update_moe_biases` both hold
the bias that the summed counts of both ranks (over two micro-batches each) give, and the centring that the mean
scores of all four micro-batches give."""

import dataclasses
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from cipher_nb.config.load import ModelConfig
from cipher_nb.model.moe import MoE, moe_layers, update_moe_biases

CFG = ModelConfig(d_model=16, moe=dict(n_routed=6, n_shared=0, top_k=2, expert_d_ff=8, bias_gamma=0.1))


def _model():
    "Two MoE layers where a model keeps them (`layers.{i}.ffn`), the second with top-1."
    torch.manual_seed(0)
    model = nn.Module()
    ffns = MoE(CFG), MoE(dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, top_k=1)))
    model.layers = nn.ModuleList(nn.ModuleDict({"ffn": f}) for f in ffns)
    return model


def _batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(2, 7 + rank, CFG.d_model, generator=g) for _ in range(2)]  # ranks see different token counts


def _forward_all(model, x, loads: dict):
    "Each layer's forward of x, its counts and mean scores added to `loads` under their stats keys."
    for k, m in moe_layers(model).items():
        stats, means = m(x)[2], k.replace("expert_counts", "score_mean")
        loads[k] = loads.get(k, 0) + stats["expert_counts"]
        loads[means] = loads.get(means, 0) + stats["score_mean"]


def _worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model, loads = _model().train(), {}
        for x in _batches(rank):
            _forward_all(model, x, loads)  # two micro-batches of one step
        n = update_moe_biases(model, loads, step=1, forwards=2)
        bias = [m.expert_bias.clone() for m in moe_layers(model).values()]
        center = [m.score_center.clone() for m in moe_layers(model).values()]
        torch.save({"n": n, "bias": bias, "center": center}, Path(out_dir) / f"rank{rank}.pt")
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
    update_moe_biases(model, loads, step=1, forwards=4)
    assert got[0]["n"] == got[1]["n"] == 2
    for layer, m in enumerate(moe_layers(model).values()):
        assert torch.equal(got[0]["bias"][layer], got[1]["bias"][layer])  # ranks agree
        assert torch.allclose(got[0]["bias"][layer], m.expert_bias)  # and match the summed counts
        assert m.expert_bias.abs().sum() > 0  # something moved
        # by hand: each micro-batch's mean sigmoid score, averaged over all four, centred, at step 1 of 200
        xs = [x.reshape(-1, CFG.d_model) for r in range(2) for x in _batches(r)]
        mean = torch.stack([torch.sigmoid(x @ m.router.weight.T).mean(0) for x in xs]).mean(0)
        by_hand = -(1 - 1 / CFG.moe.center_steps) * (mean - mean.mean())
        assert torch.equal(got[0]["center"][layer], got[1]["center"][layer])  # ranks agree bit for bit
        assert torch.allclose(got[0]["center"][layer], by_hand, atol=1e-6) and by_hand.abs().sum() > 0
