"Process-level behaviour of the data loader: DataLoader workers, ranks, exact resume through torch.save, bad input."

import json
import re
import tracemalloc

import numpy as np
import pytest
import torch

import cipher_nb.data.codecs as C
import cipher_nb.data.loader as L
import cipher_nb.data.sources as D
from cipher_nb.config.load import Config, ConfigError, DataConfig


def small_cfg(**data):
    cfg = Config()
    cfg.training.batch_size, cfg.training.seq_len = 2, 64
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def by_reader(loader):
    "Batches of one loader grouped by reader, in order."
    out = {}
    for w, b in loader.iter_readers():
        out.setdefault(w, []).append(b)
    return out


@pytest.fixture
def jsonl(tmp_path):
    texts = [f"document {i}: " + "abc " * (i % 13) for i in range(400)]
    p = tmp_path / "one.jsonl"
    p.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(texts)))
    return p, texts


@pytest.mark.parametrize("kind", ["jsonl", "mock"])
def test_two_ranks_two_workers_cover_every_document_once(jsonl, kind):
    path, texts = jsonl
    cfg = (
        small_cfg(source="files", path=str(path), heldout_frac=0.0, num_workers=2)
        if kind == "jsonl"
        else small_cfg(source="mock", path="math,cjk", heldout_frac=0.0, num_workers=2)
    )
    cfg.training.seq_len = 1024  # fewer, larger batches: the test is about documents, not batch count
    want = sorted(t.encode() for t in texts) if kind == "jsonl" else sorted(D.mock_docs("math,cjk"))
    got, per_reader = [], []
    for rank in (0, 1):
        for w, batches in by_reader(
            L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", rank, 2, epochs=1)
        ).items():
            docs = L.documents_in(batches)
            got += docs
            per_reader.append(len(docs))
    assert sorted(got) == sorted(want)
    assert len(per_reader) == 4 and min(per_reader) > 0.2 * len(want)  # all four readers work, none is starved


@pytest.mark.parametrize("kind", ["stdlib", "jsonl", "mock-epochs"])
def test_resume_after_k_batches_matches_uninterrupted(jsonl, tmp_path, kind):
    path, _ = jsonl
    cfg = {
        "stdlib": small_cfg(num_workers=2),
        "jsonl": small_cfg(source="files", path=str(path), num_workers=2),
        "mock-epochs": small_cfg(source="mock", path="latin", num_workers=0, max_bytes=40),
    }[kind]
    k, m = (11, 9) if kind != "mock-epochs" else (301, 200)  # 40-byte docs: several epochs of 'latin' in 500 batches
    full = L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1)
    it = iter(full)
    ref = [next(it) for _ in range(k + m)]
    first = L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1)
    it = iter(first)
    [next(it) for _ in range(k)]
    torch.save(first.state_dict(), tmp_path / "data.pt")
    resumed = L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1)
    resumed.load_state_dict(torch.load(tmp_path / "data.pt", weights_only=True))
    it = iter(resumed)
    for r in ref[k:]:
        b = next(it)
        for key in r:
            assert torch.equal(b[key], r[key]), key
    if kind == "mock-epochs":
        assert resumed.state_dict()["readers"][0]["sources"]["main"]["epoch"] >= 2


def test_resume_needs_the_same_layout():
    two, one = small_cfg(num_workers=2), small_cfg(num_workers=1)
    a = L.mixture_loader(two.data, two.training, two.model.vocab, "train", 0, 1)
    b = L.mixture_loader(one.data, one.training, one.model.vocab, "train", 0, 1)
    with pytest.raises(ValueError, match="num_workers"):
        b.load_state_dict(a.state_dict())


