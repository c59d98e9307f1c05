"""Expert parallelism (`training.expert_parallel`) on two gloo ranks: the dispatch with a rank whose experts receive no
token, degree 2 trains as the 2-rank data-parallel run does, a save at one degree resumes at the other, and the
refusals of what it does not support yet; with a weight average (`optim.ema`), final/ holds the data-parallel run's."""

import json
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import ROOT, SMALL_MODEL, run_cli, run_in_process, weights

from cipher_nb.config.load import ConfigError, load_config
from cipher_nb.model.moe import RoutedExperts
from cipher_nb.optim.expert_parallel import ExpertParallelExperts


def _experts():
    torch.manual_seed(0)
    ex = RoutedExperts(4, 16, 8)
    for w in ex.parameters():
        torch.nn.init.normal_(w, std=0.1)
    return ex


def _inputs(rank):
    "Rank r's tokens (a different count on each rank), all routed to experts 0 and 1: rank 1's experts get none."
    g = torch.Generator().manual_seed(10 + rank)
    n = 5 + 2 * rank
    idx = torch.stack([torch.arange(n) % 2, 1 - torch.arange(n) % 2], 1)
    return torch.randn(n, 16, generator=g), idx, torch.rand(n, 2, generator=g), torch.randn(n, 16, generator=g)


def _dispatch_worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        x, idx, gates, g = _inputs(rank)
        x.requires_grad_(True)
        ep = ExpertParallelExperts(_experts(), dist.new_group([0, 1]), 2, rank)
        y = ep(x, idx, gates, "grouped")
        (y * g).sum().backward()
        grads = [None if w.grad is None else w.grad.clone() for w in ep.parameters()]
        torch.save(dict(y=y.detach(), gx=x.grad, gw=grads), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_dispatch_matches_one_process_and_a_rank_without_tokens_computes_nothing():
    "Outputs, input gradients and expert gradients of both ranks equal one process's; rank 1 gets no token."
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_dispatch_worker, args=(2, f"{d}/init", d), nprocs=2, join=True)
        got = [torch.load(Path(d) / f"rank{r}.pt") for r in range(2)]
    ref = _experts()
    for r in range(2):
        x, idx, gates, g = _inputs(r)
        x.requires_grad_(True)
        y = ref(x, idx, gates, "grouped")
        (y * g).sum().backward()  # the weight gradients sum both ranks' tokens, as the dispatch's backward does
        torch.testing.assert_close(got[r]["y"], y.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[r]["gx"], x.grad, atol=1e-5, rtol=1e-5)
    for mine, full in zip(got[0]["gw"], ref.parameters()):
        torch.testing.assert_close(mine, full.grad[:2], atol=1e-5, rtol=1e-5)
        assert full.grad[2:].abs().max() == 0
    assert got[1]["gw"] == [None, None, None]  # computed nothing; `ExpertParallel.after_backward` counts zeros


WORKER = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    import torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[2])  # tests/, for conftest
    from conftest import SMALL_MODEL
    from cipher_nb.config.load import load_config
    from cipher_nb.optim.expert_parallel import full_layout
    from cipher_nb.train.builder import build_trainer

    out = Path(sys.argv[1])
    RUN = [*SMALL_MODEL, "model.moe.n_dense_layers=0", "data.source=mock", "training.device=cpu",
        "training.seq_len=32", "training.batch_size=2", "schedule.warmup_steps=1", "schedule.max_steps=6",
        "training.log_every=1", "training.checkpoint_every=3", "training.eval_every=1000", "training.eval_batches=1",
        "optim.grad_clip=0.5"]

    class FirstGrads:
        "The first step's averaged gradients, every expert gathered (after the split experts' own callback)."
        grads = None
        def after_backward(self, trainer):
            if self.grads is None:
                split = getattr(trainer.raw_model, "expert_parallel", None)
                full = lambda n, g: split.gather(g) if split is not None and n in split.names else g
                self.grads = {n: full(n, p.grad).clone() for n, p in trainer.raw_model.named_parameters()}

    def run(name, degree, resume=None, *extra):
        cfg = load_config(None, [*RUN, f"training.expert_parallel={degree}", *extra])
        first = FirstGrads()
        tr = build_trainer(cfg, out / name, resume=resume, progress=False, callbacks=[first])
        tr.fit(progress=False)
        with full_layout(tr.raw_model):
            weights = {n: p.detach().clone() for n, p in tr.raw_model.named_parameters()}
        if dist.get_rank() == 0:
            torch.save(dict(grads=first.grads, weights=weights), out / f"{name}.pt")

    run("ddp", 1)
    run("ep", 2)
    run("ep_to_ddp", 1, resume=str(out / "ep/checkpoints/step_0000003"))
    # with checkpointing too: the recomputed forward exchanges its rows again, on every rank alike
    run("ddp_to_ep", 2, str(out / "ddp/checkpoints/step_0000003"), "training.activation_checkpoint=full")
    # optim.ema: each rank averages its share of the experts; final/ holds the whole average, as data parallelism's
    run("ddp_ema", 1, None, "optim.ema=0.9")
    run("ep_ema", 2, None, "optim.ema=0.9")
    run("ep_ema_to_ddp", 1, str(out / "ep_ema/checkpoints/step_0000003"), "optim.ema=0.9")  # the average saved whole
    dist.barrier()
    os._exit(0)  # no interpreter teardown: gloo's threads at shutdown sometimes abort a rank after the work passed
