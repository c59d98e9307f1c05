"""Loss-free balancing under every plan, each against a hand count: the tokens each MoE block saw in a step's forwards
(not the recomputations of a checkpointed backward), routed again one token at a time with the block's router weights
and bias and counted, are the load the step applies, and the bias ends where `apply_load` of those counts moves a fresh
block's copy of it, plus the first steps' share of the solved shift, solved by hand on each forward and averaged over
the step's forwards. Plans: selective and full activation checkpointing, a stack mixing dense and MoE layers, a
recurrent core (every loop's tokens count, the loops without gradients too), the byte hourglass, FSDP2 over two gloo
ranks, a stopped and resumed run; and the bookkeeping reads no value on the host. Weight averaging averages the biases
with the weights: nbs/08d_optim_ema.ipynb and tests/test_ema.py."""

import dataclasses
import tempfile
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torch.utils.checkpoint
from conftest import RESUME, RESUME_EVERY, RESUME_STEPS, rows, run_in_process, same_weights, shift_by_hand

from cipher_nb.config.load import ModelConfig, load_config
from cipher_nb.core import DistEnv
from cipher_nb.model.lm import CipherModel
from cipher_nb.model.moe import MoE, moe_layers, set_solving, update_moe_biases
from cipher_nb.optim.parallel import parallelize
from cipher_nb.train.builder import MoEBalancing

TINY = [
    "model.d_model=32",
    "model.attention.n_heads=2",
    "model.attention.n_kv_heads=1",
    "model.attention.head_dim=16",
    "model.n_layers=3",  # the first dense (model.moe.n_dense_layers=1), two MoE
    "model.moe.n_routed=4",
    "model.moe.top_k=2",
    "model.moe.expert_d_ff=32",
    "training.device=cpu",
]
RECURRENT = [  # a dense prelude, an MoE core looped three times (the first without gradients), an MoE coda
    *TINY,
    "model.recurrence.n_prelude=1",
    "model.recurrence.n_core=1",
    "model.recurrence.n_coda=1",
    "model.recurrence.n_loops=3",
    "model.recurrence.backprop_loops=2",
]
PLANS = {  # overrides, then the forwards each MoE block runs per micro-batch (main layer index: count)
    "selective": ([*TINY, "training.activation_checkpoint=selective"], {1: 1, 2: 1}),
    "full": ([*TINY, "training.activation_checkpoint=full"], {1: 1, 2: 1}),
    "mixed": ([*TINY, "model.n_layers=5", "model.moe.n_dense_layers=2"], {2: 1, 3: 1, 4: 1}),
    "recurrent": (RECURRENT, {1: 3, 2: 1}),
    "recurrent-selective": ([*RECURRENT, "training.activation_checkpoint=selective"], {1: 3, 2: 1}),
}


def hand_scores(moe: MoE, x):
    "The block's scores [N, E] of the tokens x [..., d]."
    m, w = moe.cfg.moe, moe.router.weight
    w = w.full_tensor() if hasattr(w, "full_tensor") else w  # FSDP2: whole in a block's forward, a shard outside it
    logits = F.linear(x.detach().reshape(-1, x.shape[-1]).float(), w.detach().float())  # [N, E], as the block routes
    return logits.sigmoid() if m.router_score == "sigmoid" else logits.softmax(-1)


def hand_counts(moe: MoE, x) -> list:
    "Each expert's assignments for the tokens x [..., d], each token's top-k picked in a plain loop."
    m, scores = moe.cfg.moe, hand_scores(moe, x)
    counts = [0] * m.n_routed
    for row in (scores + moe.expert_bias.float()).tolist():
        for e in sorted(range(m.n_routed), key=lambda e: -row[e])[: m.top_k]:  # ties to the lower index
            counts[e] += 1
    return counts


