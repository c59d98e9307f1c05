"""An outside corpus for the recipes: Debian's `fortunes` (about 1 MB of English prose, quotations and jokes that the
recipes were not tuned on), written as plain text files that `data.source=files` reads, then the comparison to run.

    apt-get install fortunes                      # or, offline from apt's cache: apt-get download fortunes &&
                                                  #   dpkg -x fortunes_*.deb /tmp/fortunes-deb (then --src below)
    python benchmarks/outside_corpus.py --out /tmp/fortunes-txt [--src /usr/share/games/fortunes]
    python benchmarks/quality.py --config examples/configs/tiny-cpu-90s.yaml --contenders minimal-gpt,dense,moe \
        --budget 90s --seeds 3 data.source=files 'data.path=/tmp/fortunes-txt/*.txt'

Each fortune file becomes NAME.txt (the `%` lines between fortunes kept: they are the corpus's own separators); the
loader cuts each file into documents of `data.max_bytes` and holds out `data.heldout_frac` of them by hash, as for any
text corpus. The index files (`.dat`) and the encoded copies (`.u8`) are skipped, and so is any file that is not UTF-8.
"""

import argparse
import hashlib
from pathlib import Path


def write_corpus(src: Path, out: Path) -> list:
    "Copy the text files of a fortunes folder to `out` as NAME.txt; the list of (name, bytes, sha256[:12])."
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for f in sorted(p for p in src.iterdir() if p.is_file() and not p.suffix):
        data = f.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # not text this loader can read as it is
        (out / f"{f.name}.txt").write_bytes(data)
        rows.append((f.name, len(data), hashlib.sha256(data).hexdigest()[:12]))
    if not rows:
        raise SystemExit(f"outside_corpus: no fortune text files in {src}: install Debian's fortunes (see --help)")
    return rows


def main():
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--src", default="/usr/share/games/fortunes", help="the installed fortunes folder")
    p.add_argument("--out", required=True, help="folder for the NAME.txt files")
    a = p.parse_args()
    rows = write_corpus(Path(a.src), Path(a.out))
    total = sum(n for _, n, _ in rows)
    digest = hashlib.sha256("".join(h for *_, h in rows).encode()).hexdigest()[:12]
    print(f"{len(rows)} files, {total:,} bytes (corpus sha256 of the files' hashes: {digest}) in {a.out}")
    print(f"data overrides: data.source=files 'data.path={Path(a.out) / '*.txt'}'")


if __name__ == "__main__":
    main()
