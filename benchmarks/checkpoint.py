"""Checkpoint save and load for the H100 preset's model with its AdamW state, next to the disk's own write speed;
with --fsdp, the step time of an FSDP2 run while it saves sharded checkpoints, blocking or in the background.

    python benchmarks/checkpoint.py [--config examples/configs/h100.yaml] [--repeats 3] [--dir DIR] [--device auto]
    torchrun --standalone --nproc_per_node=2 benchmarks/checkpoint.py --fsdp [--width 1024] [--depth 8] [--repeats 3]

Rows, all in one process on the same state: a blocking save (serialise while hashing with SHA-256, fsync, rename,
marker); the same `torch.save` + fsync with no hash and no marker (what the checksums cost a save); a background save
(what the training loop waits for: the copy to host memory, then the time until the thread has written it); a load
(`restore_training_state`, which checks every file's SHA-256 first); the SHA-256 of `state.pt` read back from disk
with hashlib alone (what the check costs a load); and a plain copy of the same `state.pt` with fsync, which is the
disk's own speed. The
last column divides each row's throughput by the disk copy's, so 1.0 means the save runs at the disk's limit.
Each number is the median of `--repeats` runs. The model is `cipher_nb.model.lm.CipherModel` when that module exists,
otherwise a stand-in with exactly the preset's parameter count (same bytes; checkpoint I/O does not care about shapes).

--fsdp (under torchrun; gloo on CPU, NCCL on GPUs): an MLP of `--depth` square layers of `--width`, each layer its own
FSDP2 unit, trained with AdamW on random batches. Rows: a step without a save; a step followed by a blocking sharded
save (the loop waits for the disk); a step followed by a background save (the loop waits for the copy to host memory
only); the steps that run while that background save is being written. The last column divides each by the step
without a save: the background rows should stay near 1.
"""

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_args import at_least, config_or_usage
from torch import nn

from cipher_nb.config.load import load_config
from cipher_nb.config.sizing import param_counts
from cipher_nb.core import resolve_device
from cipher_nb.persist.checkpointer import Checkpointer, checkpoint_meta, restore_training_state, training_state
from cipher_nb.persist.export import compare_state_dicts
from cipher_nb.persist.files import STATE, checkpoint_name, load_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parent.parent