class HandCount:
    "Pre-forward hooks on every MoE block: the tokens of each forward while `on`, hand counted by `flush`."

    def __init__(self, model):
        self.blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]
        self.on, self.seen = False, []
        for i, (_, m) in enumerate(self.blocks):
            m.register_forward_pre_hook(partial(self.hook, i))
        self.reset()

    def reset(self):
        self.counts = [[0] * m.cfg.moe.n_routed for _, m in self.blocks]
        self.calls = [0] * len(self.blocks)
        self.shifts = [[] for _ in self.blocks]  # each micro-batch's solved shift (its loops averaged)

    def hook(self, i, mod, args):
        # only a reference: an op here would run inside selective checkpointing's record of the forward
        if self.on:
            self.seen.append((i, args[0]))

    def flush(self):
        "Add the hand counts and solved shifts of the forwards seen since the last flush (one micro-batch)."
        loops = [[] for _ in self.blocks]
        for i, x in self.seen:
            m = self.blocks[i][1]
            self.counts[i] = [a + b for a, b in zip(self.counts[i], hand_counts(m, x))]
            self.calls[i] += 1
            loops[i].append(shift_by_hand(hand_scores(m, x) + m.expert_bias.float(), m.cfg.moe.top_k))
        for i, shifts in enumerate(loops):
            if shifts:
                self.shifts[i].append(torch.stack(shifts).mean(0))
        self.seen = []


def first_steps_share(cfg, shifts: list, step: int):
    "What the bias takes after `step` of its solved shifts (one a micro-batch, on every rank): weighted and centred."
    s = torch.stack(shifts).mean(0)
    return (1 - step / cfg.moe.center_steps) * (s - s.mean())


def build(overrides, rank: int = 0, world: int = 1):
    "The model of `overrides` (the same weights on every rank), placed as its training section asks."
    cfg = load_config(None, overrides)
    torch.manual_seed(0)
    model = CipherModel(cfg.model).train()
    counter = HandCount(model)  # before FSDP2: its hooks see the blocks as they run
    model, _ = parallelize(model, cfg.training, DistEnv(rank, world), torch.device("cpu"))
    return model, counter


def batches(rank: int = 0, steps: int = 2, micro: int = 2):
    "Each step's micro-batches of token ids, different on every rank."
    g = torch.Generator().manual_seed(10 + rank)
    return [[torch.randint(0, 256, (2, 24 + 8 * rank), generator=g) for _ in range(micro)] for _ in range(steps)]


def train(model, counter, steps) -> list:
    "Optimizer steps as the trainer runs them, with its balancing callback: what each step counted and moved."
    opt, out, balance = torch.optim.SGD(model.parameters(), lr=0.5), [], MoEBalancing()
    trainer = SimpleNamespace(raw_model=model, schedule=SimpleNamespace(max_steps=None, planned=True), step=0)
    key = {id(m): k for k, m in moe_layers(model).items()}  # each block's stats key, checked by its hand count
    for step, micro in enumerate(steps, 1):
        counter.reset()
        balance.before_step(trainer)
        before = [m.expert_bias.clone() for _, m in counter.blocks]
        for x in micro:
            counter.on = True
            res = model(x, labels=x)
            counter.on = False  # a checkpointed block runs again in the backward: not a forward of the step
            balance.after_forward(trainer, res)
            counter.flush()
            (res.loss + sum(res.aux.values())).backward()
        pending = [balance.load[key[id(m)]].tolist() for _, m in counter.blocks]
        opt.step()
        opt.zero_grad(set_to_none=True)
        trainer.step = step
        balance.after_step(trainer)
        after = [m.expert_bias.clone() for _, m in counter.blocks]
        out.append(
            dict(hand=counter.counts, calls=counter.calls, pending=pending, before=before, after=after)
            | dict(shifts=counter.shifts)
        )
    return out


def expected_bias(cfg, before, counts, step: int, shift=None):
    "The bias a fresh block of model config `cfg` with bias `before` holds after `apply_load` of `counts` at `step`."
    ref = MoE(cfg)
    with torch.no_grad():
        ref.expert_bias.copy_(before)
    ref.apply_load(torch.tensor(counts), step, shift=shift)
    return ref.expert_bias


CASES = [(p, True) for p in PLANS] + [(p, False) for p, (o, _) in PLANS.items() if any("checkpoint=" in a for a in o)]


