"""The recurrent core's additions on CPU, at equal steps: plain (linear injection) vs + ACT halting vs + LTI injection
vs + per-loop LoRA vs all three. A small byte-level model (dense FFN, 1 prelude + 1 core x n_loops + 1 coda block)
trains on the running Python's standard-library source; held-out files score it.

    python benchmarks/recurrence.py --steps 300 --seeds 0 1

Prints a markdown table: held-out loss (nats/byte) at the loop cap, the last 20 training losses' mean, evaluation
loops per token (ACT) and loops the batch ran, seconds per training step."""

import argparse
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from bench_args import at_least

from cipher_nb.config.load import model_config
from cipher_nb.model.lm import CipherModel

VARIANTS = {
    "plain (linear)": {},
    "+ ACT": {"halting": True},
    "+ LTI": {"injection": "lti"},
    "+ LoRA r4": {"loop_lora_rank": 4},
    "all three": {"halting": True, "injection": "lti", "loop_lora_rank": 4},
}


def stdlib_split(heldout: int = 8) -> tuple:
    "Bytes of the standard library's top-level modules: (training files, the last `heldout` files)."
    files = sorted(Path(os.__file__).parent.glob("*.py"))
    read = lambda fs: torch.from_numpy(  # noqa: E731
        np.frombuffer(b"\n".join(f.read_bytes() for f in fs), dtype=np.uint8).astype(np.int64)
    )
    return read(files[:-heldout]), read(files[-heldout:])


def config(n_loops: int, **rec):
    cfg = model_config(d_model=64, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=32, n_routed=0)
    return replace(cfg, recurrence=replace(cfg.recurrence, n_prelude=1, n_core=1, n_coda=1, n_loops=n_loops, **rec))


def batch(data, g, B, T):
    i = torch.randint(0, len(data) - T - 1, (B,), generator=g)
    x = torch.stack([data[j : j + T + 1] for j in i])
    return x[:, :-1], x[:, 1:]


def run(rec: dict, seed: int, steps: int, n_loops: int, B=8, T=128, lr=3e-3) -> dict:
    train, held = stdlib_split()
    torch.manual_seed(seed)
    m = CipherModel(config(n_loops, **rec)).train()
    opt = torch.optim.AdamW(m.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    g, losses = torch.Generator().manual_seed(seed), []
    t0 = time.perf_counter()
    for _ in range(steps):
        x, y = batch(train, g, B, T)
        out = m(x, labels=y)
        (out.loss + sum(out.aux.values())).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    step_s = (time.perf_counter() - t0) / steps
    m.eval()
    ge, ev, per_token, ran = torch.Generator().manual_seed(1234), [], [], []
    with torch.no_grad():
        for _ in range(16):
            x, y = batch(held, ge, B, T)
            out = m(x, labels=y)
            ev.append(out.loss.item())
            per_token.append(out.stats.get("loop/mean_loops", torch.tensor(float(n_loops))).item())
            ran.append(len(out.stats["loop/norm"]))
    return dict(
        heldout=float(np.mean(ev)),
        train=float(np.mean(losses[-20:])),
        loops_token=float(np.mean(per_token)),
        loops_batch=float(np.mean(ran)),
        step_s=step_s,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=at_least(1), default=300)
    ap.add_argument("--seeds", type=at_least(0), nargs="+", default=[0, 1])
    ap.add_argument("--loops", type=at_least(1), default=4)
    a = ap.parse_args()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    print(f"{a.steps} steps, seeds {a.seeds}, n_loops {a.loops}, torch {torch.__version__}, {os.cpu_count()} CPUs\n")
    print("| variant | held-out loss | train loss (last 20) | eval loops/token | eval loops/batch | s/step |")
    print("|---|---|---|---|---|---|")
    for name, rec in VARIANTS.items():
        rs = [run(rec, s, a.steps, a.loops) for s in a.seeds]
        mean = {k: np.mean([r[k] for r in rs]) for k in rs[0]}
        spread = np.ptp([r["heldout"] for r in rs]) if len(rs) > 1 else 0.0
        print(
            f"| {name} | {mean['heldout']:.3f} (range {spread:.3f}) | {mean['train']:.3f} | "
            f"{mean['loops_token']:.2f} | {mean['loops_batch']:.2f} | {mean['step_s']:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
