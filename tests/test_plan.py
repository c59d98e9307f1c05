"""`cipher-plan` (cipher_nb.train.plan): the fake-tensor plan against a measured step, its FLOPs against the sizing
formula, its JSON and its exit code; each GPU preset's plan at its shipped micro-batch must fit an 80 GB H100."""

import json
from functools import reduce

import pytest
import torch
from conftest import ROOT, run_in_process
from torch.distributed._tools.mem_tracker import MemTracker

from cipher_nb.config.load import load_config
from cipher_nb.config.sizing import flops_per_token
from cipher_nb.core import seed_everything
from cipher_nb.model.lm import CipherModel
from cipher_nb.optim.optimizers import build_optimizer
from cipher_nb.train.plan import HEADROOM, GiB, capacity_gib, cipher_plan, count_flops, phase_lines, trace_step

PRESETS = ROOT / "examples" / "configs"
SMALL = ["model.n_layers=2", "training.seq_len=64", "training.batch_size=2"]
# each preset's kinds of layer at a fraction of its depth and length: what the FLOP formulas are checked on
SHRUNK = {
    "h100": ["model.n_layers=2", "training.seq_len=256"],
    "wide-h100": ["model.n_layers=2", "training.seq_len=256"],
    "flexitokens-h100": [
        "model.n_layers=4",
        "model.recurrence.n_prelude=1",
        "model.recurrence.n_core=2",
        "model.recurrence.n_coda=1",
        "model.recurrence.n_loops=2",
        "model.engram.layers=[1,2]",
        "training.seq_len=330",
    ],
}


def measured_peak(cfg, micro_batch: int) -> int:
    """Peak live bytes of a real fp32 training step after the first (the optimizer's state held throughout) on this
    CPU, by torch's MemTracker (real tensors, one process)."""
    seed_everything(0)
    model = CipherModel(cfg.model)
    opt = build_optimizer(model, cfg.optim, cfg.schedule.lr)
    ids = torch.randint(0, cfg.model.vocab, (micro_batch, cfg.training.seq_len))

    def step():
        out = model(ids, labels=ids)
        (out.loss + sum(out.aux.values())).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    mt = MemTracker()
    mt.track_external(model, *getattr(opt, "parts", [opt]))
    with mt:
        step()
    return mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_plan_matches_a_measured_cpu_step():
    "The fake trace of tiny-cpu's step, in fp32 as it runs here, is within 15% of the real step's measured peak."
    cfg = load_config(PRESETS / "tiny-cpu.yaml", ["training.batch_size=4"])
    planned = max(
        sum(by.values()) for by in trace_step(cfg.model, cfg.training, cfg.optim, 4, dtype=torch.float32).values()
    )
    real = measured_peak(cfg, 4)
    assert abs(planned / real - 1) < 0.15, (planned, real)


SHORT_BYTES = ["training.seq_len=128", "model.recurrence.n_loops=2"]  # every piece, at a fraction of the cost


def test_the_byte_model_plan_bounds_a_measured_step():
    """flexitokens-cpu (the recurrent byte model: experts, Engram, ACT), shortened: with its boundary predictor
    the plan assumes every byte a segment, an upper bound of the measured step; without it, the plan is the step."""
    for extra, bound_only in (([], True), (["model.boundary.enabled=false"], False)):
        cfg = load_config(PRESETS / "flexitokens-cpu.yaml", ["training.batch_size=2", *SHORT_BYTES, *extra])
        traced = trace_step(cfg.model, cfg.training, cfg.optim, 2, dtype=torch.float32)
        planned, real = max(sum(by.values()) for by in traced.values()), measured_peak(cfg, 2)
        assert planned >= real and (bound_only or planned / real - 1 < 0.15), (extra, planned, real)


@pytest.mark.parametrize("preset", ["h100", "wide-h100", "flexitokens-h100"])
def test_counted_flops_agree_with_sizing(preset):
    "FlopCounterMode (with our formulas) and sizing.flops_per_token agree within 3%, on each preset's shapes shrunk."
    cfg = load_config(PRESETS / f"{preset}.yaml", SHRUNK[preset])
    counted = count_flops(cfg.model, cfg.training) / cfg.training.seq_len
    assert abs(counted / flops_per_token(cfg.model, cfg.training.seq_len) - 1) < 0.03


