"""Bytes per second of the data pipeline, side by side with the Spider-FLEXITOKENS training script's per-sample loop
over the same documents, and how many times faster than the H100 presets consume bytes our pipeline is.

    python benchmarks/data_throughput.py [--seconds 2] [--rounds 3] [--workers 2] [--tokenizer]

Every contender packs the embedded stdlib corpus (held-out fraction 0, `max_bytes` 8192) into the H100 preset's
batches (4 x 2048) in this one process (the DataLoader row adds its worker processes). Contenders take turns for
`--rounds` rounds of `--seconds` each (start-up excluded) and each keeps its best round, since the machine is shared
and noisy. The script loop is the Spider-FLEXITOKENS training script's `ByteLevelDataset.__iter__` re-typed:
`list(text.encode())` per document, a Python list as the buffer, `torch.tensor` per window; it gets the documents
already decoded to `str`, as `datasets` would hand them over. A preset's consumption is one H100 at 100% MFU
(989 TFLOP/s dense bf16, an upper bound) divided by the training FLOPs per token of
`cipher_nb.config.sizing.flops_per_token`,
times bytes per token: 1 for the byte-level FlexiTokens preset, `--bytes-per-token` (default 4.5, typical of a 32k
BPE on English web text; the tokenizer row also measures it here, on code) for the token-level H100 preset.
With `--tokenizer`, the corpus is also prepared once into pre-tokenized shards (`cipher-data prepare`, timed apart)
and read back by the loader (`data.source: shards`, through its replay plan), beside the outside baseline: nanoGPT's
`get_batch`, random windows sliced from an `np.memmap` of one shard (no document boundaries, no resume state).
"""

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from bench_args import at_least

from cipher_nb.config.load import load_config
from cipher_nb.config.sizing import flops_per_token
from cipher_nb.data.codecs import train_bpe
from cipher_nb.data.loader import Packer, mixture_loader
from cipher_nb.data.sources import stdlib_docs
from cipher_nb.persist.shards import prepare_shards

ROOT = Path(__file__).resolve().parent.parent
H100_BF16 = 989e12  # dense bf16 FLOP/s of an H100 SXM
MFU = 0.4  # the target is stated at 40% MFU: a real run's need


def script_loop(texts, seq_len, max_bytes, bos=257, eos=258, pad=256):
    "The script's packing: list(text.encode()) per sample, a list buffer, torch.tensor per window; yields window bytes."
    while True:
        buf = []
        for text in texts:
            buf.extend([bos] + list(text.encode("utf-8"))[:max_bytes] + [eos])
            while len(buf) >= seq_len + 1:
                chunk, buf = buf[: seq_len + 1], buf[seq_len + 1 :]
                x, y = torch.tensor(chunk[:-1], dtype=torch.long), torch.tensor(chunk[1:], dtype=torch.long)
                y[y == pad] = -100
                yield x.numel()


def tcfg_args(c) -> list:
    "The overrides of a tokenizer config's codec and batch shape (for a shards config beside it)."
    d, t = c.data, c.training
    return [
        f"data.codec={d.codec}",
        f"data.tokenizer={d.tokenizer}",
        "data.heldout_frac=0.0",
        f"training.seq_len={t.seq_len}",
        f"training.batch_size={t.batch_size}",
        f"model.vocab={c.model.vocab}",
    ]


def workers(c, n: int):
    "A copy of `c` with `n` DataLoader workers."
    return replace(c, data=replace(c.data, num_workers=n))


def memmap_batches(shards: Path, manifest: dict, B: int, T: int, codec, seed: int = 0):
    "nanoGPT's get_batch over the first training shard: B random windows of T + 1 ids, as int64 tensors; bytes each."
    rec = next(r for r in manifest["shards"] if r["split"] == "train")
    rng = np.random.default_rng(seed)
    while True:  # nanoGPT re-opens the memmap every batch (to avoid a memory leak): so does this
        ids = np.memmap(shards / f"{rec['name']}.bin", dtype=manifest["dtype"], mode="r")
        ix = rng.integers(0, len(ids) - T - 1, B)
        x = torch.from_numpy(np.stack([ids[i : i + T + 1] for i in ix]).astype(np.int64))
        yield codec.count_bytes(x[:, :-1])


