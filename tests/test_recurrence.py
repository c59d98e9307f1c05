"""The recurrent core's pieces inside the whole model: the LTI injection keeps the state bounded over 64 loops for
random and adversarial parameters (the linear injection does not), ACT's weights and ponder gradient, an exact
per-loop LoRA merge, activation checkpointing around the loop, Muon leaving the adapters to AdamW, and a model with
every piece on that trains."""

import copy
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from cipher_nb.config.load import config_from_dict, model_config
from cipher_nb.model.lm import CipherModel
from cipher_nb.model.recurrence import LTI_MIN_RATE, LTIInjection, act_weights, merged_injection
from cipher_nb.optim.optimizers import muon_names
from cipher_nb.optim.parallel import apply_ac


def recurrent(n_loops=3, **rec):
    "A small byte-level recurrent model config (1 prelude, 1 core, 1 coda block) with recurrence fields `rec`."
    cfg = model_config(
        d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=16, n_routed=4, n_shared=1, top_k=2, expert_d_ff=32
    )
    return replace(cfg, recurrence=replace(cfg.recurrence, n_prelude=1, n_core=1, n_coda=1, n_loops=n_loops, **rec))


def loop_norms(m: CipherModel, loops: int = 64, seed: int = 0) -> np.ndarray:
    torch.manual_seed(seed)
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        return m.eval()(x, n_loops=loops).stats["loop/norm"].double().numpy()


def make_adversarial(m: CipherModel, scale: float):
    "Scale every core weight up and, for lti, push every decay to the largest value the parameterisation allows."
    with torch.no_grad():
        for p in m.layers[1].parameters():
            p.mul_(scale)
        if isinstance(m.recurrence.inject, LTIInjection):
            m.recurrence.inject.rate.fill_(-1e4)
            m.recurrence.inject.B.weight.mul_(100)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recurrent_lti_bounded_for_random_params(seed):
    torch.manual_seed(seed)
    m = CipherModel(recurrent(injection="lti"))
    with torch.no_grad():
        m.recurrence.inject.rate.normal_(std=10.0)
        m.recurrence.inject.B.weight.normal_(std=3.0)
    norms = loop_norms(m, seed=seed)
    assert np.isfinite(norms).all()
    assert norms[-1] <= 2 * norms[31], norms  # converging, not drifting
    a = m.recurrence.inject.decay()
    assert ((a >= 0) & (a < 1)).all() and a.max() <= np.exp(-LTI_MIN_RATE) + 1e-6


def test_recurrent_lti_bounded_where_linear_drifts():
    torch.manual_seed(0)
    lti = CipherModel(recurrent(injection="lti"))
    make_adversarial(lti, 5.0)
    norms = loop_norms(lti)
    assert np.isfinite(norms).all() and norms[-1] <= 2 * norms[31], norms
    # the same adversary on the linear injection: a state map with eigenvalue 2 doubles the state every loop
    lin = CipherModel(recurrent(injection="linear"))
    make_adversarial(lin, 5.0)
    with torch.no_grad():
        d = lin.cfg.d_model
        lin.recurrence.inject.weight[:, :d] = 2 * torch.eye(d)
    drift = loop_norms(lin)
    assert not np.isfinite(drift[-1]) or drift[-1] > 1e6 * drift[31], drift


def test_recurrent_act_weights_sum_to_one_and_ponder_gradient():
    torch.manual_seed(0)
    w, _ = act_weights(torch.rand(8, 3, 7), 0.99)
    torch.testing.assert_close(w.sum(0), torch.ones(3, 7))
    ps = (0.2 + 0.02 * torch.rand(6, 2, 5, dtype=torch.float64)).requires_grad_()  # halts at loop 5
    assert ((ps.detach().cumsum(0) - 0.99).abs() > 1e-3).all()  # no partial sum at the threshold: differentiable
    assert torch.autograd.gradcheck(lambda p: act_weights(p, 0.99)[1].ponder_cost(), (ps,))