@pytest.mark.parametrize("plan,early_stop", CASES)
def test_every_block_counts_each_token_once(plan, early_stop):
    """Each MoE block's load is the hand count of its forwards (each loop of a core), and its bias moves by it and by
    the shift solved by hand on those forwards. A checkpointed backward stops recomputing once it has what it needs
    (early stop, the default), before the count; without the early stop it recomputes the whole forward, the count too,
    which must not count again."""
    overrides, runs = PLANS[plan]
    model, counter = build(overrides)
    assert [int(n.split(".")[1]) for n, _ in counter.blocks] == list(runs)  # the MoE layers, the dense ones skipped
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        steps = train(model, counter, batches())
    for step, s in enumerate(steps, 1):
        assert s["calls"] == [2 * n for n in runs.values()]  # two micro-batches, each loop of the core once
        for (name, m), hand, pending, before, after, shifts in zip(
            counter.blocks, s["hand"], s["pending"], s["before"], s["after"], s["shifts"]
        ):
            assert pending == hand, (plan, step, name)
            assert sum(hand) == 2 * 2 * 24 * m.cfg.moe.top_k * runs[int(name.split(".")[1])]
            shift = first_steps_share(m.cfg, shifts, step)  # solved on every loop's tokens
            assert shift.abs().sum() > 0 and not torch.equal(after, before), (plan, step, name)  # every block updates
            assert torch.allclose(after, expected_bias(m.cfg, before, hand, step, shift), atol=1e-6), (plan, step, name)


def test_byte_hourglass_counts_under_its_main_layers():
    "A byte model: its byte blocks are dense, and each main MoE layer's counts (over segments) come under its key."
    model, counter = build([*TINY, "model.boundary.enabled=true", "model.boundary.n_byte_layers=1"])
    key = {id(m): k for k, m in moe_layers(model).items()}
    assert sorted(key.values()) == ["layer1/expert_counts", "layer2/expert_counts"]
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    counter.on = True
    stats = model(x, labels=x).stats
    counter.on = False
    counter.flush()
    assert sorted(k for k in stats if k.endswith("expert_counts")) == sorted(key.values())
    for (name, m), hand in zip(counter.blocks, counter.counts):
        assert stats[key[id(m)]].tolist() == hand, name


FSDP = [*TINY, "training.parallel=fsdp", "training.activation_checkpoint=selective"]


def _fsdp_worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model, counter = build(FSDP, rank, world)
        assert type(model.layers[1].ffn.router.weight).__name__ == "DTensor"  # sharded
        steps = train(model, counter, batches(rank))
        torch.save(dict(names=[n for n, _ in counter.blocks], steps=steps), Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # no rank tears gloo down while the other still has FSDP2's collectives in flight
    finally:
        dist.destroy_process_group()


def test_fsdp2_ranks_end_each_step_with_the_same_biases():
    "FSDP2 (with selective checkpointing) on two gloo ranks: after each step both hold the bias of both ranks' counts."
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_fsdp_worker, args=(2, f"{d}/init", d), nprocs=2, join=True)
        ranks = [torch.load(Path(d) / f"rank{r}.pt") for r in range(2)]
    cfg = load_config(None, FSDP).model
    assert ranks[0]["names"] == ranks[1]["names"] == ["layers.1.ffn", "layers.2.ffn"]
    for step, (a, b) in enumerate(zip(ranks[0]["steps"], ranks[1]["steps"]), 1):
        assert a["pending"] == a["hand"] and b["pending"] == b["hand"]  # each rank counted its own tokens
        assert a["hand"] != b["hand"]  # ranks saw different tokens
        for layer in range(2):
            assert torch.equal(a["before"][layer], b["before"][layer])
            assert torch.equal(a["after"][layer], b["after"][layer])  # the ranks agree, bit for bit
            both = [x + y for x, y in zip(a["hand"][layer], b["hand"][layer])]
            assert not torch.equal(a["after"][layer], a["before"][layer])
            shift = first_steps_share(cfg, a["shifts"][layer] + b["shifts"][layer], step)  # both ranks' forwards
            want = expected_bias(cfg, a["before"][layer], both, step, shift)
            assert shift.abs().sum() > 0 and torch.allclose(a["after"][layer], want, atol=1e-6), (step, layer)


def biases(run, step: int) -> dict:
    "The balancing biases in a run's checkpoint of `step`, by name."
    from cipher_nb.persist.files import load_checkpoint

    model = load_checkpoint(run / f"checkpoints/step_{step:07d}")["model"]
    return {k: v for k, v in model.items() if k.endswith("expert_bias")}