""")


def rows(run: Path) -> dict:
    "step -> (loss, grad_norm) of a run's log rows."
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, lines) if "loss" in r}


def close(a, b, rel=1e-4):
    return abs(a - b) <= rel * max(abs(a), abs(b))


def test_degree_two_trains_as_data_parallel_and_resumes_at_the_other_degree(tmp_path):
    """torchrun, 2 CPU ranks: degree 2 gives the 2-rank DDP run's losses, gradient norms, gradients and weights (1e-4
    relative); a save at degree 2 resumed at degree 1, and one at degree 1 resumed at 2 (with activation checkpointing),
    continue the same losses; record.json states the layout and each rank's half of the expert parameters."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    r = run_in_torchrun(torchrun, script, tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    ddp, ep = rows(tmp_path / "ddp"), rows(tmp_path / "ep")
    assert sorted(ddp) == sorted(ep) == list(range(1, 7))
    for s in ddp:
        assert close(ddp[s][0], ep[s][0]) and close(ddp[s][1], ep[s][1]), (s, ddp[s], ep[s])
    assert ddp[6][0] < ddp[1][0]
    for name, base in (("ep_to_ddp", ep), ("ddp_to_ep", ddp)):
        resumed = rows(tmp_path / name)
        assert sorted(resumed) == [4, 5, 6], (name, resumed)
        for s in resumed:
            assert close(resumed[s][0], base[s][0]), (name, s, resumed[s], base[s])
    want, got = (torch.load(tmp_path / f"{n}.pt") for n in ("ddp", "ep"))
    for what in ("grads", "weights"):
        assert want[what].keys() == got[what].keys()
        for n, t in want[what].items():
            assert (got[what][n] - t).norm() <= 1e-4 * t.norm(), (what, n)  # relative, over the whole tensor
    ema = {n: weights(tmp_path / n / "final") for n in ("ddp_ema", "ep_ema", "ep_ema_to_ddp")}
    for n in ("ep_ema", "ep_ema_to_ddp"):
        assert ema[n].keys() == ema["ddp_ema"].keys()
        for k, t in ema["ddp_ema"].items():
            torch.testing.assert_close(ema[n][k], t, rtol=1e-5, atol=1e-5, msg=f"{n} {k}")
    assert not torch.equal(ema["ddp_ema"]["layers.0.ffn.experts.w_up"], want["weights"]["layers.0.ffn.experts.w_up"])
    layout = json.loads((tmp_path / "ep/record.json").read_text())["kernels"]["expert_parallel"]
    assert (layout["degree"], layout["groups"], layout["share"]) == (2, [[0, 1]], 0.5)
    assert layout["ranks"] == [dict(rank=0, experts=[0, 2]), dict(rank=1, experts=[2, 4])]
    assert layout["expert_params_per_rank"] * 2 == layout["expert_params"] > 0
    assert "expert_parallel" not in json.loads((tmp_path / "ddp/record.json").read_text())["kernels"]


def run_in_torchrun(torchrun, script, out):
    "The worker `script` on two CPU ranks under torchrun, writing into `out`."
    env = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    args = ["--standalone", "--nproc_per_node=2", str(script), str(out), str(ROOT / "tests")]
    return run_cli(torchrun, *args, env=env, timeout=600)


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["model.moe.n_routed=6", "training.expert_parallel=4"], "must divide model.moe.n_routed (6)"),
        (["model.moe.n_routed=0", "training.expert_parallel=2"], "no MoE layer"),
        (["model.moe.kind=shared_projection", "training.expert_parallel=2"], "shared-projection"),
        (["optim.name=adamw8bit", "training.expert_parallel=2"], "adamw8bit"),
    ],
)
def test_refusals_at_load(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_one_process_is_refused_before_the_run_starts(tmp_path):
    "cipher-train on one process with degree 2: exit 2, one line naming the key and the ranks; no run directory."
    from cipher_nb.train.cli import cipher_train

    out = tmp_path / "run"
    run = [*SMALL_MODEL, "data.source=mock", "schedule.warmup_steps=1", "training.expert_parallel=2"]
    r = run_in_process(cipher_train, "--out", str(out), "--quiet", *run, "--max-steps", "2", pos=["config"])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and "training.expert_parallel = 2 must divide the number of ranks (1)" in r.stderr, r
    assert len(lines) == 1, lines
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
