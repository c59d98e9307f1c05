"""Synthetic metric streams through MonitorCallback and the gate: each threat and each gate line trips alone; a
healthy stream trips none."""

import math
import warnings
from types import SimpleNamespace

import pytest
import torch

from cipher_nb.config.load import config_from_dict
from cipher_nb.monitor.gate import gate, gate_passed
from cipher_nb.monitor.health import HealthWarning, HostSyncCounter, MonitorCallback

N_STEPS, LOG_EVERY, EVAL_EVERY = 200, 10, 50


def healthy_stats(step):
    "Stats of a balanced 2-layer MoE (8 experts, top-2; routing sharpening), a 3-loop core, a boundary rate near 0.3."
    return {
        "layer1/expert_counts": torch.full((8,), 64.0),
        "layer2/expert_counts": torch.tensor([70.0, 60, 64, 64, 60, 68, 62, 64]),
        "layer1/router_entropy": torch.tensor(1.7 + 0.3 * math.exp(-step / 80)),
        "layer2/router_entropy": torch.tensor(1.8),
        "loop/norm": torch.tensor([10.0, 12.0, 13.0]),
        "loop/entropy": torch.tensor([1.9, 1.8, 1.8]),
        "loop/token_corr": torch.tensor([0.2, 0.3, 0.35]),
        "bp/rate": torch.tensor(0.31),
    }


def healthy_row(step):
    return {
        "step": step,
        "loss": 1.5 + 4 * math.exp(-step / 60),
        "loss/z": 1e-3,
        "grad_norm": 1.0,
        "mfu": 0.75,
        "gpu_util": 85.0,
        "tok_per_s": 5e4,
    }


def healthy_val(step):
    return 3.0 - step / 200


def drive(overrides=(), stats=None, row=None, val=None, warmup=0):
    "Run a fake trainer's log and eval steps through MonitorCallback; return its warnings and the rows it completed."
    cfg = config_from_dict(
        {
            "model": {"n_routed": 8, "top_k": 2, "boundary": True, "bp_rate": 0.3},
            "training": {"log_every": LOG_EVERY},
            "monitor": dict(overrides),
        }
    )
    cb = MonitorCallback(cfg.monitor, cfg.model, cfg.training.log_every, cfg.optim.clip_groups)
    tr = SimpleNamespace(cfg=cfg, model=torch.nn.Linear(2, 2), step=0, last_out=None, is_main=True)
    tr.schedule = SimpleNamespace(warmup_steps=warmup)  # the trainer's plan
    rows = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(LOG_EVERY, N_STEPS + 1, LOG_EVERY):
            tr.step, tr.last_out = step, SimpleNamespace(stats=(stats or healthy_stats)(step))
            r = (row or healthy_row)(step)
            cb.on_log(tr, r)
            rows.append(r)
            if step % EVAL_EVERY == 0:
                cb.on_eval(tr, {"step": step, "val/loss": (val or healthy_val)(step)})
    assert [str(w.message) for w in caught if w.category is HealthWarning] == [str(t) for t in cb.warnings]
    return cb.warnings, rows


def with_stats(**kw):
    return lambda s: {**healthy_stats(s), **{k.replace("__", "/"): f(s) for k, f in kw.items()}}


def with_row(**kw):
    return lambda s: {**healthy_row(s), **{k.replace("__", "/"): f(s) for k, f in kw.items()}}


def test_healthy_stream_trips_nothing():
    found, rows = drive()
    assert found == []
    assert gate_passed(gate(rows, config_from_dict({}).monitor))
    assert rows[0]["router/layer1_max_load"] == 1.0 and rows[0]["loop/norm_3"] == 13.0  # metrics landed in the row