def test_biases_resume_bit_exactly(straight_run, tmp_path, one_thread):
    "Stopped by SIGTERM after a step and resumed: the biases of every step checkpoint are the uninterrupted run's."
    from cipher_nb.train.cli import cipher_train

    run = tmp_path / "stopped"
    r = run_in_process(
        cipher_train, "--out", run, "--quiet", *RESUME, "--fault", f"sigterm@{RESUME_EVERY}", pos=["config"]
    )
    assert r.returncode == 0 and not (run / "final").exists(), r.stderr[-2000:]
    r = run_in_process(cipher_train, "--out", run, "--quiet", "--resume", "auto", *RESUME, pos=["config"])
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-3000:]
    for step in (RESUME_EVERY, RESUME_STEPS):
        want, got = biases(straight_run, step), biases(run, step)
        assert want and same_weights(got, want), step
    first, last = biases(run, RESUME_EVERY), biases(run, RESUME_STEPS)
    moved = [k for k, b in first.items() if b.abs().sum() > 0 and not torch.equal(b, last[k])]  # and went on moving
    assert sorted(moved) == sorted(first)  # every block's


# the first steps' solved shift inside a short plan: center_steps 3 needs CENTER_PLAN x 3 = 24 planned steps, and
# then steps 1 and 2 take it
SHIFTED = [*RESUME, "schedule.max_steps=24", "model.moe.center_steps=3"]


def test_biases_resume_bit_exactly_within_the_first_steps_shift(tmp_path, one_thread):
    """Stopped by SIGTERM after step 1, the first of the two steps whose bias takes the solved shift, and resumed: the
    resumed run solves again in step 2 and its biases end bit for bit where the uninterrupted run's do."""
    from cipher_nb.train.cli import cipher_train

    straight, run = tmp_path / "straight", tmp_path / "stopped"
    r = run_in_process(cipher_train, "--out", straight, "--quiet", *SHIFTED, pos=["config"])
    assert r.returncode == 0, r.stderr[-2000:]
    solved = [row["step"] for row in rows(straight) if any(k.endswith("_solved_shift") for k in row)]
    assert solved == [1, 2]  # the steps whose forwards solved (one log row a step)
    r = run_in_process(cipher_train, "--out", run, "--quiet", *SHIFTED, "--fault", "sigterm@1", pos=["config"])
    assert r.returncode == 0 and not (run / "final").exists(), r.stderr[-2000:]
    r = run_in_process(cipher_train, "--out", run, "--quiet", "--resume", "auto", *SHIFTED, pos=["config"])
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-3000:]
    assert [row["step"] for row in rows(run) if any(k.endswith("_solved_shift") for k in row)] == [1, 2]
    want, got = biases(straight, 24), biases(run, 24)  # the last checkpoint (older ones are rotated out)
    assert want and same_weights(got, want)


def test_bookkeeping_reads_no_value_on_the_host():
    """Under FakeTensorMode, where tensors have shapes but no values, a training forward and backward of the grouped
    path (the one without a sync by design), the load count and the bias update run: nothing read a value on the host
    (`.item()`, a data-dependent shape), which would raise, as the `bmm` path's capacity does."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    cfg = ModelConfig()  # the tiny-cpu preset's block
    moe = dataclasses.replace(cfg.moe, impl="grouped", balance_loss_weight=1e-3, n_pop_a=2)
    was = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # grouped_mm's shape function asks for bf16
    try:
        with FakeTensorMode():
            m = MoE(dataclasses.replace(cfg, moe=moe)).train()
            assert set_solving(m, 1)  # the first steps' solve too
            x = torch.randn(2, 16, cfg.d_model, requires_grad=True)
            balance = MoEBalancing()
            for _ in range(2):  # two micro-batches
                y, aux, stats = m(x)
                balance.after_forward(None, SimpleNamespace(stats=stats))
                ((y.float() ** 2).mean() + sum(aux.values())).backward()
            assert m.kernel == "grouped" and balance.load["expert_counts"].shape == (moe.n_routed,)
            assert update_moe_biases(m, balance.load, 1) == len(moe_layers(m)) == 1
            with pytest.raises(DataDependentOutputException):  # what a sync meets here
                MoE(dataclasses.replace(cfg, moe=dataclasses.replace(moe, impl="bmm"))).train()(x)
    finally:
        torch.set_default_dtype(was)
