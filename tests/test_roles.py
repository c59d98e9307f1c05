"""Parameter roles on every shipped preset (built on the meta device, so the H100 presets cost nothing): every
parameter has exactly one role, and the optimizer groups, Muon's split, the clip groups and the boundary freeze chosen
by role are the ones the old parameter-name substring rule chose, parameter for parameter and in the same order."""

import functools
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from cipher_nb.config.load import ROLE_ALIASES, ROLES, load_config
from cipher_nb.model.lm import CipherModel
from cipher_nb.model.roles import clip_groups, param_roles, params_with_role
from cipher_nb.optim.optimizers import muon_names, param_groups
from cipher_nb.train.lora import inject_lora

PRESETS = sorted((ROOT / "examples/configs").glob("*.yaml"))
EXTRA = [  # what no preset switches on: an untied head with MLA, the linear injection, old-style keys, SFT's LoRA
    ("tiny-cpu.yaml", ("model.tie_embeddings=false", "model.attention.kind=mla", "model.attention.q_lora_rank=32")),
    ("flexitokens-cpu.yaml", ("model.recurrence.injection=linear",)),
    ("tiny-cpu-90s.yaml", ("optim.lr_mult={boundary: 0.1, memory: 5.0, experts: 3, router: 10.0}",)),
    ("example-cpu-sft.yaml", ("sft.lora_rank=4",)),
]
CASES = [(p.name, ()) for p in PRESETS] + EXTRA
LORA_EVERYWHERE = ("flexitokens-cpu.yaml", ("sft.lora_rank=4", "sft.lora_targets=[wq, wv, w_gate, '0']"))


@functools.cache
def built(preset: str, overrides: tuple):
    "The preset's config and its model on the meta device, with SFT's adapters when `sft.lora_rank` > 0."
    cfg = load_config(ROOT / "examples/configs" / preset, list(overrides))
    with torch.device("meta"):
        model = CipherModel(cfg.model)
        if cfg.sft.lora_rank:
            inject_lora(model, cfg.sft.lora_rank, cfg.sft.lora_alpha, 0.0, tuple(cfg.sft.lora_targets))
    return cfg, model


def case_id(case):
    return Path(case[0]).stem + ("[" + ",".join(case[1]) + "]" if case[1] else "")


@pytest.mark.parametrize("case", CASES + [LORA_EVERYWHERE], ids=case_id)
def test_every_parameter_has_exactly_one_role(case):
    cfg, model = built(*case)
    roles = param_roles(model)
    named = list(model.named_parameters())
    assert list(roles) == [n for n, _ in named] and set(roles.values()) <= set(ROLES)
    by_role = [id(p) for r in ROLES for p in params_with_role(model, r)]
    assert sorted(by_role) == sorted(id(p) for _, p in named), "a parameter in no role, or in two"
    trainable = {n for n, p in named if p.requires_grad}
    if cfg.sft.lora_rank:  # SFT's adapters are all that trains, and they are `lora` wherever they sit
        assert trainable and all(roles[n] == "lora" for n in trainable), trainable
    assert ("head" in roles.values()) == (not cfg.model.tie_embeddings)


# the old rule, as the optimizer notebook had it before the roles: the reference the role-based groups must reproduce
OLD_MUON_SKIP = ("embed", "head", "router", "boundary", "lora", "memory")
OLD_KEY = {new: old for old, new in ROLE_ALIASES.items()}  # routed_expert -> experts: the substring it was


def old_keys(m: dict) -> dict:
    return {OLD_KEY.get(k, k): v for k, v in m.items()}


def old_mult(name: str, lr_mult: dict) -> float:
    keys = [k for k in lr_mult if k in name]
    return float(lr_mult[max(keys, key=len)]) if keys else 1.0


def old_groups(model, cfg, exclude=()) -> list:
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad or name in exclude:
            continue
        decay = cfg.optim.decay_all or not (p.ndim < 2 or id(p) in embeddings)
        wd, mult = (cfg.optim.weight_decay if decay else 0.0), old_mult(name, old_keys(cfg.optim.lr_mult))
        groups.setdefault((wd, mult), []).append(name)
    return [(wd, mult, names) for (wd, mult), names in groups.items()]


def old_muon(model, cfg, ndim) -> list:
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return [
        n
        for n, p in model.named_parameters()
        if p.requires_grad
        and p.ndim == ndim
        and id(p) not in embeddings
        and not any(k in n for k in OLD_MUON_SKIP)
        and old_mult(n, old_keys(cfg.optim.lr_mult)) == 1.0
    ]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_role_groups_are_the_old_name_groups(case):
    "AdamW's groups, Muon's split (with and without the experts), the clip groups and the frozen predictor."
    cfg, model = built(*case)

    def groups(exclude=()):
        return [
            (g["weight_decay"], g["lr_mult"], g["names"])
            for g in param_groups(model, cfg.optim, cfg.schedule.lr, exclude=exclude)
        ]

    assert groups() == old_groups(model, cfg)
    hidden, stacked = muon_names(model, cfg.optim.lr_mult), muon_names(model, cfg.optim.lr_mult, ndim=3)
    assert hidden == old_muon(model, cfg, 2) and stacked == old_muon(model, cfg, 3)
    for on_muon in (set(hidden), set(hidden + stacked)):  # optim.muon_experts off and on
        assert groups(on_muon) == old_groups(model, cfg, on_muon)
    name = {id(p): n for n, p in model.named_parameters()}
    named = list(name.values())
    by_role = clip_groups(model, cfg.optim.clip_groups)
    assert {OLD_KEY.get(r, r): [name[id(p)] for p in ps] for r, ps in by_role.items()} == {
        k: [n for n in named if k in n] for k in old_keys(cfg.optim.clip_groups)
    }
    assert [name[id(p)] for p in params_with_role(model, "boundary")] == [n for n in named if "boundary" in n]