def test_recurrent_model_ponder_gradient_matches_finite_differences():
    "d loss/ponder / d halting bias from the whole model, float64, against a central difference."
    torch.manual_seed(1)
    m = CipherModel(recurrent(n_loops=6, halting=True)).double().eval()
    x = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        m.recurrence.halt.bias.fill_(-1.5)  # p ~ 0.18: tokens halt around loop 5, away from the threshold

    def ponder():
        with torch.enable_grad():  # the full loop, as in training
            return m(x).aux["ponder"]

    m.zero_grad()
    ponder().backward()
    g = m.recurrence.halt.bias.grad.item()
    h = 1e-6
    with torch.no_grad():
        m.recurrence.halt.bias += h
        up = ponder().item()
        m.recurrence.halt.bias -= 2 * h
        down = ponder().item()
        m.recurrence.halt.bias += h
    assert g < 0  # halting sooner costs less
    assert abs(g - (up - down) / (2 * h)) < 1e-6 * max(1.0, abs(g))


@pytest.mark.parametrize("injection", ["linear", "lti"])
def test_recurrent_loop_lora_merge_is_exact(injection):
    torch.manual_seed(2)
    m = CipherModel(recurrent(n_loops=1, injection=injection, loop_lora_rank=2)).double().eval()
    with torch.no_grad():
        m.recurrence.loop_lora.up.normal_(std=0.1)
    merged = copy.deepcopy(m)
    merged.recurrence.inject = merged_injection(m.recurrence.inject, m.recurrence.loop_lora, 0)
    del merged.recurrence.loop_lora
    x = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        a, b = m(x).logits, merged(x).logits
        plain = copy.deepcopy(merged)
        plain.recurrence.inject = m.recurrence.inject
        c = plain(x).logits  # the same model without its adapter differs
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert (a - c).abs().max() > 1e-4


def test_recurrent_every_piece_under_activation_checkpointing():
    "Full checkpointing of the blocks leaves the loss and every gradient of an lti + ACT + LoRA model unchanged."
    cfg = recurrent(injection="lti", halting=True, loop_lora_rank=2)
    torch.manual_seed(3)
    m = CipherModel(cfg)
    with torch.no_grad():
        m.recurrence.loop_lora.up.normal_(std=0.05)
    ac = apply_ac(copy.deepcopy(m), "full")
    x = torch.randint(0, 256, (2, 16))
    grads = []
    for model in (m, ac):
        out = model.train()(x, labels=x)
        (out.loss + sum(out.aux.values())).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        grads[-1]["loop/grad_norm"] = out.stats["loop/grad_norm"]  # the per-loop hooks see the same gradients
    assert grads[0].keys() == grads[1].keys()
    assert grads[0]["loop/grad_norm"][0] > 0  # (an untrained halting unit stops every token at loop 2: loop 3 gets 0)
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7, msg=n)


def test_recurrent_muon_leaves_recurrence_extras_to_adamw():
    cfg = config_from_dict({"optim": {"name": "muon"}})
    m = CipherModel(recurrent(injection="lti", halting=True, loop_lora_rank=2))
    names = muon_names(m, cfg.optim.lr_mult)
    assert not [
        n for n in names if n.startswith(("recurrence.loop_lora", "recurrence.halt", "recurrence.inject.rate"))
    ], names
    assert "recurrence.inject.B.weight" in names  # a hidden d x d matrix, like the blocks'


def stdlib_bytes() -> torch.Tensor:
    files = sorted(Path(os.__file__).parent.glob("*.py"))[:20]
    return torch.from_numpy(np.frombuffer(b"\n".join(f.read_bytes() for f in files), dtype=np.uint8).astype(np.int64))


def test_recurrent_every_piece_on_trains():
    torch.manual_seed(4)
    data = stdlib_bytes()
    m = CipherModel(recurrent(n_loops=3, injection="lti", halting=True, loop_lora_rank=2)).train()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95))
    losses = []
    for _ in range(25):
        i = torch.randint(0, len(data) - 65, (8,))
        x = torch.stack([data[j : j + 65] for j in i])
        out = m(x[:, :-1], labels=x[:, 1:])
        (out.loss + sum(out.aux.values())).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    assert np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < losses[0] - 0.5, losses
    assert 1.0 <= out.stats["loop/mean_loops"].item() <= 3.0
    assert out.stats["loop/grad_norm"].shape == (3,) and torch.isfinite(out.stats["loop/grad_norm"]).all()
