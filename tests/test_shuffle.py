"""The shuffle buffer of streamed sources (jsonl, parquet, a hub-style folder) as a run meets it: another order than
the rows', an exact continuation after a restore, disjoint readers that cover each epoch, the loader's checkpointed
state, and a trainer resumed from a checkpoint that ends bit-identical."""

import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import SMALL_MODEL

import cipher_nb.data.loader as L
from cipher_nb.config.load import Config, load_config
from cipher_nb.data.sources import HFStream, ListStream, SourceSpec, open_stream

ROWS = 600


def texts(n=ROWS):
    return [f"row {i} " + "ab" * (i % 11) for i in range(n)]


def write_source(tmp_path, kind):
    "The same rows as one jsonl file, two parquet files, or a hub-style folder of three jsonl files; the path."
    rows = texts()
    if kind == "jsonl":
        p = tmp_path / "rows.jsonl"
        p.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(rows)))
        return SourceSpec("main", "files", str(p))
    if kind == "parquet":
        for part in range(2):
            pq.write_table(pa.table({"text": rows[part::2]}), tmp_path / f"p{part}.parquet", row_group_size=50)
        return SourceSpec("main", "files", str(tmp_path / "*.parquet"))
    d = tmp_path / "hub"
    d.mkdir()
    for part in range(3):
        (d / f"part{part}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows[part::3]))
    return SourceSpec("main", "hub", str(d))


def stream(spec, size=32, g=0, n=1, epochs=2):
    return L.ShuffledStream(HFStream(spec, "train", g, n, 7, 0.0, epochs=epochs), size, 7, spec.name, g)


def read_all(s):
    out = []
    while (d := s.next_doc()) is not None:
        out.append(d.decode())
    return out


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_order_differs_from_row_order_and_each_epoch_is_whole(tmp_path, kind):
    spec = write_source(tmp_path, kind)
    plain = read_all(HFStream(spec, "train", 0, 1, 7, 0.0, epochs=1))  # the rows in the stream's own order
    got = read_all(stream(spec))
    e0, e1 = got[:ROWS], got[ROWS:]
    assert sorted(e0) == sorted(e1) == sorted(texts())
    assert e0 != plain and e1 != plain and e0 != e1
    pos = {t: k for k, t in enumerate(plain)}
    assert all(k >= pos[t] - 32 for k, t in enumerate(e0))  # a row is read before it can go out
    assert sum(abs(k - pos[t]) > 5 for k, t in enumerate(e0)) > ROWS // 2  # not merely a local swap


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_reader_resumed_from_its_state_continues_identically(tmp_path, kind):
    spec = write_source(tmp_path, kind)
    full = read_all(stream(spec, g=1, n=2))
    share = len(full) // 2  # documents per epoch for this reader
    for k in (0, 1, 31, 33, share // 2, share - 5, share, share + 1, 2 * share - 1):
        a = stream(spec, g=1, n=2)
        head = [a.next_doc().decode() for _ in range(k)]
        b = stream(spec, g=1, n=2)
        b.restore(json.loads(json.dumps(a.state())))
        assert head + read_all(b) == full, k


def test_resume_where_datasets_spells_the_same_position_differently(tmp_path):
    "Row groups of 300 read in blocks of 256: a resumed parquet reader's snapshot differs from the uninterrupted one's."
    pq.write_table(pa.table({"text": [f"doc {i}" for i in range(1200)]}), tmp_path / "p.parquet", row_group_size=300)
    spec = SourceSpec("main", "files", str(tmp_path / "p.parquet"))
    full = read_all(stream(spec, size=64, epochs=1))
    for k in (582, 776, 970):
        a = stream(spec, size=64, epochs=1)
        head = [a.next_doc().decode() for _ in range(k)]
        b = stream(spec, size=64, epochs=1)
        b.restore(json.loads(json.dumps(a.state())))
        assert head + read_all(b) == full, k


@pytest.mark.parametrize("kind", ["parquet", "hub"])
def test_readers_are_disjoint_and_cover_the_source_once_per_epoch(tmp_path, kind):
    spec = write_source(tmp_path, kind)  # 2 parquet files for 3 readers: every 3rd row; 3 hub files: one each
    per_reader = [read_all(stream(spec, g=g, n=3)) for g in range(3)]
    for epoch in (0, 1):
        parts = [d[: len(d) // 2] if epoch == 0 else d[len(d) // 2 :] for d in per_reader]
        assert all(parts) and sorted(sum(parts, [])) == sorted(texts()), epoch
        assert not set(parts[0]) & set(parts[1]) and not set(parts[1]) & set(parts[2])


def test_file_lists_are_shuffled_by_their_own_seeded_order(tmp_path):
    for i in range(50):
        (tmp_path / f"{i:02d}.txt").write_bytes(b"file %d" % i)
    spec = SourceSpec("main", "files", str(tmp_path / "*.txt"))
    s = open_stream(spec, "train", 0, 1, 7, 0.0, epochs=1)
    assert type(s) is ListStream and type(L.shuffled(s, 32, 7, "main", 0)) is ListStream  # no buffer on top
    order = []
    while (d := s.next_doc()) is not None:
        order.append(int(d.stem))
    assert sorted(order) == list(range(50)) and order != list(range(50))


def small_cfg(spec, **data):
    cfg = Config()
    cfg.training.batch_size, cfg.training.seq_len = 2, 64
    cfg.data.source, cfg.data.path, cfg.data.heldout_frac = spec.source, spec.path, 0.0
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def test_the_loader_state_carries_the_buffer_through_torch_save(tmp_path):
    spec = write_source(tmp_path, "jsonl")
    cfg = small_cfg(spec, num_workers=2, shuffle_buffer=16)
    k, m = 13, 15
    it = iter(L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1))
    ref = [next(it) for _ in range(k + m)]
    first = L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1)
    it = iter(first)
    [next(it) for _ in range(k)]
    sd = first.state_dict()
    sh = sd["readers"][0]["sources"]["main"]["shuffle"]
    assert len(sh["slots"]) == 16 and sh["anchors"]
    torch.save(sd, tmp_path / "data.pt")
    resumed = L.mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1)
    resumed.load_state_dict(torch.load(tmp_path / "data.pt", weights_only=True))
    it = iter(resumed)
    for r in ref[k:]:
        b = next(it)
        assert all(torch.equal(b[key], r[key]) for key in r)
    other = L.mixture_loader(
        small_cfg(spec, num_workers=2, shuffle_buffer=32).data, cfg.training, cfg.model.vocab, "train", 0, 1
    )
    with pytest.raises(ValueError, match=r"shuffle_buffer \(saved 16, now 32\)"):
        other.load_state_dict(sd)
    off = L.documents_in(
        L.mixture_loader(small_cfg(spec, shuffle_buffer=0).data, cfg.training, cfg.model.vocab, "train", 0, 1, epochs=1)
    )
    on = L.documents_in(
        L.mixture_loader(
            small_cfg(spec, shuffle_buffer=16).data, cfg.training, cfg.model.vocab, "train", 0, 1, epochs=1
        )
    )
    assert off == [t.encode() for t in texts()] and on != off and sorted(on) == sorted(off)


@pytest.mark.filterwarnings("ignore:expert collapse")
def test_a_trainer_resumed_on_a_shuffled_jsonl_source_ends_bit_identical(tmp_path):
    from cipher_nb.train.builder import build_trainer

    spec = write_source(tmp_path, "jsonl")
    over = [*SMALL_MODEL, "data.source=files", f"data.path={spec.path}", "data.heldout_frac=0.0"]
    over += ["training.device=cpu", "training.seq_len=32", "training.batch_size=2", "schedule.max_steps=4"]
    over += [
        "schedule.warmup_steps=1",
        "training.checkpoint_every=2",
        "training.eval_every=1000",
        "training.log_every=1",
    ]
    cfg = load_config(None, over)
    cfg.data.shuffle_buffer = 8  # the buffer turns over within the run's first steps

    def digest(tr):
        h = hashlib.sha256()
        for name, p in sorted(tr.raw_model.named_parameters()):
            h.update(name.encode() + p.detach().float().numpy().tobytes())
        return h.hexdigest()

    straight = build_trainer(cfg, tmp_path / "run", progress=False).fit(progress=False)
    resumed = build_trainer(
        cfg, tmp_path / "resumed", resume=str(tmp_path / "run/checkpoints/step_0000002"), progress=False
    )
    resumed.fit(progress=False)
    assert resumed.step == straight.step == 4
    assert digest(resumed) == digest(straight)
