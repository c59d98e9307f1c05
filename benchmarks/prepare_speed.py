"""`cipher-data prepare`'s throughput in one process, for the byte codec and for a 32,768-id BPE, on the
standard-library corpus (what the data notebooks use): tokens and megabytes of text per CPU-second.

    python benchmarks/prepare_speed.py --tokenizer T.json   # T.json: cipher-tokenizer examples/configs/h100.yaml
                                                             #         data.source=stdlib --out T.json

One process (`procs=1`, in this process), timed with the CPU clock, so a busy machine does not change the figure; a
prepare with N processes scales by about N where the cores are free. The text is the documents' bytes (the byte
codec's tokens less its two specials per document), the same documents for both codecs.
"""

import argparse
import tempfile
import time

from cipher_nb.config.load import load_config
from cipher_nb.persist.shards import prepare_shards


def prepare(overrides: list, out: str) -> tuple:
    "(manifest, CPU seconds) of one in-process prepare of the stdlib corpus with `overrides`."
    data = load_config(None, ["data.source=stdlib", "data.heldout_frac=0", *overrides]).data
    c0 = time.process_time()
    m = prepare_shards(data, out, procs=1, progress=False)
    return m, time.process_time() - c0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", required=True, help="a tokenizer.json (cipher-tokenizer) for the BPE row")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        by, by_s = prepare([], f"{d}/bytes")
        docs = sum(r["docs"] for r in by["shards"])
        text = by["tokens"]["train"] - 2 * docs  # BOS and EOS around each document
        bpe, bpe_s = prepare(["data.codec=tokenizer", f"data.tokenizer={a.tokenizer}"], f"{d}/bpe")
    print(f"{docs:,} documents, {text / 1e6:.2f} MB of text")
    print("| codec | tokens | CPU-s | M tokens/s | MB of text/s |")
    print("|---|---:|---:|---:|---:|")
    for name, m, s in (("bytes", by, by_s), ("BPE 32,768", bpe, bpe_s)):
        n = m["tokens"]["train"]
        print(f"| {name} | {n:,} | {s:.1f} | {n / s / 1e6:.2f} | {text / s / 1e6:.2f} |")


if __name__ == "__main__":
    main()
