"Data identity: what the fingerprint covers, unpinned hub sources, and held-out data that is real or absent."

import hashlib
import json
import warnings

import pytest

import cipher_nb.data.sources as D
from cipher_nb.config.load import Config, load_config
from cipher_nb.data.curriculum import build_loader
from cipher_nb.data.loader import documents_in
from cipher_nb.persist.checkpointer import checkpoint_meta
from cipher_nb.persist.files import META, StageError, write_durable, write_marker
from cipher_nb.persist.stages import check_init_source

HUB = ["data.source=hub", "data.path=HuggingFaceFW/fineweb-edu", "data.revision=main"]


def files_cfg(path, **data):
    cfg = Config()
    cfg.data.source, cfg.data.path = "files", str(path)
    cfg.training.batch_size, cfg.training.seq_len = 2, 64
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


@pytest.fixture
def corpus(tmp_path):
    "A corpus of one text file."
    p = tmp_path / "one.txt"
    p.write_bytes(b"".join(b"line %d of the only training file\n" % i for i in range(400)))
    return p


def test_max_bytes_changes_the_fingerprint(corpus):
    a, b = files_cfg(corpus), files_cfg(corpus, max_bytes=1234)
    assert D.data_fingerprint(a.data) != D.data_fingerprint(b.data)
    assert D.data_fingerprint(a.data) == D.data_fingerprint(files_cfg(corpus).data)


def test_a_retrained_tokenizer_at_the_same_path_changes_the_fingerprint(corpus, tmp_path):
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"model": {"vocab": {"a": 0}}}')
    cfg = files_cfg(corpus, codec="tokenizer", tokenizer=str(tok))
    before = D.data_fingerprint(cfg.data)
    assert before != D.data_fingerprint(files_cfg(corpus).data)  # the codec counts
    tok.write_text('{"model": {"vocab": {"a": 0, "b": 1}}}')
    assert D.data_fingerprint(cfg.data) != before


def test_the_heldout_split_changes_the_fingerprint(corpus, tmp_path):
    ev = tmp_path / "eval.txt"
    ev.write_bytes(b"one evaluation document")
    fps = {
        D.data_fingerprint(files_cfg(corpus, **kw).data)
        for kw in (dict(), dict(heldout_frac=0.1), dict(heldout_tail_bytes=100), dict(heldout_path=str(ev)))
    }
    assert len(fps) == 4
    before = D.data_fingerprint(files_cfg(corpus, heldout_path=str(ev)).data)
    ev.write_bytes(b"another evaluation document")  # same path, other content
    assert D.data_fingerprint(files_cfg(corpus, heldout_path=str(ev)).data) != before


def test_unpinned_hub_sources_are_recorded_and_warned():
    cfg = load_config(None, HUB)
    man = D.data_manifest(cfg.data)  # a hub source is identified by its spec: nothing is downloaded
    assert man["pinned"] is False and man["sources"]["main"]["pinned"] is False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        D.warn_unpinned(cfg.data)
    assert len(caught) == 1 and caught[0].category is D.UnpinnedWarning
    msg = str(caught[0].message)
    assert "'main'" in msg and "data.revision=<commit" in msg and "\n" not in msg
    pinned = load_config(None, [*HUB[:2], "data.revision=" + "ab" * 20])
    assert D.data_manifest(pinned.data)["pinned"] is True
    assert D.data_manifest(load_config(None, ["data.source=mock"]).data)["pinned"] is True


def _source_ckpt(tmp_path, cfg, fp):
    src = tmp_path / "pre" / "final"
    src.mkdir(parents=True)
    write_durable(src / META, json.dumps(checkpoint_meta(cfg, step=10, data_fingerprint=fp)).encode())
    write_marker(src)
    return src


def test_refinement_from_an_unpinned_source_is_refused_unless_allowed(tmp_path):
    "Over hub data read on the fly a refinement is not one pass: it has a horizon of its own (schedule.max_steps)."
    src = _source_ckpt(tmp_path, load_config(None, HUB), "fp")
    refine = ["stage.name=refinement", "schedule.max_steps=100"]
    with pytest.raises(StageError, match=r"unpinned hub source(.|\n)*stage.allow_unpinned=true"):
        unpinned = load_config(None, [*refine, *HUB])
        check_init_source(src, unpinned.stage, unpinned.data, "fp")
    accepted = load_config(None, [*refine, "stage.allow_unpinned=true", *HUB])
    check_init_source(src, accepted.stage, accepted.data, "fp")


def test_refinement_from_local_files_needs_no_pin(tmp_path, corpus):
    cfg = files_cfg(corpus)
    fp = D.data_fingerprint(cfg.data)
    src = _source_ckpt(tmp_path, cfg, fp)
    refine = files_cfg(corpus)
    refine.stage.name = "refinement"
    check_init_source(src, refine.stage, refine.data, D.data_fingerprint(refine.data))


def test_a_single_file_with_a_heldout_tail_yields_heldout_batches(corpus):
    cfg = files_cfg(corpus, heldout_frac=0.0, heldout_tail_bytes=300, max_bytes=0)
    assert D.has_heldout(cfg.data)
    held = list(build_loader(cfg.data, cfg.training, cfg.schedule, cfg.model.vocab, "heldout", 0, 1))
    assert held and documents_in(held) == [corpus.read_bytes()[-300:]]
    train = documents_in(build_loader(cfg.data, cfg.training, cfg.schedule, cfg.model.vocab, "train", 0, 1, epochs=1))
    assert train == [corpus.read_bytes()[:-300]]


