"""Engram memory in training: tiny token-level and byte-level (boundary predictor) models with Engram train a few
steps through `build_trainer`, the loss falls and the metrics rows carry `engram/gate`; the tables train on AdamW at
`optim.lr_mult.memory` without weight decay, and Muon never takes them."""

import json

import pytest
import torch

from cipher_nb.config.load import load_config
from cipher_nb.model.lm import CipherModel
from cipher_nb.optim.optimizers import build_muon, muon_names, param_groups, set_lr
from cipher_nb.train.builder import build_trainer

ENGRAM = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.attention.n_heads=2",
    "model.attention.n_kv_heads=1",
    "model.attention.head_dim=16",
    "model.moe.n_routed=4",
    "model.moe.expert_d_ff=32",
    "model.engram.layers=[0,1]",
    "model.engram.max_ngram=3",
    "model.engram.n_heads=2",
    "model.engram.table_size=97",
    "model.engram.dim=16",
]
RUN = [
    "data.source=stdlib",
    "training.device=cpu",
    "training.seq_len=64",
    "training.batch_size=4",
    "schedule.lr=3e-3",
    "schedule.warmup_steps=2",
    "schedule.max_steps=14",
    "training.log_every=1",
    "training.eval_every=1000",
    "training.checkpoint_every=1000",
]
TABLES = ["engram.0.memory.weight", "engram.1.memory.weight"]


def memory_group(groups) -> dict:
    "The one optimizer group holding the Engram tables (and nothing else)."
    found = [g for g in groups if any("memory" in n for n in g.get("names", []))]
    assert len(found) == 1, [g.get("names") for g in found]
    return found[0]


@pytest.mark.filterwarnings("ignore::cipher_nb.monitor.health.HealthWarning")  # a 14-step run trips the early checks
@pytest.mark.parametrize("name,extra", [("token", []), ("bytes", ["model.boundary.enabled=true"])])
def test_engram_trains_and_logs_its_gate(tmp_path, name, extra):
    "A few steps lower the loss; every metrics row has engram/gate, engram/norm and each layer's gate, in (0, 1)."
    cfg = load_config(None, [*RUN, *ENGRAM, *extra])
    tr = build_trainer(cfg, tmp_path / name, progress=False)
    tr.fit(progress=False)
    rows = [json.loads(r) for r in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r and "engram/gate" in r]
    assert len(train) == cfg.schedule.max_steps
    losses = [r["loss"] for r in train]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.05, losses
    for r in train:
        assert 0 < r["engram/gate"] < 1 and r["engram/norm"] > 0
        assert r["engram/gate"] == pytest.approx((r["engram/layer0_gate"] + r["engram/layer1_gate"]) / 2, rel=1e-5)
        assert r["engram/norm"] == pytest.approx((r["engram/layer0_norm"] + r["engram/layer1_norm"]) / 2, rel=1e-5)
    g = memory_group(tr.optimizer.param_groups)
    assert sorted(g["names"]) == TABLES
    assert g["lr_mult"] == 5.0 and g["weight_decay"] == 0.0
    plain = next(x for x in tr.optimizer.param_groups if x.get("lr_mult") == 1.0)
    assert g["lr"] == pytest.approx(5.0 * plain["lr"])  # the schedule's rate, times the multiplier


def test_tables_take_the_memory_multiplier_and_stay_off_muon():
    "AdamW groups: the tables alone at lr_mult.memory, no decay; Muon takes the Engram projections, not the tables."
    cfg = load_config(None, [*ENGRAM, "optim.lr_mult.memory=7.0"])
    model = CipherModel(cfg.model)
    g = memory_group(param_groups(model, cfg.optim, cfg.schedule.lr))
    assert sorted(g["names"]) == TABLES and g["lr_mult"] == 7.0 and g["weight_decay"] == 0.0
    assert g["lr"] == pytest.approx(7.0 * cfg.schedule.lr)
    names = muon_names(model, cfg.optim.lr_mult)
    assert not [n for n in names if "memory" in n]
    assert {"engram.0.wk.weight", "engram.0.wo.weight"} <= set(names)  # the projections are hidden matrices
    opt = build_muon(model, cfg.optim, cfg.schedule.lr)
    on_muon = {id(p) for group in opt.muon.param_groups for p in group["params"]}
    tables = [p for n, p in model.named_parameters() if n in TABLES]
    assert not any(id(p) in on_muon for p in tables)
    set_lr(opt, 1e-3)
    assert memory_group(opt.adamw.param_groups)["lr"] == pytest.approx(7e-3)


def test_tables_move_faster_with_the_multiplier():
    "One AdamW step from the same state: the tables move lr_mult times as far (Adam's first step is lr x sign)."
    steps = {}
    for mult in (1.0, 5.0):
        cfg = load_config(None, [*ENGRAM, f"optim.lr_mult.memory={mult}", "optim.weight_decay=0.0"])
        torch.manual_seed(0)
        model = CipherModel(cfg.model)
        opt = torch.optim.AdamW(param_groups(model, cfg.optim, cfg.schedule.lr), lr=cfg.schedule.lr)
        set_lr(opt, 1e-3)
        before = model.engram["0"].memory.weight.detach().clone()
        x = torch.randint(0, 256, (2, 32))
        out = model(x, labels=x)
        (out.loss + sum(out.aux.values())).backward()
        opt.step()
        steps[mult] = (model.engram["0"].memory.weight.detach() - before).abs().max().item()
    assert steps[1.0] == pytest.approx(1e-3, rel=1e-3)
    assert steps[5.0] == pytest.approx(5e-3, rel=1e-3)