def rate(counts, seconds):
    "Bytes per second of an iterator of per-step byte counts over `seconds`."
    n, t0 = 0, time.perf_counter()
    while (dt := time.perf_counter() - t0) < seconds:
        n += next(counts)
    return n / dt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=at_least(0.1, float), default=2.0, help="measuring time per contender and round")
    ap.add_argument("--rounds", type=at_least(1), default=3, help="rounds; each contender keeps its best")
    ap.add_argument(
        "--workers", type=at_least(0), default=2, help="DataLoader workers for the multi-process row (0 = skip)"
    )
    ap.add_argument(
        "--tokenizer", action="store_true", help="also time the tokenizer codec (trains a BPE on the corpus first)"
    )
    ap.add_argument(
        "--bytes-per-token", type=at_least(0.1, float), default=4.5, help="the H100 preset's tokenizer, bytes per token"
    )
    a = ap.parse_args()

    h100 = load_config(ROOT / "examples/configs/h100.yaml")
    flexi = load_config(ROOT / "examples/configs/flexitokens-h100.yaml")
    cfg = load_config(
        None,
        [
            "data.source=stdlib",
            "data.heldout_frac=0.0",
            "data.max_bytes=8192",
            f"training.seq_len={h100.training.seq_len}",
            f"training.batch_size={h100.training.batch_size}",
        ],
    )
    T, B = cfg.training.seq_len, cfg.training.batch_size
    texts = [d.decode("utf-8", "surrogateescape") for d in stdlib_docs()]
    print(
        f"corpus: {len(texts)} stdlib files, {sum(map(len, stdlib_docs())) / 1e6:.1f} MB; batches {B} x {T}; "
        f"best of {a.rounds} rounds of {a.seconds:g} s"
    )

    contenders = []

    def add(name, counts):
        next(counts)
        contenders.append((name, counts))  # the first step (start-up) is not timed

    add("script loop (list(text.encode()))", script_loop(texts, T, cfg.data.max_bytes))
    pk = Packer(cfg.data, cfg.training)
    add("Packer (numpy batches)", (pk.next_batch()["input_ids"].size for _ in iter(int, 1)))
    add(
        "mixture_loader, in process (tensors + resume state)",
        (b["input_ids"].numel() for b in mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1)),
    )
    if a.workers:
        wcfg = load_config(
            None,
            [
                f"data.num_workers={a.workers}",
                "data.heldout_frac=0.0",
                f"training.seq_len={T}",
                f"training.batch_size={B}",
            ],
        )
        add(
            f"mixture_loader, {a.workers} DataLoader workers",
            (b["input_ids"].numel() for b in mixture_loader(wcfg.data, wcfg.training, wcfg.model.vocab, "train", 0, 1)),
        )
    bpt = a.bytes_per_token
    if a.tokenizer:
        path = Path(tempfile.mkdtemp()) / "bpe.json"
        t0 = time.perf_counter()
        codec = train_bpe(stdlib_docs(), h100.model.vocab, path)
        print(f"  (trained a BPE of {codec.vocab_size} ids on the corpus in {time.perf_counter() - t0:.0f} s)")
        tcfg = load_config(
            None,
            [
                "data.codec=tokenizer",
                f"data.tokenizer={path}",
                "data.heldout_frac=0.0",
                f"training.seq_len={T}",
                f"training.batch_size={B}",
                f"model.vocab={h100.model.vocab}",
            ],
        )

        def tok_bytes(c):
            for b in mixture_loader(c.data, c.training, c.model.vocab, "train", 0, 1):
                yield codec.count_bytes(b["input_ids"])

        add("mixture_loader, tokenizer codec, in process", tok_bytes(tcfg))
        if a.workers:
            twcfg = load_config(
                None,
                [
                    *(f"{k}={v}" for k, v in (("data.codec", "tokenizer"), ("data.tokenizer", path))),
                    "data.heldout_frac=0.0",
                    f"data.num_workers={a.workers}",
                    f"training.seq_len={T}",
                    f"training.batch_size={B}",
                    f"model.vocab={h100.model.vocab}",
                ],
            )
            add(f"mixture_loader, tokenizer codec, {a.workers} DataLoader workers", tok_bytes(twcfg))
        shards, procs = Path(tempfile.mkdtemp()) / "shards", max(1, a.workers)
        t0 = time.perf_counter()
        m = prepare_shards(tcfg.data, shards, procs=procs, shard_bytes=4 << 20, progress=False)
        dt = time.perf_counter() - t0
        print(f"  (prepared {m['tokens']['train'] / 1e6:.2f}M tokens into shards in {dt:.1f} s on {procs} processes)")
        scfg = load_config(
            None, [*(f"data.{k}={v}" for k, v in (("source", "shards"), ("path", shards))), *tcfg_args(tcfg)]
        )
        add("mixture_loader, from shards, in process", tok_bytes(scfg))
        if a.workers:
            add(f"mixture_loader, from shards, {a.workers} DataLoader workers", tok_bytes(workers(scfg, a.workers)))
        add("nanoGPT get_batch (np.memmap random windows)", memmap_batches(shards, m, B, T, codec))
        sample = b"".join(stdlib_docs()[:200])
        print(f"  (this BPE: {len(sample) / len(codec.encode(sample)):.2f} bytes per token on stdlib code)")
    best = {name: 0.0 for name, _ in contenders}
    for r in range(a.rounds):
        for name, counts in contenders:
            best[name] = max(best[name], rate(counts, a.seconds))
        print(f"  round {r + 1}: " + ", ".join(f"{v / 1e6:.1f}" for v in best.values()) + " MB/s", flush=True)
    rows = list(best.items())

    need = {
        "H100 preset (tokens)": H100_BF16 / flops_per_token(h100.model, h100.training.seq_len) * bpt,
        "FlexiTokens preset (bytes)": H100_BF16 / flops_per_token(flexi.model, flexi.training.seq_len),
    }
    for k, v in need.items():
        print(f"{k} at 100% MFU on one H100 consumes {v / 1e6:.2f} MB/s")
    script = rows[0][1]
    print(
        "\n| contender | MB/s | x script loop | x H100 preset | x H100 preset at 40% MFU | x FlexiTokens preset |"
        "\n|---|---:|---:|---:|---:|---:|"
    )
    for name, r in rows:
        x_h100, x_flexi = r / need["H100 preset (tokens)"], r / need["FlexiTokens preset (bytes)"]
        print(f"| {name} | {r / 1e6:.1f} | {r / script:.1f} | {x_h100:.1f} | {x_h100 / MFU:.1f} | {x_flexi:.1f} |")


if __name__ == "__main__":
    main()
