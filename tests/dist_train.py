"Run under torchrun by test_train.py: train a small model with DDP or FSDP2, write a digest of the rank's full weights."

import hashlib
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from conftest import SMALL_MODEL  # this script runs from tests/

from cipher_nb.config.load import load_config
from cipher_nb.train.builder import build_trainer

out, parallel, extra = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]  # extra: more overrides
cfg = load_config(
    None,
    [
        *SMALL_MODEL,
        "training.seq_len=64",
        "training.batch_size=4",
        "training.eval_batches=2",
        "schedule.warmup_steps=2",
        "schedule.max_steps=6",
        "training.log_every=1",
        "training.checkpoint_every=3",
        "training.eval_every=3",
        f"training.parallel={parallel}",
        "training.device=cpu",
        *extra,
    ],
)
tr = build_trainer(cfg, out / "run")
tr.fit(progress=False)
digest = hashlib.sha256()
for name, p in sorted(tr.model.named_parameters()):
    t = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2 shards are DTensors
    digest.update(name.encode())
    digest.update(t.detach().cpu().numpy().tobytes())
losses = (
    [r["loss"] for r in map(json.loads, (out / "run/metrics.jsonl").read_text().splitlines()) if "loss" in r]
    if dist.get_rank() == 0
    else []
)
obj = [losses]
dist.broadcast_object_list(obj, src=0)
(out / f"rank{dist.get_rank()}.json").write_text(
    json.dumps(dict(sha=digest.hexdigest(), step=tr.step, loss_first=obj[0][0], loss_last=obj[0][-1]))
)
dist.barrier()
os._exit(0)  # no interpreter teardown: gloo's threads at shutdown sometimes abort a rank after the work has passed
