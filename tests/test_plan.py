"""`cipher-plan` (cipher_nb.train.plan): the fake-tensor plan against a measured step, its FLOPs against the sizing
formula, its JSON and its exit code; each GPU preset's plan at its shipped micro-batch must fit an 80 GB H100.
Expert parallelism: each rank's share of the experts and the all-to-all bytes against hand counts, and the layouts of
the Qwen3-30B-A3B-shaped preset over two nodes."""

import json
from dataclasses import replace
from functools import reduce

import pytest
import torch
from conftest import ROOT, run_in_process
from torch.distributed._tools.mem_tracker import MemTracker

from cipher_nb.config.load import load_config
from cipher_nb.config.sizing import flops_per_token, param_counts
from cipher_nb.core import seed_everything
from cipher_nb.model.lm import CipherModel
from cipher_nb.optim.optimizers import build_optimizer
from cipher_nb.train.plan import (
    HEADROOM,
    GiB,
    all_to_all_bytes,
    capacity_gib,
    cipher_plan,
    count_flops,
    layout_lines,
    phase_lines,
    plan_layouts,
    trace_step,
)

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


QWEN = PRESETS / "qwen3-30b-a3b.yaml"


def test_the_qwen3_preset_has_the_qwen3_30b_a3b_shape():
    cfg = load_config(QWEN)
    m, a, e = cfg.model, cfg.model.attention, cfg.model.moe
    assert (m.n_layers, m.d_model, a.n_heads, a.n_kv_heads, a.head_dim) == (48, 2048, 32, 4, 128)
    assert (e.n_routed, e.expert_d_ff, e.top_k, e.n_shared, m.n_moe_layers) == (128, 768, 8, 0, 48)
    assert (m.vocab, cfg.data.codec) == (32768, "tokenizer")  # the project's own BPE, not Qwen3's vocabulary
    assert 29e9 < param_counts(m)["total"] < 31e9


def test_each_rank_holds_its_share_of_the_experts():
    "A hand count on a small MoE under DDP on 4 ranks: at degree d a rank keeps 1/d of the experts and AdamW's state."
    cfg = load_config(None, SMALL)
    m = cfg.model
    experts = m.n_moe_layers * 3 * m.moe.n_routed * m.moe.expert_d_ff * m.d_model * 4  # fp32 bytes of every expert
    held = {d: trace_step(m, replace(cfg.training, expert_parallel=d), cfg.optim, 2, 4)["optimizer"] for d in (1, 2, 4)}
    for d in (2, 4):
        assert held[1]["parameters"] - held[d]["parameters"] == experts - experts // d
        assert held[1]["optimizer"] - held[d]["optimizer"] == 2 * (experts - experts // d)


def test_all_to_all_bytes_of_the_qwen3_preset_by_hand():
    """48 MoE layers, 16 x 4096 tokens a step, 8 rows of 2048 in bf16 each: dispatch and combine in the forward, again
    in full checkpointing's recompute, and in the backward."""
    cfg = load_config(QWEN)
    assert all_to_all_bytes(cfg.model, cfg.training) == 6 * 48 * (16 * 4096) * 8 * 2048 * 2


def test_expert_layouts_of_the_qwen3_shape_on_two_nodes():
    "One layer of it at 256 tokens on 16 GPUs: each degree that divides 128 and 16 under DDP and FSDP2, launch lines."
    cfg = load_config(QWEN, ["model.n_layers=1", "training.seq_len=256"])
    rows = plan_layouts(cfg, 16, "h100")
    assert [(r["parallel"], r["degree"]) for r in rows] == [(p, d) for p in ("ddp", "fsdp") for d in (1, 2, 4, 8, 16)]
    ddp = [r["peak_gib"] for r in rows if r["parallel"] == "ddp"]
    assert ddp == sorted(ddp, reverse=True) and len(set(ddp)) == 5  # fewer experts a GPU at each degree
    assert not any(r["refused"] for r in rows)  # FSDP2 with expert parallelism too: a 2-D mesh
    lines = layout_lines(rows, str(QWEN), 16, "h100", cfg.monitor.max_load_ratio)
    launches = [line.strip() for line in lines if "launch/" in line]
    assert len(launches) == 10 and all(line.startswith("NNODES=2 ") for line in launches), lines
    assert not any("not today:" in line for line in lines), lines


def test_layouts_in_json_and_the_refusals():
    r = run_in_process(cipher_plan, *SMALL, "--gpus", "4", "--layouts", "--json")
    assert r.returncode == 0, r.stderr
    layouts = json.loads(r.stdout)["layouts"]
    assert [(x["parallel"], x["degree"]) for x in layouts][:3] == [("ddp", d) for d in (1, 2, 4)]
    for extra, said in (
        (["training.expert_parallel=4", "--gpus", "2"], "must divide the number of ranks (2)"),
        (["model.moe.n_routed=0", "--layouts"], "--layouts splits routed experts"),
    ):
        r = run_in_process(cipher_plan, *SMALL, *extra)
        assert r.returncode == 2 and said in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
