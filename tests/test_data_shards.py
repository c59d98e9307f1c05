"""Pre-tokenized shards as a run uses them: the held-out bpb of one model is the same read from shards and on the
fly (byte codec); cipher-train trains from shards to a token budget; a damaged, foreign or empty prepared directory is
refused in one line, exit 2, nothing trained."""

import itertools
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY, rows
from test_reliability import in_process, nothing_written, script

from cipher_nb.config.load import load_config
from cipher_nb.config.schema import DataConfig
from cipher_nb.config.sizing import prepared_tokens
from cipher_nb.data.codecs import build_codec
from cipher_nb.data.loader import mixture_loader
from cipher_nb.model.lm import CipherModel
from cipher_nb.monitor.metrics import heldout_metrics
from cipher_nb.persist.shards import prepare_shards

MOCK = ["data.source=mock", "data.heldout_frac=0.2"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    "The mock corpus prepared in one process, in shards of about 64 kB of text; prepared again, nothing changes."
    out = tmp_path_factory.mktemp("shards") / "mock"
    data = load_config(None, MOCK).data
    first = prepare_shards(data, out, procs=1, shard_bytes=1 << 16, progress=False)
    assert prepare_shards(data, out, procs=1, shard_bytes=1 << 16, progress=False) == first  # a re-run keeps them
    return out


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    "256 documents of one byte each (BOS, byte, EOS): an epoch in a few steps."
    out = tmp_path_factory.mktemp("small") / "latin"
    data = load_config(None, [*MOCK, "data.path=latin", "data.max_bytes=1"]).data
    prepare_shards(data, out, procs=1, progress=False)
    return out


@pytest.fixture(scope="module")
def two_small(tmp_path_factory):
    "Two sources of 256 one-byte documents, Latin and Cyrillic, prepared into one directory as a curriculum is."
    out = tmp_path_factory.mktemp("small") / "two"
    over = [f"data.sources.{s}.{k}={v}" for s in ("latin", "cyrillic") for k, v in (("source", "mock"), ("path", s))]
    prepare_shards(load_config(None, ["data.max_bytes=1", *over]).data, out, procs=1, progress=False)
    return out


def test_heldout_bpb_is_the_same_from_shards_and_on_the_fly(prepared):
    fly = load_config(None, [*TINY, *MOCK])
    shards = load_config(None, [*TINY, "data.source=shards", f"data.path={prepared}"])
    torch.manual_seed(0)
    model = CipherModel(fly.model).eval()
    lengths = torch.as_tensor(build_codec(fly.data).byte_lengths)
    metrics = []
    for cfg in (fly, shards):
        loader = mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "heldout", 0, 1)
        batches = list(itertools.islice(loader, 8))  # the first windows: enough to see any difference in packing
        assert len(batches) == 8
        with torch.no_grad():
            metrics.append(heldout_metrics(model, batches, lengths))
    assert metrics[0]["val/bpb"] == metrics[1]["val/bpb"], metrics