CASES = {
    "expert collapse": dict(
        stats=with_stats(
            layer2__expert_counts=lambda s: (
                torch.tensor([300.0, 20, 20, 20, 20, 20, 56, 56]) if s >= 100 else torch.full((8,), 64.0)
            )
        )
    ),
    "non-finite loss": dict(row=with_row(loss=lambda s: float("nan") if s == 120 else 2.0)),
    "gradient explosion": dict(row=with_row(grad_norm=lambda s: 40.0 if 80 <= s <= 100 else 1.0)),
    "slow training": dict(row=with_row(mfu=lambda s: 0.2)),
    "overfitting": dict(val=lambda s: 2.5 - 0.004 * min(s, 100) + 0.003 * max(0, s - 100)),
    "boundary rate off target": dict(stats=with_stats(bp__rate=lambda s: torch.tensor(0.55 if s > 150 else 0.31))),
    "recurrent drift": dict(stats=with_stats(loop__norm=lambda s: torch.tensor([10.0, 40.0, 130.0]))),
    "routing collapse in the loops": dict(stats=with_stats(loop__entropy=lambda s: torch.tensor([1.9, 0.6, 0.4]))),
    "token-state collapse": dict(stats=with_stats(loop__token_corr=lambda s: torch.tensor([0.5, 0.9, 0.99]))),
}


@pytest.mark.parametrize("name", CASES)
def test_each_threat_trips_alone_and_once(name):
    found, _ = drive(**CASES[name])
    assert [t.name for t in found] == [name]
    assert "Fix: " in str(found[0]) and f"step {found[0].step}" in str(found[0])


def test_slow_tokens_per_second_when_asked():
    assert drive()[0] == []
    found, _ = drive({"min_tok_per_s": 1e5})  # healthy rows run at 5e4 tokens/s
    assert [t.name for t in found] == ["slow training"] and "monitor.min_tok_per_s" in found[0].message


def test_threat_that_clears_and_returns_warns_again():
    found, _ = drive(row=with_row(grad_norm=lambda s: 40.0 if s in (50, 60, 70, 150, 160, 170) else 1.0))
    assert [(t.name, t.step) for t in found] == [("gradient explosion", 70), ("gradient explosion", 170)]


def test_a_gradient_spike_is_not_a_threat():
    "One row over the limit, or two of five: clipping holds them."
    assert drive(row=with_row(grad_norm=lambda s: 40.0 if s in (80, 110) else 1.0))[0] == []


COLLAPSED = torch.tensor([300.0, 20, 20, 20, 20, 20, 56, 56])


def test_warmup_excuses_a_skewed_router_not_a_collapsed_one():
    "A router skewed in warmup (30 steps) and balanced after it: no warning; still collapsed after warmup: one."
    skewed_until = lambda last: with_stats(  # noqa: E731
        layer2__expert_counts=lambda s: COLLAPSED if s <= last else torch.full((8,), 64.0)
    )
    assert drive(stats=skewed_until(30), warmup=30)[0] == []
    assert [(t.name, t.step) for t in drive(stats=skewed_until(30))[0]] == [("expert collapse", 10)]  # no warmup
    assert [(t.name, t.step) for t in drive(stats=skewed_until(60), warmup=30)[0]] == [("expert collapse", 40)]
    nan = drive(row=with_row(loss=lambda s: float("nan") if s == 20 else 2.0), warmup=30)[0]
    assert [(t.name, t.step) for t in nan] == [("non-finite loss", 20)]  # nothing excuses a NaN


def test_log_step_costs_one_host_sync():
    cfg = config_from_dict({"training": {"log_every": 5}})
    model = torch.nn.ModuleDict(dict(experts=torch.nn.Linear(3, 3)))
    tr = SimpleNamespace(cfg=cfg, model=model, step=0, last_out=SimpleNamespace(stats=healthy_stats(0)), is_main=True)
    cb = MonitorCallback(cfg.monitor, cfg.model, cfg.training.log_every, cfg.optim.clip_groups, warn=False)
    with HostSyncCounter() as sc:
        for step in range(1, 11):
            tr.step = step - 1
            model["experts"](torch.ones(2, 3)).sum().backward()
            cb.after_backward(tr)
            tr.step = step
            if step % 5 == 0:
                cb.on_log(tr, {"step": step, "loss": 2.0})
    # two log steps: one copy each (the backward passes themselves make none)
    assert sc.count == 2


