"""cipher_nb.optim.parallel in a training run: activation checkpointing keeps gradients and parameter names, compiled
blocks train like eager ones without recompiling, FSDP2 trains in bf16 with fp32 gradient reductions and resumes
bit for bit under torchrun."""

import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import ROOT, WIDTH_32, run_cli

from cipher_nb.config.load import load_config
from cipher_nb.model.lm import CipherModel
from cipher_nb.optim.parallel import AC_MODES, apply_ac, apply_compile, compile_count, model_blocks
from cipher_nb.train.builder import build_trainer

TINY = WIDTH_32
RECURRENT = [
    *TINY,
    "model.n_layers=3",
    "model.recurrence.n_prelude=1",
    "model.recurrence.n_core=1",
    "model.recurrence.n_coda=1",
    "model.recurrence.n_loops=3",
]
RUN = [
    "data.source=mock",
    "training.device=cpu",
    "training.seq_len=64",
    "training.batch_size=4",
    "schedule.warmup_steps=2",
    "schedule.max_steps=20",
    "training.log_every=1",
    "training.eval_every=1000",
    "training.checkpoint_every=1000",
]


def grads(overrides, mode):
    "Float64 gradients of one fixed batch through a model checkpointed with `mode`, and its state-dict keys."
    torch.manual_seed(0)
    m = CipherModel(load_config(None, overrides).model).double()
    keys = list(m.state_dict())
    apply_ac(m, mode)
    torch.manual_seed(1)
    x = torch.randint(0, 256, (2, 32))
    out = m(x, labels=x)
    (out.loss + sum(out.aux.values())).backward()
    return {n: p.grad for n, p in m.named_parameters() if p.grad is not None}, keys, list(m.state_dict())


@pytest.mark.parametrize("name,overrides", [("dense", [*TINY, "model.moe.n_routed=0"]), ("recurrent", RECURRENT)])
def test_checkpointing_keeps_gradients_and_names(name, overrides):
    "none / selective / full: the same float64 gradients, bit for bit, and the same state-dict keys."
    want, keys, _ = grads(overrides, "none")
    assert any(".layers.1." in k or k.startswith("layers.1.") for k in keys)
    for mode in AC_MODES[1:]:
        got, before, after = grads(overrides, mode)
        assert before == after == keys
        assert list(got) == list(want)
        for n in want:
            assert torch.equal(got[n], want[n]), (mode, n)


class GraphCounts:
    "A callback that notes dynamo's compiled-graph count after every optimizer step."

    def __init__(self):
        self.counts = []

    def after_step(self, trainer):
        self.counts.append(compile_count())


def train_losses(tmp_path, name, overrides):
    "The per-step losses of a 20-step run built by `build_trainer`, the graph counts, and the trainer."
    counts = GraphCounts()
    tr = build_trainer(load_config(None, [*RUN, *overrides]), tmp_path / name, callbacks=[counts], progress=False)
    tr.fit(progress=False)
    rows = [json.loads(r) for r in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], counts.counts, tr


def test_compiled_blocks_train_like_eager_without_recompiling(tmp_path):
    "training.compile on a dense model (with selective checkpointing): eager's losses, and no recompile after step 1."
    dense = [*TINY, "model.moe.n_routed=0", "training.activation_checkpoint=selective"]
    eager, _, _ = train_losses(tmp_path, "eager", dense)
    compiled, counts, tr = train_losses(tmp_path, "compiled", [*dense, "training.compile=true"])
    assert len(eager) == len(compiled) == 20
    assert max(abs(a - b) for a, b in zip(eager, compiled)) < 1e-3, (eager, compiled)
    assert eager[-1] < eager[0]
    assert counts[0] >= 1 and counts[-1] == counts[0], counts  # graphs compiled at step 1, none after
    assert [n for n, _ in model_blocks(tr.raw_model)] == ["layers.0", "layers.1"]
    assert "_orig_mod" not in "".join(tr.raw_model.state_dict())


def test_full_checkpointing_compiles():
    "training.compile with full checkpointing (no context_fn): a compiled block's loss and gradients equal eager's."
    torch.manual_seed(0)
    m = CipherModel(load_config(None, [*TINY, "model.moe.n_routed=0"]).model)
    ref = CipherModel(load_config(None, [*TINY, "model.moe.n_routed=0"]).model)
    ref.load_state_dict(m.state_dict())
    apply_compile(apply_ac(m, "full"))
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    got, want = m(x, labels=x).loss, ref(x, labels=x).loss
    got.backward(), want.backward()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for (n, a), b in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_compiled_moe_blocks_run_without_recompiling():
    "A compiled MoE model: the same loss as eager on every step, and no recompile after the first."
    torch.manual_seed(0)
    m = CipherModel(load_config(None, TINY).model)
    ref = CipherModel(load_config(None, TINY).model)
    ref.load_state_dict(m.state_dict())
    apply_compile(m)
    g, counts = torch.Generator().manual_seed(0), []
    for _ in range(4):
        x = torch.randint(0, 256, (2, 64), generator=g)
        got, want = m(x, labels=x).loss, ref(x, labels=x).loss
        got.backward()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        counts.append(compile_count())
    assert counts[-1] == counts[0], counts


