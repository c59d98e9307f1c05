"""Run under torchrun by test_ema.py: an FSDP2 run with optim.ema straight to its end, then the same run resumed from
its half-way checkpoint, in one launch; each rank writes whether its shards of the average and weights agree, and its
averaged balancing biases."""

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from conftest import RESUME, RESUME_STEPS  # this script runs from tests/

from cipher_nb.config.load import load_config
from cipher_nb.train.builder import build_trainer

out = Path(sys.argv[1])
cfg = load_config(
    None,
    [*RESUME, "model.dropout=0.0", "training.parallel=fsdp", "training.device=cpu", "optim.ema=0.9"],
)
a = build_trainer(cfg, out / "a", progress=False)
a.fit(progress=False)
if dist.get_rank() == 0:  # the run as a kill after its half-way checkpoint leaves it
    shutil.copytree(out / "a", out / "b", ignore=shutil.ignore_patterns("final", f"step_{RESUME_STEPS:07d}"))
dist.barrier()
b = build_trainer(cfg, out / "b", resume="auto", progress=False)
b.fit(progress=False)


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


avg_a, avg_b = a.checkpoints.average, b.checkpoints.average
params_b = dict(b.raw_model.named_parameters())
result = dict(
    sharded=all(hasattr(t, "to_local") for t in avg_a.weights.values()),
    same_average=all(torch.equal(local(t), local(avg_b.weights[n])) for n, t in avg_a.weights.items()),
    same_weights=all(torch.equal(local(p), local(params_b[n])) for n, p in a.raw_model.named_parameters()),
    same_biases=bool(avg_a.buffers) and all(torch.equal(t, avg_b.buffers[n]) for n, t in avg_a.buffers.items()),
    biases={n: t.tolist() for n, t in avg_a.buffers.items()},
    bias_bytes=4 * sum(t.numel() for t in avg_a.buffers.values()),
    updates=[avg_a.updates, avg_b.updates],
    bytes=avg_a.nbytes(),
)
(out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
dist.barrier()
os._exit(0)  # no interpreter teardown: gloo's threads at shutdown sometimes abort a rank after the work has passed