GATE_CASES = [  # (criterion index, row or stats change, populations)
    (
        0,
        dict(row=with_row(loss=lambda s: 5.0 - max(0, s - 100) / 50)),
        None,
    ),  # flat for the first 100 steps, falls later
    (1, dict(row=with_row(**{"loss__z": lambda s: float("inf") if s == 30 else 1e-3})), None),
    (2, dict(row=with_row(gpu_util=lambda s: 40.0)), None),
    (
        3,
        dict(stats=with_stats(layer1__expert_counts=lambda s: torch.tensor([150.0, 40, 40, 40, 40, 100, 50, 52]))),
        None,
    ),
    (
        4,
        dict(
            stats=with_stats(layer1__router_entropy=lambda s: torch.tensor(1.5 + s / 200)),
        ),
        None,
    ),
    (5, dict(stats=with_stats(layer1__cross_pop_overlap=lambda s: torch.tensor(0.45))), None),
    (5, dict(), True),
    (6, dict(row=with_row(grad_norm=lambda s: 11.0 if s >= 170 else 1.0)), None),
    (1, dict(row=with_row(skipped=lambda s: int(s == 90), skipped_at=lambda s: [83] if s == 90 else [])), None),
]


@pytest.mark.parametrize("idx,change,pops", GATE_CASES)
def test_each_gate_line_fails_alone(idx, change, pops):
    _, rows = drive(**change)
    lines = gate(rows, config_from_dict({}).monitor, populations=pops)
    assert [i for i, g in enumerate(lines) if g.passed is False] == [idx], lines


def test_gate_skips_what_does_not_apply():
    _, rows = drive(row=lambda s: {k: v for k, v in healthy_row(s).items() if k not in ("mfu", "gpu_util")})
    lines = gate(rows, config_from_dict({}).monitor)
    assert [g.passed for g in lines] == [True, True, None, True, True, None, True]
    assert "CPU run" in lines[2].figure and "populations off" in lines[5].figure


def test_low_mfu_fails_its_own_line_only_when_monitor_min_mfu_is_set():
    _, rows = drive(row=with_row(mfu=lambda s: 0.3))
    lines = gate(rows, config_from_dict({}).monitor)
    assert gate_passed(lines) and not any(g.reads == "mfu" for g in lines)  # the default: not judged
    lines = gate(rows, config_from_dict({"monitor": {"min_mfu": 0.5}}).monitor)
    assert [(g.passed, g.figure) for g in lines if g.reads == "mfu"] == [(False, "30.0%, last quarter")]
    assert lines[2].passed is True  # the GPU is busy all the same


def test_load_metrics_come_from_the_whole_window():
    "The trainer's window_stats (every micro-batch) win over the last micro-batch's; fakes without them fall back."
    skewed = {"layer1/expert_counts": torch.tensor([60.0, 0, 0, 0, 0, 0, 0, 4])}
    window = {"layer1/expert_counts": torch.full((8,), 8.0)}
    found, rows = drive(stats=lambda s: skewed)  # no window_stats: the last micro-batch decides
    assert [t.name for t in found] == ["expert collapse"] and rows[0]["router/layer1_max_load"] == 7.5
    cfg = config_from_dict({"model": {"n_routed": 8, "top_k": 2}})
    cb = MonitorCallback(cfg.monitor, cfg.model, cfg.training.log_every, cfg.optim.clip_groups, warn=False)
    tr = SimpleNamespace(cfg=cfg, model=None, step=10, last_out=SimpleNamespace(stats=skewed), window_stats=window)
    row = {"step": 10, "loss": 2.0}
    cb.on_log(tr, row)
    assert row["router/layer1_max_load"] == 1.0 and cb.warnings == []


def test_health_warning_is_one_line():
    found, _ = drive(**CASES["gradient explosion"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = config_from_dict({})
        MonitorCallback(cfg.monitor, cfg.model, cfg.training.log_every).on_log(
            SimpleNamespace(step=1, last_out=None, model=None), {"step": 1, "loss": float("nan")}
        )
    (w,) = caught
    text = warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line)
    assert text.count("\n") == 1 and "non-finite loss at step 1" in text and "Fix: " in text
