"""Expert parallelism under FSDP2 (a 2-D mesh) on four gloo ranks: degree 2 trains as the 4-rank DDP run does, each rank
holding half of the experts and FSDP2 half of those; a save resumes at degree 1, and loads into a DDP model whole."""

import json
import shutil
import sys
import textwrap
from pathlib import Path

from conftest import ROOT, run_cli
from test_expert_parallel import close, rows

WORKER = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    import torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[2])  # tests/, for conftest
    from conftest import SMALL_MODEL
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from cipher_nb.config.load import load_config
    from cipher_nb.persist.checkpointer import restore_training_state
    from cipher_nb.train.builder import build_trainer

    out = Path(sys.argv[1])
    RUN = [*SMALL_MODEL, "model.moe.n_dense_layers=0", "data.source=mock", "training.device=cpu",
        "training.seq_len=32", "training.batch_size=2", "schedule.warmup_steps=1", "schedule.max_steps=5",
        "training.log_every=1", "training.checkpoint_every=3", "training.eval_every=1000", "training.eval_batches=1",
        "optim.grad_clip=0.5"]
    FSDP = "training.parallel=fsdp"

    def trainer(name, degree, resume=None, *extra):
        cfg = load_config(None, [*RUN, f"training.expert_parallel={degree}", *extra])
        return build_trainer(cfg, out / name, resume=resume, progress=False)

    trainer("ddp", 1).fit(progress=False)
    tr = trainer("fsdp_ep", 2, None, FSDP)
    split = tr.raw_model.expert_parallel
    shares = [[p.shape[0], p.to_local().numel() / p.numel()] for p in split.params]  # experts held, FSDP2's part
    tr.fit(progress=False)
    saved = out / "fsdp_ep/checkpoints/step_0000003"
    tr = trainer("ep_to_fsdp", 1, str(saved), FSDP)  # at degree 1: every expert on every rank, FSDP2 over all
    opts = StateDictOptions(full_state_dict=True)
    want = {k: v.detach().clone() for k, v in get_model_state_dict(tr.raw_model, options=opts).items()}
    tr.fit(progress=False)
    ddp = trainer("ddp_load", 1)  # the same save read by a DDP model: plain tensors, every expert
    restore_training_state(saved, ddp.model, ddp.optimizer)
    got = ddp.raw_model.state_dict()
    err = max(((got[k] - v).norm() / v.norm()).item() for k, v in want.items())
    moments = sorted({tuple(ddp.optimizer.state[p]["exp_avg"].shape) for n, p in ddp.raw_model.named_parameters()
                      if ".experts." in n})
    if dist.get_rank() == 0:
        (out / "checks.json").write_text(json.dumps(dict(shares=shares, weights_err=err, moments=moments)))
    dist.barrier()
    os._exit(0)  # no interpreter teardown: gloo's threads at shutdown sometimes abort a rank after the work passed
""")


def test_fsdp2_with_degree_two_trains_as_data_parallel_and_resumes_whole(tmp_path):
    """torchrun, 4 CPU ranks: degree 2 under FSDP2 gives the 4-rank DDP run's losses and gradient norms (1e-4
    relative), each rank holding 2 of the 4 experts (FSDP2 half of those); its step-3 save resumed at degree 1 continues
    the losses, and a DDP model reads the same weights (all experts) and optimizer moments from it; record.json states
    the mesh."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    env = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    args = ["--standalone", "--nproc_per_node=4", str(script), str(tmp_path), str(ROOT / "tests")]
    r = run_cli(torchrun, *args, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    ddp, ep = rows(tmp_path / "ddp"), rows(tmp_path / "fsdp_ep")
    assert sorted(ddp) == sorted(ep) == list(range(1, 6))
    for s in ddp:
        assert close(ddp[s][0], ep[s][0]) and close(ddp[s][1], ep[s][1]), (s, ddp[s], ep[s])
    resumed = rows(tmp_path / "ep_to_fsdp")
    assert sorted(resumed) == [4, 5], resumed
    for s in resumed:
        assert close(resumed[s][0], ep[s][0]), (s, resumed[s], ep[s])
    checks = json.loads((tmp_path / "checks.json").read_text())
    assert checks["shares"] == [[2, 0.5]] * 6, checks  # 2 layers x 3 weights: 2 of 4 experts, half of them local
    assert checks["weights_err"] <= 1e-6 and checks["moments"] == [[4, 64, 64]], checks
    layout = json.loads((tmp_path / "fsdp_ep/record.json").read_text())["kernels"]["expert_parallel"]
    assert (layout["mesh"], layout["groups"], layout["share"]) == ({"dp": 2, "ep": 2}, [[0, 1], [2, 3]], 0.5)
