"""What the shuffle buffer of streamed sources costs, by buffer size: the bytes of one reader's checkpointed state,
the time a restore takes (rebuilding the buffer by reading again), and documents per second through the packer.

    python benchmarks/shuffle_buffer.py [--docs 12000] [--batches 1500]

The source is `--docs` documents of 1 to 5 kB of words, as four parquet files (row groups of 1000), read by one
reader (`data.num_workers` 0) into the H100 preset's batches (4 x 2048). Speed is the best of three rounds of
`--batches` batches after the first (which fills the buffer), since the machine is shared and noisy. The state is
measured after those batches: the source's stream state (with the buffer's description) and the whole reader's
state (which holds it twice: the source position, and the position before the partly packed document).
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from bench_args import at_least

import cipher_nb.data.loader as L
from cipher_nb.config.load import Config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=at_least(4), default=12000)
    ap.add_argument("--batches", type=at_least(1), default=1500)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    rng = np.random.default_rng(0)
    words = "the river city book teacher sun road water wind house school reads writes".split()
    docs = [" ".join(rng.choice(words, int(rng.integers(200, 800)))) for _ in range(args.docs)]
    for part in range(4):
        pq.write_table(pa.table({"text": docs[part::4]}), tmp / f"p{part}.parquet", row_group_size=1000)
    mean = np.mean([len(d) for d in docs])
    print(f"{len(docs)} documents, mean {mean:.0f} bytes, 4 parquet files")
    print("| buffer | stream state (bytes) | reader state (bytes) | restore (s) | documents/s | speed x row order |")
    print("|---:|---:|---:|---:|---:|---:|")
    base = None
    for size in (0, 256, 1024, 4096):
        cfg = Config()
        cfg.training.batch_size, cfg.training.seq_len = 4, 2048
        cfg.data.source, cfg.data.path = "files", str(tmp / "*.parquet")
        cfg.data.heldout_frac, cfg.data.num_workers = 0.0, 0
        cfg.data.shuffle_buffer = size
        rates = []
        for _ in range(3):
            ld = L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1)
            it = iter(ld)
            next(it)
            t = time.perf_counter()
            for _ in range(args.batches):
                next(it)
            rates.append(args.batches / (time.perf_counter() - t))
        reader = ld.state_dict()["readers"][0]
        t = time.perf_counter()
        pk = L.Packer(cfg.data, cfg.training)
        pk.restore(json.loads(json.dumps(reader)))
        pk.next_batch()
        restore = time.perf_counter() - t
        src = json.dumps(reader["sources"]["main"])
        per_doc = max(rates) * 4 * 2048 / (mean + 2)
        base = base or per_doc  # the first row reads in row order (buffer 0)
        state = len(json.dumps(reader))
        print(f"| {size} | {len(src)} | {state} | {restore:.2f} | {per_doc:.0f} | {per_doc / base:.2f}x |")


if __name__ == "__main__":
    main()
