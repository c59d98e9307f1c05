"""Peak memory and time of the LM loss, forward + backward, at the H100 preset's output shape: the chunked fused
cross-entropy of `cipher_nb.model.lm` against the plain path (full logits, then `F.cross_entropy`), side by side.

    python benchmarks/loss_memory.py [--tokens 8192] [--vocab 32768] [--d-model 512] [--chunk 1024] [--reps 2]
        [--device cpu]

Tokens default to one micro-batch of the preset (4 x 2048). Peak memory is the peak of live tensor bytes during the
call, tracked by torch's `MemTracker` (any device; on CUDA also `max_memory_allocated`). Time is the best of `--reps`.
Goal (issue 5): the chunked path at most a quarter of the plain path's peak, at no more than 1.3x its time.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from cipher_nb.model.lm import fused_cross_entropy


def plain(h, w, y, chunk):
    "The reference: every logit at once."
    return F.cross_entropy((h @ w.t()).float(), y, ignore_index=-100)


def chunked(h, w, y, chunk):
    "Ours: `chunk` rows of logits at a time, gradients made in the forward pass."
    return fused_cross_entropy(h, w, y, chunk)


def measure(fn, h, w, y, chunk, reps, device):
    "Best time of `reps` forward + backward passes, and the peak of live tensor bytes in one of them."
    times = []
    for _ in range(reps):
        h.grad = w.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(h, w, y, chunk).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    h.grad = w.grad = None
    mt = MemTracker()
    with mt:
        fn(h, w, y, chunk).backward()
    peak = mt.get_tracker_snapshot("peak")[device]["Total"]
    return min(times), peak


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4 * 2048)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(a.tokens, a.d_model, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(a.vocab, a.d_model, generator=g) * 0.02).to(device, dtype).requires_grad_()
    y = torch.randint(0, a.vocab, (a.tokens,), generator=g).to(device)
    rows = {
        name: measure(fn, h, w, y, a.chunk, a.reps, device) for name, fn in (("plain", plain), ("chunked", chunked))
    }
    pt, pm = rows["plain"]
    print(
        f"loss forward + backward: {a.tokens} tokens, vocab {a.vocab}, d_model {a.d_model}, chunk {a.chunk}, "
        f"{device.type} {str(dtype).replace('torch.', '')}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'path':<10}{'seconds':>10}{'x plain':>10}{'peak MiB':>12}{'x plain':>10}")
    for name, (t, m) in rows.items():
        print(f"{name:<10}{t:>10.3f}{t / pt:>10.2f}{m / 2**20:>12.0f}{m / pm:>10.3f}")
    ct, cm = rows["chunked"]
    print(
        f"goal: peak <= 0.25 x plain ({cm / pm:.3f}: {'met' if cm / pm <= 0.25 else 'missed'}), "
        f"time <= 1.3 x plain ({ct / pt:.2f}: {'met' if ct / pt <= 1.3 else 'missed'})"
    )


if __name__ == "__main__":
    main()