def test_hub_path_on_a_local_folder_heldout_disjoint(tmp_path):
    texts = [f"row {i} " + "x" * (i % 5) for i in range(600)]
    for part in range(3):  # three files: the 'shards' strategy for 3 readers, 'examples' for 2
        (tmp_path / f"part{part}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[part::3]))
    cfg = small_cfg(source="hub", path=str(tmp_path), heldout_frac=0.1)
    train = L.documents_in(L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1, epochs=1))
    held = L.documents_in(L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "heldout", 0, 1))
    assert not set(train) & set(held)
    assert sorted(train + held) == sorted(t.encode() for t in texts)
    assert 0.05 < len(held) / len(texts) < 0.15  # binomial(600, 0.1): 4 sd is 0.05


def test_missing_text_field_names_the_columns(jsonl):
    path, _ = jsonl
    with pytest.raises(D.DataError, match="text field 'content' not found; the columns are: text, n"):
        cfg = small_cfg(source="files", path=str(path), text_field="content", num_workers=1)
        next(iter(L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab)))


def test_empty_glob_and_bad_specs(tmp_path):
    t, vocab = Config().training, Config().model.vocab
    with pytest.raises(FileNotFoundError, match="matches no file"):
        L.mixture_loader(DataConfig(source="files", path=str(tmp_path / "*.jsonl")), t, vocab)
    with pytest.raises(ConfigError, match="data.sources.x"):
        L.mixture_loader(DataConfig(sources={"x": {"source": "mock", "path": "klingon"}}), t, vocab)


def test_empty_documents_skipped_and_counted(tmp_path):
    rows = ["a", "", "b", "", "", "c"]
    (tmp_path / "e.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    cfg = small_cfg(source="files", path=str(tmp_path / "e.jsonl"), heldout_frac=0.0, shuffle_buffer=0)  # row order
    loader = L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1, epochs=1)
    assert L.documents_in(list(loader)) == [b"a", b"b", b"c"]
    assert loader.stats()["empty"] == {"main": 3}


def test_invalid_utf8_kept_and_huge_document_streamed(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "PIECE_BYTES", 1 << 16)  # the held-out hash reads the first piece
    monkeypatch.setattr(L, "PIECE_BYTES", 1 << 16)  # the packer reads a long document a piece at a time
    rng = np.random.default_rng(0)
    big = rng.integers(0, 256, 4 << 20, dtype=np.uint8).tobytes()  # 4 MB, mostly invalid UTF-8
    (tmp_path / "big.txt").write_bytes(big)
    (tmp_path / "small.txt").write_bytes(b"caf\xe9 \xff")
    cfg = small_cfg(source="files", path=str(tmp_path / "*.txt"), heldout_frac=0.0, max_bytes=0)
    cfg.training.batch_size, cfg.training.seq_len = 4, 4096
    tracemalloc.start()
    batches = list(L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1, epochs=1))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    docs = L.documents_in(batches)
    assert sorted(docs) == sorted([big, b"caf\xe9 \xff"])
    held_batches = sum(b["input_ids"].numel() * 8 * 3 for b in batches)  # what the test itself keeps
    assert peak - held_batches < len(big) / 4, (peak, held_batches)  # pieces of 64 kB, never the 4 MB file


def test_tokenizer_codec_through_the_loader(tmp_path):
    tok = C.train_bpe([d.decode() for d in D.mock_docs("latin,cyrillic")], 400, tmp_path / "tok.json")
    cfg = small_cfg(
        source="mock", path="latin,cyrillic", codec="tokenizer", tokenizer=str(tmp_path / "tok.json"), heldout_frac=0.0
    )
    cfg.model.vocab = 400
    with pytest.raises(ConfigError, match="model.vocab"):
        bad = small_cfg(codec="tokenizer", tokenizer=str(tmp_path / "tok.json"))
        bad.model.vocab = 300
        L.mixture_loader(bad.data, bad.training, bad.model.vocab)
    batches = list(L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1, epochs=1))
    assert max(int(b["input_ids"].max()) for b in batches) < 400
    assert sorted(L.documents_in(batches, tok)) == sorted(D.mock_docs("latin,cyrillic"))