class StandIn(nn.Module):
    "Parameters adding up to `n` exactly: the (tied) embedding, square-ish blocks, and a remainder vector."

    def __init__(self, n: int, vocab: int, d: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        left, blocks = n - vocab * d, []
        while left >= 4 * d * d:
            blocks.append(nn.Parameter(torch.randn(d, 4 * d) * 0.02))
            left -= 4 * d * d
        self.blocks = nn.ParameterList(blocks)
        self.rest = nn.Parameter(torch.zeros(left))


def build(cfg, device):
    try:
        from cipher_nb.model.lm import CipherModel

        return CipherModel(cfg.model).to(device), "cipher_nb.model.lm.CipherModel"
    except ImportError:
        n = param_counts(cfg.model)["total"]
        return StandIn(n, cfg.model.vocab, cfg.model.d_model).to(
            device
        ), f"stand-in with {n:,} parameters (cipher_nb.model.lm not found)"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "examples/configs/h100.yaml"))
    ap.add_argument("--repeats", type=at_least(1), default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--fsdp", action="store_true", help="step times around sharded saves (run under torchrun)")
    ap.add_argument("--width", type=at_least(1), default=1024, help="--fsdp: the MLP's width")
    ap.add_argument("--depth", type=at_least(1), default=8, help="--fsdp: the MLP's number of layers")
    ap.add_argument("--batch", type=at_least(1), default=256, help="--fsdp: rows per step and rank")
    a = ap.parse_args()
    if a.fsdp:
        return fsdp_main(a)

    cfg = config_or_usage(ap, load_config, a.config)
    device = resolve_device(a.device)
    model, what = build(cfg, device)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.schedule.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay
    )
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)  # AdamW's exp_avg / exp_avg_sq now exist
    n_params = sum(p.numel() for p in model.parameters())
    work = Path(a.dir or tempfile.mkdtemp(prefix="cipher-ckpt-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    meta = checkpoint_meta(cfg, step=1, tokens=0)
    print(f"model: {what}; {n_params:,} parameters on {device}; AdamW state; writing to {work}")

    def state():
        return training_state(model, opt, step=1, tokens=0, data_state=dict(offset=0))

    def fresh(p):
        shutil.rmtree(p, ignore_errors=True)
        return p

    # one Checkpointer for the background rows, as in training: its host buffers are allocated by the first save only
    bg = Checkpointer(work / "bg", keep_last=1, background=True)
    t0 = time.perf_counter()
    bg.save(0, state(), meta)
    cold = time.perf_counter() - t0
    bg.wait()
    saves, copies, waits, bgs, loads, plains, hashes = [], [], [], [], [], [], []
    for r in range(a.repeats):  # round-robin, so the machine's noise spreads over every row alike
        t0 = time.perf_counter()
        path = save_checkpoint(fresh(work / "ck") / "step_0000001", state(), meta)
        saves.append(time.perf_counter() - t0)
        dst = work / "copy.bin"
        if dst.exists():
            dst.unlink()
        t0 = time.perf_counter()
        shutil.copyfile(path / STATE, dst)
        with open(dst, "rb+") as f:
            os.fsync(f.fileno())
        copies.append(time.perf_counter() - t0)
        dst.unlink()
        t0 = time.perf_counter()
        with open(dst, "wb") as f:
            torch.save(state(), f)
            f.flush()
            os.fsync(f.fileno())
        plains.append(time.perf_counter() - t0)
        dst.unlink()
        t0 = time.perf_counter()
        h = hashlib.sha256()
        with open(path / STATE, "rb") as f:
            while b := f.read(1 << 22):
                h.update(b)
        hashes.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        bg.save(r + 1, state(), meta)
        waits.append(time.perf_counter() - t0)
        bg.wait()
        bgs.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        restore_training_state(path, model, opt)
        sync(device)
        loads.append(time.perf_counter() - t0)
    med = statistics.median
    t_save, t_copy, t_blocked, t_bg, t_load = med(saves), med(copies), med(waits), med(bgs), med(loads)
    t_plain, t_hash = med(plains), med(hashes)
    nbytes, state_bytes = dir_bytes(path), (path / STATE).stat().st_size

    mb = nbytes / 1e6
    disk = state_bytes / 1e6 / t_copy
    rows = [
        ("save, blocking", t_save, nbytes, f"{mb / t_save / disk:.2f}"),
        ("torch.save + fsync, no hash, no marker", t_plain, state_bytes, f"{state_bytes / 1e6 / t_plain / disk:.2f}"),
        ("save, background: loop waits, first save", cold, nbytes, f"{cold / t_save:.2f} x blocking time"),
        ("save, background: loop waits (copy to host)", t_blocked, nbytes, f"{t_blocked / t_save:.2f} x blocking time"),
        ("save, background: until written", t_bg, nbytes, f"{mb / t_bg / disk:.2f}"),
        ("load (restore_training_state)", t_load, nbytes, f"{mb / t_load / disk:.2f}"),
        ("SHA-256 of state.pt read back (hashlib)", t_hash, state_bytes, f"{state_bytes / 1e6 / t_hash / disk:.2f}"),
        ("disk: plain copy of state.pt + fsync", t_copy, state_bytes, "1.00"),
    ]
    print(
        f"\ncheckpoint: {nbytes / 2**30:.2f} GiB in {len(list(path.rglob('*')))} files "
        f"(state.pt {state_bytes / 2**30:.2f} GiB); median of {a.repeats}\n"
    )
    print(f"| {'what':<46} | {'seconds':>8} | {'GiB':>6} | {'MB/s':>7} | {'vs disk copy':>18} |")
    print(f"|{'-' * 48}|{'-' * 9}:|{'-' * 7}:|{'-' * 8}:|{'-' * 19}:|")
    for name, t, b, ratio in rows:
        print(f"| {name:<46} | {t:8.3f} | {b / 2**30:6.2f} | {b / 1e6 / t:7.0f} | {ratio:>18} |")
    # the numbers mean nothing if what was written is wrong: the background checkpoint must equal the live state
    saved = load_checkpoint(work / "bg" / checkpoint_name(a.repeats))
    live = model.state_dict()
    bad = compare_state_dicts({k: v.cpu() for k, v in live.items()}, saved["model"])
    bad += [
        f"optimizer {k}"
        for k, v in opt.state_dict()["state"].items()
        if any(not torch.equal(t.cpu(), saved["optimizer"]["state"][k][n]) for n, t in v.items() if torch.is_tensor(t))
    ]
    print(
        "\nchecked: the last background checkpoint equals the live model and optimizer "
        f"({len(live)} + {len(opt.state_dict()['state'])} entries): " + ("yes" if not bad else f"NO: {bad[:5]}")
    )
    if not a.dir:
        shutil.rmtree(work, ignore_errors=True)
    if bad:
        sys.exit(1)


def fsdp_main(a):
    "Step times of an FSDP2 run: no save, a blocking sharded save, a background one and the steps it overlaps."
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    device = resolve_device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(a.width, a.width), nn.GELU()) for _ in range(a.depth)]).to(device)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n_params = sum(p.numel() for p in model.parameters())

    def step() -> float:
        t0 = time.perf_counter()
        x = torch.randn(a.batch, a.width, device=device)
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()  # the step is done on the device too
        return time.perf_counter() - t0

    root = Path(a.dir or tempfile.mkdtemp(prefix="cipher-ckpt-fsdp-"))
    obj = [str(root)]
    dist.broadcast_object_list(obj, src=0)  # every rank writes into rank 0's directory
    work = Path(obj[0])
    cfg = load_config(None, ["training.parallel=fsdp"])

    def save(ck, s) -> float:
        t0 = time.perf_counter()
        ck.save(s, training_state(model, opt, step=s), checkpoint_meta(cfg, step=s))
        return time.perf_counter() - t0

    for _ in range(3):  # warm up: allocator, optimizer state, threads
        step()
    blocking = Checkpointer(work / "blocking", keep_last=1)
    background = Checkpointer(work / "background", keep_last=1, background=True)
    save(background, 0)  # the first background save also makes its process group
    background.wait()
    plain, with_block, with_bg, overlapped, write_s = [], [], [], [], []
    for r in range(a.repeats):
        plain += [step() for _ in range(3)]
        with_block.append(step() + save(blocking, r + 1))
        t_step = step()
        t0 = time.perf_counter()
        with_bg.append(t_step + save(background, r + 1))
        while background._thread is not None and background._thread.is_alive():
            overlapped.append(step())
        background.wait()
        write_s.append(time.perf_counter() - t0)
    med = statistics.median
    base = med(plain)
    rows = [
        ("step, no save", base, len(plain)),
        ("step + blocking sharded save", med(with_block), len(with_block)),
        ("step + background save (the loop's wait)", med(with_bg), len(with_bg)),
        ("steps while the background save writes", med(overlapped) if overlapped else float("nan"), len(overlapped)),
        ("background save, from its call to complete", med(write_s), len(write_s)),
    ]
    if rank == 0:
        ck = work / "background" / checkpoint_name(a.repeats)
        print(
            f"FSDP2 on {world} ranks ({device.type}), MLP {a.depth} x {a.width}: {n_params:,} parameters, AdamW; "
            f"checkpoint {dir_bytes(ck) / 2**20:.1f} MiB; medians over {a.repeats} saves\n"
        )
        print(f"| {'what':<42} | {'seconds':>8} | {'n':>3} | {'vs step, no save':>16} |")
        print(f"|{'-' * 44}|{'-' * 9}:|{'-' * 4}:|{'-' * 17}:|")
        for name, t, n in rows:
            print(f"| {name:<42} | {t:8.3f} | {n:3d} | {t / base:16.2f} |")
    dist.barrier()
    if rank == 0 and not a.dir:
        shutil.rmtree(work, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
