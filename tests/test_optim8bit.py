"""8-bit AdamW under FSDP2 (torchao's `AdamW8bit` on DTensor parameters), two gloo ranks under torchrun: a run resumed
from a checkpoint ends bit-identical to an uninterrupted one, and a background (DCP `async_save`) save of the
optimizer's 8-bit state equals a blocking save of the same step and resumes to the same weights."""

import json
import sys
import textwrap
from pathlib import Path

import torch
from conftest import SMALL_MODEL, run_cli

BIN = Path(sys.executable).parent
SETTINGS = [  # a small FSDP2 run on CPU with the 8-bit optimizer
    *SMALL_MODEL,
    "training.seq_len=64",
    "training.batch_size=4",
    "training.eval_batches=1",
    "schedule.warmup_steps=1",
    "schedule.max_steps=4",
    "training.log_every=1",
    "training.checkpoint_every=2",
    "training.eval_every=2",
    "training.parallel=fsdp",
    "training.device=cpu",
    "optim.name=adamw8bit",
]
# torchao compiles its step once per parameter shape, which on two CPU cores costs more than the rest of this file;
# what is checked here (exact resume, background == blocking) does not depend on it, so the step runs eagerly.
# The compiled step on DTensor parameters is checked in nbs/08a_optim_optimizers.ipynb.
ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}


def train(out: Path, *overrides, resume: Path | None = None):
    "cipher-train on two gloo ranks (--standalone: torchrun picks a free rendezvous port)."
    options = ["--resume", str(resume)] if resume else []
    return run_cli(
        str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "--no-python",
        "cipher-train", *SETTINGS, *overrides, "--out", str(out), *options, "--quiet", env=ENV, timeout=300,
    )  # fmt: skip


def test_resumed_adamw8bit_fsdp_run_ends_bit_identical(tmp_path):
    "4 steps straight (blocking saves) == resume from its step-2 checkpoint to 4 (saving in the background)."
    from safetensors.torch import load_file

    a, b = tmp_path / "straight", tmp_path / "resumed"
    r = train(a)
    assert r.returncode == 0, r.stderr[-4000:]
    meta = json.loads((a / "checkpoints/step_0000002/meta.json").read_text())
    assert meta["optimizer"] == "adamw8bit-torchao"  # the implementation that ran, in the checkpoint's meta
    assert json.loads((a / "record.json").read_text())["optimizer"]["kind"] == "adamw8bit-torchao"  # and the record
    r = train(b, "training.background_save=true", resume=a / "checkpoints/step_0000002")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "resumed from" in r.stderr and "at step 2" in r.stderr, r.stderr[-2000:]
    ck = b / "checkpoints/step_0000004"  # written by the background path, complete
    assert (ck / "COMPLETE").is_file() and not list((b / "checkpoints").glob(".tmp-*"))
    assert sorted(p.name for p in (ck / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    rows = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    la = [(x["step"], x["loss"]) for x in rows if "loss" in x]
    assert la[2:] == [(x["step"], x["loss"]) for x in rows_b if "loss" in x and x["step"] > 2]
    wa, wb = load_file(a / "final/model.safetensors"), load_file(b / "final/model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


WORKER = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from cipher_nb.persist.files import is_complete, load_checkpoint, is_subclass_state
    from cipher_nb.persist.checkpointer import Checkpointer, training_state, restore_training_state
    from cipher_nb.config.load import Config
    from cipher_nb.optim.optimizers import build_optimizer, optimizer_kind

    dist.init_process_group('gloo')
    rank, run = dist.get_rank(), sys.argv[1]
    cfg = Config()
    cfg.optim.name, cfg.schedule.lr = 'adamw8bit', 1e-2

    def build(seed):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))   # 8192-element weights: 8-bit
        for layer in (m[0], m[2]): fully_shard(layer)
        fully_shard(m)
        return m, build_optimizer(m, cfg.optim, cfg.schedule.lr)

    def step(m, opt, i):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * i + rank))
        loss = m(x).pow(2).mean(); opt.zero_grad(); loss.backward(); opt.step()

    m, opt = build(0)
    assert optimizer_kind(opt) == 'adamw8bit-torchao', optimizer_kind(opt)
    for i in range(2): step(m, opt, i)
    state = lambda: training_state(m, opt, step=2, tokens=32, data_state=dict(rank=rank))
    assert is_subclass_state(opt.state[m[0].weight]['exp_avg'])
    blocking = Checkpointer(f'{run}/blocking', keep_last=2)
    blocking.save(2, state(), dict(step=2))
    background = Checkpointer(f'{run}/background', keep_last=2, background=True)
    background.save(2, state(), dict(step=2))
    for i in range(2, 5): step(m, opt, i)          # training goes on, changing every tensor the save holds
    background.close()
    a, b = f'{run}/blocking/step_0000002', f'{run}/background/step_0000002'
    assert is_complete(b)
    want = [p.full_tensor().clone() for p in m.parameters()]   # step 5; loading below reads into the live tensors

    def template():
        t = training_state(m, opt, step=0)
        return dict(model=t['model'], optimizer=t['optimizer'])

    def plain(x):
        "A DTensor's shard; a subclass's inner tensors, by name."
        x = x.to_local() if hasattr(x, 'to_local') else x
        if is_subclass_state(x): return {n: getattr(x, n).clone() for n in x.__tensor_flatten__()[0]}
        return x.clone() if isinstance(x, torch.Tensor) else x

    def flat(x, k=''):
        if isinstance(x, dict): return [y for n, v in sorted(x.items(), key=str) for y in flat(v, f'{k}/{n}')]
        if isinstance(x, (list, tuple)): return [y for i, v in enumerate(x) for y in flat(v, f'{k}/{i}')]
        return [(k, plain(x))]

    def same(x, y):
        if isinstance(x, dict): return x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x)
        return torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y

    live = dict(flat(template()))
    got, saved = flat(load_checkpoint(b, template())), flat(load_checkpoint(a, template()))
    assert [k for k, _ in got] == [k for k, _ in saved]
    bad = [k for (k, x), (_, y) in zip(got, saved) if not same(x, y)]
    assert not bad, bad
    n8 = sum(isinstance(x, dict) for _, x in got)
    assert n8 == 4, n8                            # exp_avg and exp_avg_sq of both weights, in 8 bits
    assert all(not same(x, live[k]) for k, x in got if isinstance(x, dict))   # the live state moved on since

    m2, opt2 = build(1)                             # other weights, fresh optimizer: resume from the background save
    restore_training_state(b, m2, opt2)
    for i in range(2, 5): step(m2, opt2, i)
    for w, q in zip(want, m2.parameters()): assert torch.equal(w, q.full_tensor())
    print(f'rank {rank} ok {len(got)} entries equal, {n8} of them 8-bit', flush=True)
    dist.barrier()
    os._exit(0)  # no interpreter teardown: gloo's threads at shutdown sometimes abort a rank
""")


def test_background_save_of_8bit_state_equals_a_blocking_save(tmp_path):
    "A background save of step 2, overlapped by three steps, equals a blocking save and resumes to the same weights."
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    r = run_cli(
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(script), str(tmp_path), env=ENV, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "rank 0 ok" in r.stdout and "rank 1 ok" in r.stdout, r.stdout
    ck = tmp_path / "background/step_0000002"
    assert sorted(p.name for p in (ck / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert "sharded/__1_0.distcp" in (ck / "COMPLETE").read_text()