def test_cipher_train_trains_from_shards_to_a_token_budget_and_checkpoints_each_epoch_end(small, tmp_path):
    from cipher_nb.persist.files import read_meta

    train = json.loads((small / "manifest.json").read_text())["tokens"]["train"]
    end = -(-train // 128)  # 2 windows x 64 tokens a step: the first step whose tokens reach one pass
    steps = end + 1  # a budget of a step and a half more buys one step more, under schedule.max_steps
    run = tmp_path / "run"
    r = in_process(
        *TINY,
        "data.source=shards",
        f"data.path={small}",
        "data.max_bytes=1",  # as prepared
        f"training.target_tokens={steps * 128 + 64}",
        "schedule.max_steps=100",
        "schedule.warmup_steps=1",
        "training.log_every=1",
        "training.eval_batches=1",
        "--out",
        run,
        "--quiet",
    )
    assert r.code == 0, r.err[-2000:]
    logged = [row for row in rows(run) if "loss" in row]
    assert [row["step"] for row in logged] == list(range(1, steps + 1))
    assert logged[-1]["data/epochs"] == pytest.approx(steps * 128 / train)  # passes over the prepared tokens
    assert json.loads((run / "record.json").read_text())["data"]["epochs"] == logged[-1]["data/epochs"]
    tags = {p.name: read_meta(p).get("tag") for p in (run / "checkpoints").glob("step_*")}
    assert tags == {f"step_{end:07d}": "epoch", f"step_{steps:07d}": "final"}, tags


def truncate(d):
    f = sorted(d.glob("*.train.*.bin"))[0]
    f.write_bytes(f.read_bytes()[:-1])


def alter(d):
    f = sorted(d.glob("*.train.*.bin"))[0]
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 1
    f.write_bytes(bytes(b))


def other_codec(d):
    m = json.loads((d / "manifest.json").read_text())
    m["codec"] = dict(kind="tokenizer", tokenizer="0123456789abcdef")
    (d / "manifest.json").write_text(json.dumps(m))


def other_preset(d):
    "The manifest of a preset whose one source is named 'web' (its shards' hashes still match)."
    m = json.loads((d / "manifest.json").read_text())
    for r in m["shards"]:
        r["source"] = "web"
    m["data"]["sources"] = {"web": m["data"]["sources"]["main"]}
    (d / "manifest.json").write_text(json.dumps(m))


def empty(d):
    shutil.rmtree(d)
    d.mkdir()


BAD = [  # (what, how the prepared copy is damaged, the fragment of the one line)
    ("a truncated shard", truncate, "(truncated or altered)"),
    ("an altered shard", alter, "differs from its manifest's SHA-256"),
    ("another codec's manifest", other_codec, "prepared with the codec"),
    ("an empty prepared directory", empty, "holds no prepared shards"),
    ("another preset's sources", other_preset, "prepared from another preset's sources (web)"),
]


@pytest.mark.parametrize("what,damage,says", BAD, ids=[b[0] for b in BAD])
def test_bad_shards_are_refused_before_step_0(prepared, tmp_path, what, damage, says):
    d = tmp_path / "shards"
    shutil.copytree(prepared, d)
    damage(d)
    r = in_process(*TINY, "data.source=shards", f"data.path={d}", "--out", tmp_path / "run", "--quiet")
    assert r.code == 2 and says in r.last, (r.code, r.err[-2000:])
    nothing_written(tmp_path)


def test_cipher_train_refuses_a_budget_under_one_global_batch(prepared, tmp_path):
    args = ("data.source=shards", f"data.path={prepared}", "training.target_tokens=100")  # one batch: 2 x 64 tokens
    r = in_process(*TINY, *args, "--out", tmp_path / "run", "--quiet")
    assert r.code == 2 and "is less than one global batch (128 tokens" in r.last, (r.code, r.err[-2000:])
    nothing_written(tmp_path)


def test_cipher_config_plans_in_epochs_of_the_prepared_tokens_and_refuses_a_budget_under_one_batch(prepared):
    from conftest import ROOT, run_in_process

    from cipher_nb.config.sizing import cipher_config

    preset = ROOT / "examples/configs/tiny-cpu.yaml"
    train = json.loads((prepared / "manifest.json").read_text())["tokens"]["train"]
    shards = ["data.source=shards", f"data.path={prepared}", "schedule.max_steps=100000"]
    budget = f"training.target_tokens={2 * train}"
    r = run_in_process(cipher_config, preset, *TINY, *shards, budget, "--gpus", "2", pos=["path"])
    steps = 2 * train // (2 * 2 * 64)  # 2 ranks x 2 windows x 64 tokens a step
    plan = f"# plan at 2 rank(s): {steps:,} steps (schedule.target_tokens = {2 * train:,}) x 256 tokens"
    assert r.returncode == 0 and plan in r.stdout, r.stdout[-500:]
    assert f", {steps * 256 / train:.2f} epochs of {train:,}" in r.stdout
    r = run_in_process(cipher_config, preset, *TINY, "training.target_tokens=1000", "--gpus", "8", pos=["path"])
    assert r.returncode == 2 and "less than one global batch (1,024 tokens = 8 rank(s)" in r.stderr, r.stderr


def test_a_refinement_is_planned_as_one_pass_over_the_prepared_tokens(prepared):
    from conftest import ROOT, run_in_process

    from cipher_nb.config.sizing import cipher_config

    preset = ROOT / "examples/configs/example-cpu-refinement.yaml"
    train = json.loads((prepared / "manifest.json").read_text())["tokens"]["train"]
    shards = ["data.source=shards", f"data.path={prepared}", "schedule.max_steps=100000", "training.epochs=1"]
    r = run_in_process(cipher_config, preset, *TINY, *shards, "--gpus", "2", pos=["path"])
    steps = train // (2 * 2 * 64)  # one pass at 2 ranks x 2 windows x 64 tokens a step
    assert r.returncode == 0 and f"# plan at 2 rank(s): {steps:,} steps (schedule.epochs = 1) x 256" in r.stdout, (
        r.stdout
    )
    assert f", {steps * 256 / train:.2f} epochs of {train:,}" in r.stdout
    r = run_in_process(cipher_config, preset, *TINY, "training.epochs=1", pos=["path"])  # on the fly: no count
    assert r.returncode == 2 and "stage refinement is one pass over its data" in r.stderr, r.stderr
    assert "counted over prepared shards only" in r.stderr and "schedule.max_steps=N" in r.stderr


def test_a_refinement_over_a_pretraining_preset_is_one_pass_by_default(prepared):
    "`PRESET stage.name=refinement` on prepared shards: the preset's horizon gives way to one uncapped pass."
    from conftest import ROOT, run_in_process

    from cipher_nb.config.sizing import cipher_config

    preset = ROOT / "examples/configs/tiny-cpu.yaml"
    train = json.loads((prepared / "manifest.json").read_text())["tokens"]["train"]
    shards = ["data.source=shards", f"data.path={prepared}"]
    r = run_in_process(cipher_config, preset, *TINY, *shards, "stage.name=refinement", pos=["path"])
    steps = train // (2 * 64)  # one pass at 1 rank x 2 windows x 64 tokens a step, no schedule.max_steps cap
    assert r.returncode == 0 and f"# plan at 1 rank(s): {steps:,} steps (schedule.epochs = 1) x 128" in r.stdout
    assert "# stage refinement replaces the preset's schedule.max_steps" in r.stdout, r.stdout[-800:]
    cfg = load_config(preset, [*TINY, *shards, "stage.name=refinement", "schedule.max_steps=70"])
    assert (cfg.schedule.epochs, cfg.schedule.max_steps) == (0, 70)  # a horizon given for the stage is its own
    by_name = DataConfig(sources={"main": {"source": "shards", "path": str(prepared)}})
    assert prepared_tokens(by_name) == train  # the directory read by its source's name, as a curriculum reads it


def test_a_loader_over_shards_resumes_exactly(prepared):
    "k batches, the loader's state, a new loader from it: the next batches are those of an uninterrupted loader."
    cfg = load_config(None, [*TINY, "data.source=shards", f"data.path={prepared}"])

    def loader():
        return mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", 0, 1)

    straight = [b["input_ids"].tolist() for b in itertools.islice(loader(), 12)]
    first = loader()
    it = iter(first)
    for _ in range(5):
        next(it)
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    assert [b["input_ids"].tolist() for b in itertools.islice(resumed, 7)] == straight[5:]


def global_batches(prepared, world, batch, accum, steps, state=None):
    "Each step's global batch (every rank's micro-batches end to end) of `world` loaders, and rank 0's state after."
    over = [f"training.batch_size={batch}", f"training.grad_accum={accum}", "data.doc_mask=true"]
    cfg = load_config(None, [*TINY, "data.source=shards", f"data.path={prepared}", *over])
    loaders = [mixture_loader(cfg.data, cfg.training, cfg.model.vocab, "train", r, world) for r in range(world)]
    for ld in loaders:
        if state is not None:
            ld.load_state_dict(json.loads(json.dumps(state)))
    its = [iter(ld) for ld in loaders]
    out = []
    for _ in range(steps):
        micro = [next(it) for it in its for _ in range(accum)]  # rank by rank, micro-step by micro-step
        out.append({k: torch.cat([b[k] for b in micro]).tolist() for k in ("input_ids", "doc_ids")})
    return out, loaders[0].state_dict()


def test_the_replay_plan_continues_on_another_number_of_ranks(prepared):
    "A 2-rank run resumed on 4 ranks (and on 2) reads the global batches of an uninterrupted one; another is refused."
    straight, _ = global_batches(prepared, 2, 2, 2, 6)  # 8 windows a step
    head, state = global_batches(prepared, 2, 2, 2, 3)
    assert head == straight[:3]
    assert global_batches(prepared, 4, 2, 1, 3, state)[0] == straight[3:]  # 4 ranks x 2 windows
    assert global_batches(prepared, 2, 2, 2, 3, state)[0] == straight[3:]  # exact resume on the same layout
    with pytest.raises(ValueError, match="global batch of windows .* of 8, this run's is 4"):
        global_batches(prepared, 4, 1, 1, 1, state)


def test_a_curriculum_resumed_on_fewer_ranks_continues_the_global_batches(two_small, tmp_path, monkeypatch):
    "2 gloo ranks (torchrun) save at step 2; resumed on 1 rank, grad_accum 2: steps 3-4 read an unbroken run's windows."
    from conftest import run_cli, script

    from cipher_nb.data.loader import Loader
    from cipher_nb.persist.checkpointer import RESEED_RULE

    # a curriculum of two prepared sources: Latin alone for the first half, then both (the Spider preset's shape)
    phases = "data.phases=[{until: 0.5, mix: {latin: 1}}, {until: 1.0, mix: {latin: 0.5, cyrillic: 0.5}}]"
    run = [*TINY, *(f"data.sources.{s}.source=shards" for s in ("latin", "cyrillic")), phases]
    run += [f"data.sources.{s}.path={two_small}" for s in ("latin", "cyrillic")]
    run += ["data.max_bytes=1", "schedule.max_steps=4"]
    run += [
        "schedule.warmup_steps=1",
        "training.log_every=1",
        "training.checkpoint_every=2",
        "training.eval_every=100",
        "--quiet",
    ]
    two = tmp_path / "two"
    torchrun = [script("torchrun"), "--standalone", "--nproc_per_node=2", "--no-python", script("cipher-train")]
    r = run_cli(*torchrun, *run, "--out", two, env={"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    draws, windows = [], {}  # the windows of each training micro-batch, in the order the trainer drew them
    iterate = Loader.__iter__

    def watched(self):
        for batch in iterate(self):
            if self.split == "train":
                draws.append(batch["input_ids"].tolist())
            yield batch

    monkeypatch.setattr(Loader, "__iter__", watched)
    for name, extra in (("one", []), ("resumed", ["--resume", two / "checkpoints/step_0000002"])):
        draws.clear()
        res = in_process(*run, "training.grad_accum=2", "--out", tmp_path / name, *extra)
        assert res.code == 0, res.err[-2000:]
        windows[name] = list(draws)
    assert len(windows["one"]) == 8 and windows["resumed"] == windows["one"][4:]  # 2 micro-batches x 2 windows a step
    cyrillic = [
        any(i in (0xD0, 0xD1) for row in mb for i in row) for mb in windows["one"]
    ]  # UTF-8's Cyrillic lead bytes
    assert not any(cyrillic[:4]) and any(cyrillic[4:]), cyrillic  # the first phase reads Latin only, the second both
    losses = {n: [row["loss"] for row in rows(tmp_path / n) if "loss" in row] for n in ("two", "one", "resumed")}
    assert losses["two"] == pytest.approx(losses["one"], rel=1e-4)  # the same global batches, summed in another order
    assert losses["resumed"] == pytest.approx(losses["one"][2:], rel=1e-4)  # and the weights and optimizer carried over
    elastic = json.loads((tmp_path / "resumed/record.json").read_text())["source_checkpoint"]["elastic"]
    assert elastic["world_size"] == {"from": 2, "to": 1} and elastic["rng"] == RESEED_RULE
    assert elastic["global_batch"]["windows"] == 4


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_shards_prepared_from_a_datasets_stream_hold_every_row(kind, tmp_path):
    "The hub code path on local files: rows read through `datasets` (jsonl, parquet) land in the shards, each whole."
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cipher_nb.data.shards import ShardStream

    texts = [f"row {i}: " + "abcdefgh"[: 1 + i % 8] * (1 + i % 5) for i in range(40)]
    if kind == "jsonl":
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    else:
        path = tmp_path / "rows.parquet"
        pq.write_table(pa.table({"text": texts}), path, row_group_size=16)
    data = load_config(None, ["data.source=files", f"data.path={path}", "data.heldout_frac=0"]).data
    m = prepare_shards(data, tmp_path / "shards", procs=1, progress=False)
    stream, codec, got = ShardStream(tmp_path / "shards", "train", 0, 1, seed=0, epochs=1), build_codec(data), []
    while (ids := stream.next_doc()) is not None:
        got.append(bytes(int(i) for i in ids if i < 256).decode())  # the document's bytes, without BOS and EOS
    assert sorted(got) == sorted(texts) and m["tokens"]["train"] == sum(len(t) + 2 for t in texts), (
        m["tokens"],
        got[:3],
    )
    assert codec.vocab_size == m["vocab"]


SLOW_PREPARE = """import sys, time
import cipher_nb.persist.shards as s
from cipher_nb.cli import run_command
real = s.encode_shard
def slow(*a, **k):  # every shard takes a minute: the signal lands while the workers tokenize
    time.sleep(60)
    return real(*a, **k)
s.encode_shard = slow
raise SystemExit(run_command(s.cipher_data, sys.argv[1:], pos=["preset"]))
"""


def children(pid: int) -> list:
    "The live (not zombie) processes whose parent is `pid`, from /proc."
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc (Linux)")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_prepare_ends_its_workers_and_leaves_no_temporary_file(tmp_path, signum):
    "SIGTERM or SIGINT: exit 0, one line, the workers gone at once (not after their shard), temporaries removed."
    out = tmp_path / "shards"
    out.mkdir()
    (out / ".main.train.00000.bin.tmp-999999").write_bytes(b"left by a killed prepare")
    args = ["prepare", *MOCK, "--out", str(out), "--procs", "2", "--shard-mb", "0.02", "--quiet"]
    p = subprocess.Popen([sys.executable, "-c", SLOW_PREPARE, *args], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while len(children(p.pid)) < 2 and time.time() < deadline:
        time.sleep(0.1)
    workers = children(p.pid)
    assert len(workers) >= 2, "the prepare never started its two workers"
    p.send_signal(signum)
    err = p.communicate(timeout=60)[1]
    deadline = time.time() + 20
    while any(alive(w) for w in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert not [w for w in workers if alive(w)], "a worker outlived its prepare"
    assert p.returncode == 0, err
    says = (
        f"stopped by {signal.Signals(signum).name}: the finished shards in {out} are kept; the same command continues"
    )
    assert err.strip().splitlines() == [f"cipher-data: {says}"]
    assert list(out.glob(".*.tmp-*")) == []


def test_cipher_eval_reads_the_heldout_split_of_a_model_trained_on_shards(prepared, tmp_path):
    "cipher-eval on a shards-trained export: the held-out documents decoded from the shards, as on the fly."
    from cipher_nb.data.sources import source_documents
    from cipher_nb.eval.harness import bits_per_byte, cipher_eval, load_model

    run = tmp_path / "run"
    r = in_process(*TINY, "data.source=shards", f"data.path={prepared}", "--max-steps", "2", "--out", run, "--quiet")
    assert r.code == 0, r.err[-2000:]
    res = cipher_eval(str(run / "final"), docs=4)
    model, cfg, codec = load_model(run / "final", "cpu")
    fly = load_config(None, MOCK).data
    texts = [d[: fly.max_bytes or None] for d in source_documents(fly, "heldout", limit=4)]
    expected = bits_per_byte(model, codec, texts, cfg.training.seq_len, cfg.training.batch_size)
    assert res["heldout"] == pytest.approx(expected, rel=1e-6)


def test_a_prepare_in_two_processes_writes_what_one_process_writes(tmp_path):
    "cipher-data prepare --procs 2 to the end: the same manifest as one process."
    args = ["prepare", *MOCK, "--shard-mb", "0.02", "--quiet"]
    for n in (1, 2):
        r = subprocess.run(
            [script("cipher-data"), *args, "--out", str(tmp_path / f"p{n}"), "--procs", str(n)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
    one, two = (json.loads((tmp_path / f"p{n}" / "manifest.json").read_text()) for n in (1, 2))
    assert [s["sha256"] for s in one["shards"]] == [s["sha256"] for s in two["shards"]] and len(one["shards"]) > 2