def test_without_heldout_data_the_heldout_loader_yields_nothing(corpus):
    for cfg in (files_cfg(corpus, heldout_frac=0.0), files_cfg(corpus, heldout_frac=1e-9)):
        assert not D.has_heldout(cfg.data)
        assert list(build_loader(cfg.data, cfg.training, cfg.schedule, cfg.model.vocab, "heldout", 0, 1)) == []


def test_a_heldout_path_is_all_evaluation_reads(corpus, tmp_path):
    (tmp_path / "ev").mkdir()
    for i in range(3):
        (tmp_path / "ev" / f"{i}.txt").write_bytes(b"evaluation document %d" % i)
    cfg = files_cfg(corpus, heldout_frac=0.5, heldout_path=str(tmp_path / "ev" / "*.txt"), max_bytes=0)
    held = documents_in(build_loader(cfg.data, cfg.training, cfg.schedule, cfg.model.vocab, "heldout", 0, 1))
    assert sorted(held) == [b"evaluation document %d" % i for i in range(3)]
    assert documents_in(
        build_loader(cfg.data, cfg.training, cfg.schedule, cfg.model.vocab, "train", 0, 1, epochs=1)
    ) == [corpus.read_bytes()]  # none held out by hash


def test_tail_mode_refuses_streamed_sources(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "a"}\n')
    cfg = files_cfg(rows, heldout_tail_bytes=10)
    with pytest.raises(Exception, match="streams rows"):
        D.has_heldout(cfg.data)


def test_exact_resume_inside_a_file_without_its_tail(tmp_path):
    for i in range(5):
        (tmp_path / f"{i}.txt").write_bytes(b"".join(b"file %d line %d\n" % (i, k) for k in range(200)))
    cfg = files_cfg(tmp_path / "*.txt", heldout_frac=0.0, heldout_tail_bytes=500, max_bytes=0)
    ref = [
        b for _, b in zip(range(30), build_loader(cfg.data, cfg.training, cfg.schedule, cfg.model.vocab, "train", 0, 1))
    ]
    a = build_loader(cfg.data, cfg.training, cfg.schedule, cfg.model.vocab, "train", 0, 1)
    it = iter(a)
    for _ in range(13):  # stops inside a file
        next(it)
    b = build_loader(cfg.data, cfg.training, cfg.schedule, cfg.model.vocab, "train", 0, 1)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for r, x in zip(ref[13:], b):
        for k in r:
            assert (x[k] == r[k]).all()


def _fingerprint_before_split(cfg) -> str:
    "The fingerprint as it was computed before long text files were split (no `long_files` in the manifest)."
    man = D.data_manifest(cfg.data)
    for s in man["sources"].values():
        s.pop("long_files", None)
    return hashlib.sha256(json.dumps(man, sort_keys=True, default=str).encode()).hexdigest()[:16]


def test_splitting_long_files_changes_the_fingerprint_only_where_it_changes_what_is_read(corpus, tmp_path):
    "A file over max_bytes is now read whole: refinement from a run made before is refused; short files: as before."
    long = files_cfg(corpus)  # 14 kB at max_bytes 8192
    assert D.data_manifest(long.data)["sources"]["main"]["long_files"] == "split"
    src = _source_ckpt(tmp_path, long, _fingerprint_before_split(long))
    refine = files_cfg(corpus)
    refine.stage.name = "refinement"
    with pytest.raises(StageError, match="refinement data differs"):
        check_init_source(src, refine.stage, refine.data, D.data_fingerprint(refine.data))
    for cfg in (files_cfg(corpus, max_bytes=0), files_cfg(corpus, max_bytes=1 << 16), Config()):
        assert D.data_fingerprint(cfg.data) == _fingerprint_before_split(cfg)  # nothing cut, nothing split: unchanged


def test_cipher_data_pin_pins_every_hub_source_of_the_spider_preset_from_the_local_cache(tmp_path, monkeypatch):
    "Offline: each source's commit from a hub cache (refs/main); the refusal for an unpinned source names the command."
    from conftest import ROOT, run_in_process

    from cipher_nb.data.sources import unpinned_sources
    from cipher_nb.persist.shards import cipher_data

    preset = ROOT / "examples/configs/flexitokens-h100.yaml"
    hub = unpinned_sources(load_config(preset).data)
    assert len(hub) == 6
    for i, spec in enumerate(hub):
        ref = tmp_path / "hub" / f"datasets--{spec.path.replace('/', '--')}" / "refs" / "main"
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(f"{i:040x}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    r = run_in_process(cipher_data, "pin", preset, "--out", tmp_path / "pinned.yaml", pos=["preset"])
    assert r.returncode == 0 and r.stdout.count("pinned data.sources.") == 6, r.stdout + r.stderr
    pinned = load_config(tmp_path / "pinned.yaml")
    assert unpinned_sources(pinned.data) == [] and pinned.model == load_config(preset).model
    src = _source_ckpt(tmp_path, load_config(preset), "fp")
    with pytest.raises(StageError, match="cipher-data pin PRESET --out PINNED.yaml"):
        unpinned = load_config(preset, ["stage.name=refinement", "schedule.max_steps=5000"])
        check_init_source(src, unpinned.stage, unpinned.data, "fp")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    r = run_in_process(cipher_data, "pin", preset, "--out", tmp_path / "again.yaml", pos=["preset"])
    assert r.returncode == 2 and "pin with --api" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