WORKER = textwrap.dedent("""
    import hashlib, json, os, sys
    from pathlib import Path
    import torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[2])  # tests/, for conftest
    from conftest import SMALL_MODEL
    from cipher_nb.config.load import load_config
    from cipher_nb.optim.parallel import model_blocks
    from cipher_nb.train.builder import build_trainer

    out = Path(sys.argv[1])
    cfg = load_config(None, [*SMALL_MODEL, "data.source=mock", "training.device=cpu", "training.seq_len=64",
        "training.batch_size=4", "schedule.warmup_steps=2", "schedule.max_steps=6", "training.log_every=1",
        "training.checkpoint_every=3", "training.eval_every=1000", "training.parallel=fsdp",
        "training.precision=bf16", "training.activation_checkpoint=selective"])

    def digest(tr):
        h = hashlib.sha256()
        for name, p in sorted(tr.model.named_parameters()):
            h.update(name.encode())
            h.update(p.full_tensor().detach().float().numpy().tobytes())
        return h.hexdigest()

    class GradDtypes:
        grads = set()
        def after_backward(self, trainer):  # the reduced gradients, before the optimizer step clears them
            self.grads |= {str(p.grad.dtype) for p in trainer.model.parameters() if p.grad is not None}

    watch, seen = GradDtypes(), {}
    tr = build_trainer(cfg, out / "run", progress=False, callbacks=[watch])
    for name, blk in model_blocks(tr.raw_model):
        def hook(mod, args, name=name):
            seen[name] = str(mod.attn.wq.weight.dtype)
        blk.register_forward_pre_hook(hook)
    tr.fit(progress=False)
    policy = tr.raw_model.layers[0]._get_fsdp_state()._fsdp_param_group.mp_policy
    params = dict(tr.raw_model.named_parameters())
    resumed = build_trainer(cfg, out / "resumed", resume=str(out / "run/checkpoints/step_0000003"), progress=False)
    resumed.fit(progress=False)
    cfg.training.cpu_offload = True  # the shards on the host
    offloaded = build_trainer(cfg, out / "offloaded", progress=False)
    offloaded.fit(progress=False)
    offload_policy = type(offloaded.raw_model.layers[0]._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(dict(
        step=tr.step, forward_dtypes=seen, reduce_dtype=str(policy.reduce_dtype), param_dtype=str(policy.param_dtype),
        shard_dtypes=sorted({str(p.dtype) for p in params.values()}), grad_dtypes=sorted(watch.grads),
        sharded=all(type(p).__name__ == "DTensor" for p in params.values()),
        digest=digest(tr), resumed_digest=digest(resumed), resumed_step=resumed.step,
        offload_policy=offload_policy, offloaded_digest=digest(offloaded))))
    dist.barrier()
    os._exit(0)  # no interpreter teardown: gloo's threads at shutdown sometimes abort a rank after the work passed
""")


def test_fsdp2_trains_in_bf16_reduces_in_fp32_and_resumes_exactly(tmp_path):
    "torchrun, 2 CPU ranks (gloo): bf16 parameters in forward, fp32 shards and gradients, an exact resume, offload."
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    r = run_cli(
        torchrun,
        "--standalone",
        "--nproc_per_node=2",
        str(script),
        str(tmp_path),
        str(ROOT / "tests"),
        env={"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert ranks[0] == ranks[1]  # the same full weights on both ranks
    info = ranks[0]
    assert info["step"] == info["resumed_step"] == 6
    assert info["forward_dtypes"] == {"layers.0": "torch.bfloat16", "layers.1": "torch.bfloat16"}
    assert (info["param_dtype"], info["reduce_dtype"]) == ("torch.bfloat16", "torch.float32")
    assert info["shard_dtypes"] == info["grad_dtypes"] == ["torch.float32"] and info["sharded"]
    assert info["resumed_digest"] == info["digest"]  # 3 steps, a checkpoint, 3 more == 6 steps straight
    # training.cpu_offload: FSDP2's CPUOffloadPolicy, and on CPU (where nothing moves) the same weights
    assert info["offload_policy"] == "CPUOffloadPolicy" and info["offloaded_digest"] == info["digest"]