def test_json_has_the_figures():
    r = run_in_process(cipher_plan, *SMALL, "--gpus", "2", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert {"peak_gib", "capacity_gib", "micro_batch", "max_micro_batch", "flops_per_token"} <= set(p)
    assert p["micro_batch"] == 2 and p["max_micro_batch"] > p["micro_batch"] and p["peak_gib"] < p["capacity_gib"]


def test_a_plan_that_does_not_fit_exits_2_with_the_fixes():
    "6.4B dense parameters in fp32 with AdamW on one GPU: about 95 GiB before an activation."
    big = ["model.d_model=16384", "model.d_ff=65536", "model.moe.n_routed=0", "model.n_layers=2"]
    r = run_in_process(cipher_plan, *SMALL, *big, "--gpus", "1")
    assert r.returncode == 2
    *traces, line = r.stderr.strip().splitlines()  # the search's progress, then the error's one line
    assert all(t.startswith("cipher-plan: tracing one step at micro-batch") for t in traces), traces
    assert "GiB >" in line and "training.parallel=fsdp" in line, line
    assert "micro-batch 1 alone needs" in line, line  # not even the smallest micro-batch fits: its figure
    r = run_in_process(cipher_plan, *SMALL, "--gpu", "v100")
    assert r.returncode == 2 and "h100, h200, a100" in r.stderr


# memory is linear in depth (each layer, or each loop of the recurrent core, adds its weights, gradients, optimizer
# state and activations), so each preset is traced at its shipped micro-batch at two shallow depths and extrapolated
# to its own: (the key, two depths) per preset
DEPTH = {
    "h100": ("model.n_layers", 1, 2),  # the dense first layer, then one MoE layer: each further layer is MoE
    "wide-h100": ("model.n_layers", 1, 2),
    "flexitokens-h100": ("model.recurrence.n_loops", 1, 2),
}


@pytest.mark.parametrize("preset", DEPTH)
def test_gpu_preset_fits_an_h100_node(preset):
    "Each GPU preset's planned peak, at its shipped micro-batch on 8 H100s, stays within 90% of the usable memory."
    key, d1, d2 = DEPTH[preset]
    path = PRESETS / f"{preset}.yaml"
    depth = reduce(getattr, key.split("."), load_config(path))
    peaks = []
    for d in (d1, d2):
        cfg = load_config(path, [f"{key}={d}"])
        peaks.append(trace_step(cfg.model, cfg.training, cfg.optim, cfg.training.batch_size, 8))
    planned = max(a + c * depth for a, c in phase_lines(d1, peaks[0], d2, peaks[1]).values()) / GiB
    assert planned <= (1 - HEADROOM) * capacity_gib("h100"), f"{preset}: {planned:.1f} GiB at its micro-batch"


def test_fsdp_shards_the_optimizer_state_over_a_fake_world():
    "Under FSDP2 on a fake process group of 4, each GPU holds a quarter of AdamW's state (FSDP2's own sharding)."
    cfg = load_config(None, [*SMALL, "training.parallel=fsdp"])
    one, four = (trace_step(cfg.model, cfg.training, cfg.optim, 2, w)["optimizer"] for w in (1, 4))
    assert abs(four["optimizer"] * 4 / one["optimizer"] - 1) < 0.05, (one, four)
    assert four["parameters"] < one["parameters"] / 2  # the shards, and no more than a block gathered at a time


def test_ema_adds_one_fp32_copy_of_the_parameters_per_gpu():
    "optim.ema > 0: each phase's optimizer state grows by 4 bytes a parameter, a quarter of that on 4 GPUs (FSDP2)."
    from dataclasses import replace

    cfg = load_config(None, [*SMALL, "training.parallel=fsdp"])
    n = sum(p.numel() for p in CipherModel(cfg.model).parameters() if p.requires_grad)
    for world in (1, 4):
        off, on = (trace_step(cfg.model, cfg.training, replace(cfg.optim, ema=e), 2, world) for e in (0.0, 0.999))
        for phase in off:
            extra = on[phase]["optimizer"] - off[phase]["optimizer"]
            assert abs(extra / (4 * n / world) - 1) < 0.01, (world, phase, extra, n)  # shards: rows rounded up
            assert {k: v for k, v in on[phase].items() if k != "optimizer"} == {
                k: v for k, v in off[phase].items() if k != "optimizer"
            }