def test_uneven_files_are_split_by_file(tmp_path):
    texts = [f"line {i}" for i in range(300)]
    for part in range(3):
        (tmp_path / f"p{part}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[part::3]))
    cfg = small_cfg(source="files", path=str(tmp_path / "*.jsonl"), heldout_frac=0.0)
    per_rank = [
        L.documents_in(L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", r, 2, epochs=1))
        for r in (0, 1)
    ]
    assert sorted(per_rank[0] + per_rank[1]) == sorted(t.encode() for t in texts)
    assert sorted(len(d) for d in per_rank) == [100, 200]  # whole files: one rank reads two, the other one


def numbered_book(path, lines=7500):
    "A text file of numbered lines (29 bytes each): which lines a model saw can be read off the decoded text."
    path.write_bytes(b"".join(b"line %06d of one long book\n" % i for i in range(lines)))
    return path


def line_numbers(batches) -> set:
    text = b"".join(C.ByteCodec().decode_bytes(np.asarray(b["input_ids"]).reshape(-1)) for b in batches)
    return {int(m) for m in re.findall(rb"line (\d{6}) of", text)}


def test_a_long_text_file_is_read_whole_as_documents(tmp_path):
    "200 kB in one file at max_bytes=8192: every line is packed, in documents of at most 8192 bytes, none truncated."
    book = numbered_book(tmp_path / "book.txt")
    cfg = small_cfg(source="files", path=str(book), heldout_frac=0.0, num_workers=2)  # default max_bytes: 8192
    loader = L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1, epochs=1)
    batches = by_reader(loader)
    docs = [d for bs in batches.values() for d in L.documents_in(bs)]
    assert len(batches) == 2 and all(len(L.documents_in(bs)) > 5 for bs in batches.values())  # both readers share it
    assert max(map(len, docs)) <= 8192 and all(d.endswith(b"\n") for d in docs)
    assert b"".join(sorted(docs)) == book.read_bytes()  # numbered lines: sorted documents are the file, every byte once
    assert loader.stats()["truncated"] == 0


def test_truncated_counts_exactly_the_documents_cut_at_max_bytes():
    "In-memory documents longer than max_bytes are still cut, and counted once each, across workers and a resume."
    cfg = small_cfg(source="mock", path="latin", heldout_frac=0.0, max_bytes=500, num_workers=2)
    want = sum(len(d) > 500 for d in D.mock_docs("latin"))
    loader = L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1, epochs=1)
    batches = list(loader)
    assert 0 < want < len(D.mock_docs("latin")) and loader.stats()["truncated"] == want
    half = L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1, epochs=1)
    it = iter(half)
    for _ in range(len(batches) // 2):
        next(it)
    rest = L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1, epochs=1)
    rest.load_state_dict(json.loads(json.dumps(half.state_dict())))
    assert len(list(rest)) == len(batches) - len(batches) // 2 and rest.stats()["truncated"] == want


def test_resume_inside_a_long_text_file_is_exact(tmp_path):
    "A loader state saved in the middle of a one-file corpus, restored through torch.save: the identical next batches."
    book = numbered_book(tmp_path / "book.txt")
    cfg = small_cfg(source="files", path=str(book), heldout_frac=0.0, num_workers=2)
    k, m = 37, 24
    it = iter(L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1))
    ref = [next(it) for _ in range(k + m)]
    first = L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1)
    it = iter(first)
    for _ in range(k):
        next(it)
    torch.save(first.state_dict(), tmp_path / "data.pt")
    assert any(r["cur"] for r in first.state_dict()["readers"])  # stopped inside a document of the book
    resumed = L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1)
    resumed.load_state_dict(torch.load(tmp_path / "data.pt", weights_only=True))
    it = iter(resumed)
    for r in ref[k:]:
        b = next(it)
        for key in r:
            assert torch.equal(b[key], r[key]), key
    assert max(line_numbers(ref[k:])) > 1000  # the resumed batches are deep inside the file, past its first 8 kB
