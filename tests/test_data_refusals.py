"""Data that cannot be silently wrong: a source with nothing to train on is refused at load, in one line naming its
path and the setting to change, and no stream spins for ever over documents that hold nothing. (`cipher-train`'s
refusal of them, exit 2 with nothing written, is a row of tests/test_reliability.py.)"""

import json

import pytest
from conftest import deadline

import cipher_nb.data.loader as L
import cipher_nb.data.sources as D
from cipher_nb.config.load import Config


def files_cfg(path, **data):
    cfg = Config()
    cfg.data.source, cfg.data.path = "files", str(path)
    cfg.training.batch_size, cfg.training.seq_len = 2, 64
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def one_file(tmp_path, text=b""):
    (tmp_path / "corpus.txt").write_bytes(text)
    return tmp_path / "corpus.txt"


def empty_folder(tmp_path):
    (tmp_path / "docs").mkdir()
    for i in range(3):
        (tmp_path / "docs" / f"{i}.txt").write_bytes(b"")
    return tmp_path / "docs"


def held_out_file(tmp_path):
    "A file whose held-out hash falls under 0.5: data.heldout_frac=0.5 holds it out whole."
    text = next(t for i in range(100) if D.doc_hash(t := b"line %d\n" % i * 50) < 0.5)
    return one_file(tmp_path, text)


NOTHING = [  # (what, the corpus, data settings, the fragment the refusal must hold)
    ("an empty file", one_file, {}, "its file is empty"),
    ("a folder of empty files", empty_folder, {}, "all 3 files are empty"),
    (
        "a held-out tail as long as the file",
        lambda p: one_file(p, b"x\n" * 50),
        dict(heldout_tail_bytes=100),
        "data.heldout_tail_bytes = 100",
    ),
    ("a file held out by hash", held_out_file, dict(heldout_frac=0.5), "data.heldout_frac = 0.5"),
]


@pytest.mark.parametrize("what,corpus,data,fragment", NOTHING, ids=[n[0] for n in NOTHING])
def test_a_source_with_nothing_to_train_on_is_refused_when_the_loader_is_built(tmp_path, what, corpus, data, fragment):
    path = corpus(tmp_path)
    with deadline(), pytest.raises(D.DataError) as e:
        cfg = files_cfg(path, **{"heldout_frac": 0.0, **data})
        L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1)  # no batch is asked for
    msg = str(e.value)
    assert f"data.path = '{path}'" in msg and fragment in msg and "\n" not in msg, msg


def test_a_named_source_with_nothing_to_train_on_names_its_key(tmp_path):
    cfg = files_cfg(tmp_path, heldout_frac=0.0)
    cfg.data.sources = {
        "web": dict(source="mock", path="latin"),
        "book": dict(source="files", path=str(one_file(tmp_path))),
    }
    with pytest.raises(D.DataError, match=r"source 'book': data.sources.book.path = '.*corpus.txt' has nothing"):
        L.mixture_loader(
            cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1, mix=lambda step: {"web": 1.0, "book": 1.0}
        )


def test_an_epoch_without_a_document_raises_instead_of_spinning(tmp_path):
    "Past the loader's check (a packer built directly): the first epoch with nothing in it stops with the reason."
    cfg = files_cfg(empty_folder(tmp_path), heldout_frac=0.0)
    with deadline(), pytest.raises(D.DataError, match="all 3 files are empty"):
        L.Packer(cfg.data, cfg.training).next_batch()


@pytest.mark.parametrize("workers", [0, 1])
def test_a_stream_of_rows_without_text_is_refused(tmp_path, monkeypatch, workers):
    "A streamed source's size is unknown up front: a long run of rows without a document is refused, in one line."
    monkeypatch.setattr(D, "HF_MAX_SKIP", 100)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in [""] * 300 + ["late"]))
    cfg = files_cfg(rows, heldout_frac=0.0, shuffle_buffer=0, num_workers=workers)
    with deadline(), pytest.raises(D.DataError) as e:
        next(iter(L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1)))
    msg = str(e.value)  # from a DataLoader worker too: one line, not the worker's traceback
    assert msg.startswith("source 'main' (files '") and "rows.jsonl'): 100 rows in a row" in msg, msg
    assert "\n" not in msg, msg
