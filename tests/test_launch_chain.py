"""launch/chain.sh end to end on CPU: the GPU presets' release chain (tokenizer, shards, plan, pretraining,
refinement, SFT, gates, evaluation, mirror) with the same commands, on the presets shrunk to CPU size (tiny widths, a
few steps, local data prepared as shards, fp32, one process under torchrun); and a chain stopped by a bad SFT file."""

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, WIDTH_32, run_cli, stop_once_saved

from cipher_nb.data.corpora import mock_docs

# the h100 preset at CPU size: a 320-id tokenizer, a top-1 MoE of width 32, 64-token windows, no compile
H100 = [*WIDTH_32, "model.vocab=320", "model.moe.n_shared=1", "model.moe.top_k=1", "model.moe.n_pop_a=0"]
CPU = [
    "training.seq_len=64",
    "training.batch_size=4",
    "training.precision=fp32",
    "training.compile=false",
    "training.device=cpu",
    "training.eval_batches=2",
    "data.num_workers=0",
    "data.pin_memory=false",
]
# the Spider preset at CPU size: its byte model with a recurrent core of 3 loops (ACT halting, loop LoRA), MLA,
# shared-projection experts, Engram memory and the boundary predictor, at width 32; its six-source curriculum kept,
# each source read from a few mock documents of its script
SPIDER = [
    "model.d_model=32",
    "model.n_layers=3",
    "model.d_ff=64",
    "model.recurrence.n_prelude=1",
    "model.recurrence.n_core=1",
    "model.recurrence.n_coda=1",
    "model.recurrence.n_loops=3",
    "model.recurrence.loop_lora_rank=2",
    "model.attention.n_heads=2",
    "model.attention.head_dim=16",
    "model.attention.kv_lora_rank=16",
    "model.attention.rope_head_dim=8",
    "model.moe.n_routed=4",
    "model.moe.top_k=1",
    "model.moe.shared_inter=64",
    "model.moe.expert_rank=8",
    "model.engram.layers=[1]",
    "model.engram.dim=16",
    "model.engram.table_size=101",
    "training.grad_accum=1",
]
SCRIPTS = dict(english="latin", russian="cyrillic", chinese="cjk", telugu="telugu", code="code", math="math")
# a pretraining horizon of its own, and a rate that moves the routers within it (the gate reads them)
PRETRAIN = "schedule.max_steps=16 schedule.warmup_steps=2 schedule.lr=3e-3"
SFT = "sft.heldout_frac=0.2"


def corpus(folder: Path, script: str, n: int) -> Path:
    "`n` documents of the mock corpus's `script` as text files: a local corpus the chain prepares as shards."
    folder.mkdir(parents=True)
    for i, doc in enumerate(mock_docs(script)[:n]):
        (folder / f"doc{i:03d}.txt").write_bytes(doc)
    return folder


def sft_file(path: Path, n: int = 40, long: int = 0) -> Path:
    "Short sums as conversations, and `long` words of one more conversation (over any CPU window) when asked."
    convs = [[f"What is {i} plus {i % 7}?", f"{i + i % 7}."] for i in range(n)]
    convs += [["Repeat the river.", " ".join(["river"] * long)]] if long else []
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in convs]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chain(tmp_path, preset, *overrides, **env):
    "launch/chain.sh PRESET OVERRIDES with one CPU process per stage; runs in tmp_path/runs, PERSIST tmp_path/persist."
    e = {
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PY": sys.executable,
        "NPROC": "1",
        "PERSIST": str(tmp_path / "persist"),
        "RUNS": str(tmp_path / "runs"),
        "PREFLIGHT_ARGS": "--skip-gpu --skip-plan",  # the chain's plan step planned it (for an H100)
        "EVAL_DOCS": "4",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        **env,
    }
    return run_cli("bash", str(ROOT / "launch/chain.sh"), f"examples/configs/{preset}.yaml", *overrides, env=e)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def h100(tmp_path_factory):
    "The h100 chain, run once: its directory and the finished process."
    d = tmp_path_factory.mktemp("chain")
    data = [f"data.path={corpus(d / 'corpus', 'latin', 32)}", "data.source=files", "data.subset="]
    mc = d / "mc.jsonl"
    mc.write_text(
        "".join(
            json.dumps({"context": f"The {w} is", "choices": [" large", " quiet"], "label": i % 2}) + "\n"
            for i, w in enumerate(["river", "city", "house", "road"])
        )
    )
    sft = f"{SFT} sft.data={sft_file(d / 'sft.jsonl')}"
    r = chain(d, "h100", *H100, *CPU, *data, RUN_NAME="h", PRETRAIN_ARGS=PRETRAIN, SFT_ARGS=sft, MC=str(mc))
    return d, r


def test_h100_chain_runs_every_stage_from_the_one_before(h100):
    d, r = h100
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    persist, runs = d / "persist", d / "runs"
    assert (persist / "tokenizers/h100.json").is_file() and (persist / "shards/h100/manifest.json").is_file()
    for stage in ("pretrain", "refinement", "sft"):
        run = runs / f"h-{stage}"
        assert (run / "final/COMPLETE").exists(), stage
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert cfg["data"]["source"] == "shards" and cfg["data"]["path"] == str(persist / "shards/h100"), stage
        assert (persist / f"h-{stage}/checkpoints").is_dir(), stage  # every checkpoint mirrored as it was saved
    cfg = {s: yaml.safe_load((runs / f"h-{s}/config.yaml").read_text()) for s in ("refinement", "sft")}
    rec = {s: json.loads((runs / f"h-{s}/record.json").read_text()) for s in ("pretrain", "refinement", "sft")}
    # the lineage: each stage starts from the final export of the one before
    assert cfg["refinement"]["stage"]["init"] == str(runs / "h-pretrain/final")
    assert cfg["sft"]["stage"]["init"] == str(runs / "h-refinement/final")
    assert rec["refinement"]["source_checkpoint"]["stage"] == "pretrain"
    assert rec["sft"]["source_checkpoint"]["stage"] == "refinement"
    # pretraining to its own horizon, refinement one pass over the shards, SFT on the guide's schedule
    assert rec["pretrain"]["schedule"]["max_steps"] == 16
    assert rec["refinement"]["schedule"]["set_by"] == "schedule.epochs = 1"
    assert cfg["sft"]["schedule"]["lr"] == 2e-5 and rec["sft"]["schedule"]["set_by"] == "schedule.epochs = 3"
    assert (runs / "h-pretrain/gate.json").is_file() and "gate PASS" in r.stdout  # pretraining, gated
    assert "mc" in json.dumps(rec["sft"]).lower() and "bits per byte" in r.stdout  # the evaluation, MC recorded
    # the mirror: the SFT export on the persistent volume, every file with the local SHA-256
    local, mirror = runs / "h-sft/final", persist / "h-sft/final"
    files = sorted(p.relative_to(local) for p in local.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(mirror) for p in mirror.rglob("*") if p.is_file())
    assert all(sha256(local / f) == sha256(mirror / f) for f in files)
    assert "chain: done" in r.stderr


def test_spider_chain_prepares_its_curriculum_as_shards_and_runs_every_stage(tmp_path):
    "flexitokens-h100: its curriculum of six sources prepared into one shards directory, each source reading its own."
    data = ["data.heldout_frac=0.2"]  # a few held-out documents of 24 for the evaluation
    for name, script in SCRIPTS.items():
        folder = corpus(tmp_path / f"corpus/{name}", script, 4)
        data += [f"data.sources.{name}.{k}" for k in ("source=files", f"path={folder}", "subset=")]
    sft = f"{SFT} sft.data={sft_file(tmp_path / 'sft.jsonl')}"
    pretrain = "schedule.target_tokens=8192 schedule.warmup_steps=2 schedule.lr=3e-3"  # its token target, shrunk
    pretrain += " training.log_every=2"  # 8 rows for the gate's trends, not 2 (its routers barely move in 16 steps)
    env = dict(RUN_NAME="s", PRETRAIN_ARGS=pretrain, SFT_ARGS=sft)
    r = chain(tmp_path, "flexitokens-h100", *SPIDER, *CPU, "training.seq_len=128", *data, **env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    shards, runs = tmp_path / "persist/shards/flexitokens-h100", tmp_path / "runs"
    assert not (tmp_path / "persist/tokenizers").exists()  # a byte model: no tokenizer
    assert {s["source"] for s in json.loads((shards / "manifest.json").read_text())["shards"]} == set(SCRIPTS)
    for stage in ("pretrain", "refinement", "sft"):
        cfg = yaml.safe_load((runs / f"s-{stage}/config.yaml").read_text())
        assert {n: (s["source"], s["path"]) for n, s in cfg["data"]["sources"].items()} == {
            n: ("shards", str(shards)) for n in SCRIPTS
        }
        assert len(cfg["data"]["phases"]) == 5 and (runs / f"s-{stage}/final/COMPLETE").exists()
    rec = {s: json.loads((runs / f"s-{s}/record.json").read_text()) for s in ("pretrain", "refinement", "sft")}
    plan = rec["pretrain"]["schedule"]  # the token target buys 8,192 // (4 x 128) steps
    assert (plan["set_by"], plan["max_steps"]) == ("schedule.target_tokens = 8,192", 16)
    assert rec["refinement"]["schedule"]["set_by"] == "schedule.epochs = 1"  # one pass: each source's tokens once
    # pretraining read its curriculum through the replay plans: resumable on another number of GPUs
    (state,) = torch.load(runs / "s-pretrain/checkpoints/step_0000016/state.pt", weights_only=True)["data"]
    assert state["layout"]["plan"] == "shards" and [e for e, _ in state["layout"]["phases"]] == [5, 8, 12, 15, 16]
    assert rec["sft"]["source_checkpoint"]["stage"] == "refinement"
    assert (tmp_path / "persist/s-sft/final.sha256").is_file() and "chain: done" in r.stderr


def test_a_bad_sft_file_stops_the_chain_at_sft_with_exit_2(h100, tmp_path):
    "An SFT conversation over the sequence cap: the same chain, relaunched, stops at SFT with 2; the rest is kept."
    d, r = h100
    assert r.returncode == 0, r.stderr[-3000:]
    for kept in ("tokenizers", "shards"):
        shutil.copytree(d / f"persist/{kept}", tmp_path / f"persist/{kept}")
    for stage in ("pretrain", "refinement"):  # the finished stages of a chain relaunched with another SFT file
        shutil.copytree(d / f"runs/h-{stage}", tmp_path / f"runs/h-{stage}")
    before = {s: sha256(tmp_path / f"runs/h-{s}/final/model.safetensors") for s in ("pretrain", "refinement")}
    data = [f"data.path={d / 'corpus'}", "data.source=files", "data.subset="]
    sft = f"{SFT} sft.data={sft_file(tmp_path / 'long.jsonl', long=200)}"
    r = chain(tmp_path, "h100", *H100, *CPU, *data, RUN_NAME="h", PRETRAIN_ARGS=PRETRAIN, SFT_ARGS=sft)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert "chain: step 'sft' failed (exit 2)" in r.stderr and "longer than training.seq_len" in r.stdout
    assert "pretrain finished already" in r.stderr and "refinement finished already" in r.stderr  # not trained again
    for s, h in before.items():
        assert sha256(tmp_path / f"runs/h-{s}/final/model.safetensors") == h
    assert not (tmp_path / "runs/h-sft/metrics.jsonl").exists() and not (tmp_path / "persist/h-sft").exists()


@pytest.mark.parametrize("code, want", [(3, 3), (4, 1)])
def test_torchrun_launch_exits_with_a_workers_2_or_3(tmp_path, code, want):
    "torchrun exits 1 whatever its workers did: the launch reads the root cause's code and keeps 2 (bad input) and 3."
    launch = (
        f'source launch/common.sh; launch_torchrun "$0" --standalone --nproc_per_node=1 --no-python sh -c "exit {code}"'
    )
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PY": sys.executable, "OMP_NUM_THREADS": "1"}
    r = run_cli("bash", "-c", launch, str(tmp_path / "run"), env=env)
    assert r.returncode == want, r.stderr[-3000:]
    assert f"exitcode  : {code}" in r.stderr  # torchrun's report still reaches the console
    assert ("its first failed worker 3: exit 3" in r.stderr) == (code == 3)


def test_the_spider_presets_chain_as_launched_reads_its_curriculum_from_shards():
    "DRY_RUN=1 on the shipped flexitokens-h100: each stage's command, its lineage, refinement resolving to one pass."
    import shlex

    from cipher_nb.config.load import load_config

    env = {"DRY_RUN": "1", "PERSIST": "/mnt/p", "RUN_NAME": "a", "PY": sys.executable}
    r = run_cli("bash", str(ROOT / "launch/chain.sh"), "examples/configs/flexitokens-h100.yaml", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    cmds = [shlex.split(line) for line in (r.stdout + r.stderr).splitlines() if line.strip() and "==" not in line]
    runs = [c for c in cmds if c[0] == "torchrun"]
    pin = [
        "cipher-data",
        "pin",
        "examples/configs/flexitokens-h100.yaml",
        "--out",
        "runs/a-pinned/flexitokens-h100.yaml",
    ]
    prep = next(c for c in cmds if c[:2] == ["cipher-data", "prepare"])
    assert cmds.index(pin) < cmds.index(prep)  # its six hub sources pinned before anything reads them
    assert prep[prep.index("--out") + 1] == "/mnt/p/shards/flexitokens-h100" and len(runs) == 3
    stages = [c[c.index("cipher-train") + 2 : c.index("--out")] for c in runs]
    for settings in stages:  # every source of the curriculum read from the one prepared directory
        for name in SCRIPTS:
            assert f"data.sources.{name}.source=shards" in settings
            assert f"data.sources.{name}.path=/mnt/p/shards/flexitokens-h100" in settings
    assert "stage.init=runs/a-pretrain/final" in stages[1] and "stage.init=runs/a-refinement/final" in stages[2]
    preset = "examples/configs/flexitokens-h100.yaml"
    assert load_config(preset, stages[1]).schedule.epochs == 1  # refinement: one pass, the preset's target dropped
    assert load_config(preset, stages[2]).schedule.lr == 2e-5  # SFT: the guide's schedule
    assert ["cipher-gate", "runs/a-pretrain"] in cmds and ["cipher-export", "runs/a-sft", "--mirror", "/mnt/p"] in cmds
    assert next(c for c in cmds if c[0] == "cipher-eval")[1] == "runs/a-sft/final"


def test_a_stop_signal_ends_the_chain_after_the_stage_saves(h100, tmp_path):
    "SIGTERM to the chain's process group during pretraining: the stage saves and stops, the chain ends there with 0."
    d, _ = h100
    for kept in ("tokenizers", "shards"):
        shutil.copytree(d / f"persist/{kept}", tmp_path / f"persist/{kept}")
    data = [f"data.path={d / 'corpus'}", "data.source=files", "data.subset="]
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PY": sys.executable,
        "NPROC": "1",
        "PERSIST": str(tmp_path / "persist"),
        "RUNS": str(tmp_path / "runs"),
        "RUN_NAME": "h",
        "PREFLIGHT_ARGS": "--skip-gpu --skip-plan",
        "PRETRAIN_ARGS": "schedule.max_steps=100000 schedule.warmup_steps=2 training.checkpoint_every=3",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    cmd = ["bash", str(ROOT / "launch/chain.sh"), "examples/configs/h100.yaml", *H100, *CPU, *data]
    code, err = stop_once_saved(cmd, env, tmp_path / "runs/h-pretrain/checkpoints/step_0000003/COMPLETE")
    assert code == 0, err[-3000:]
    assert "chain: stopped by SIGTERM during 'pretrain'" in err and "stopped cleanly" in err, err[-3000:]
    assert not (tmp_path / "runs/h-pretrain/final").exists() and not (tmp_path / "runs/h-refinement").exists()


SPIDER_HUB = [
    "HuggingFaceFW/fineweb-edu",
    "HuggingFaceFW/fineweb-2",
    "codeparrot/codeparrot-clean",
    "HuggingFaceTB/finemath",
]


def hub_cache(folder: Path, paths=SPIDER_HUB) -> dict:
    "A local hub cache holding `main` of each dataset of `paths` (no files, the refs only): {path: its commit}."
    commits = {}
    for i, path in enumerate(paths):
        commits[path] = f"{i + 1:x}" * 40
        ref = folder / f"datasets--{path.replace('/', '--')}/refs/main"
        ref.parent.mkdir(parents=True)
        ref.write_text(commits[path])
    return commits


def test_the_chain_pins_the_spider_presets_hub_sources_from_the_local_cache(tmp_path):
    "Its six hub sources pinned into runs/a-pinned/, and the steps after it read that copy; stopped before training."
    commits = hub_cache(tmp_path / "hub")
    env = dict(RUN_NAME="a", HF_HUB_CACHE=str(tmp_path / "hub"), SHARDS="0", PLAN_ARGS="--gpu none")
    r = chain(tmp_path, "flexitokens-h100", **env)  # cipher-plan refuses the GPU: the chain stops before training
    assert r.returncode == 2 and "chain: step 'memory plan' failed (exit 2)" in r.stderr, r.stderr[-3000:]
    pinned = tmp_path / "runs/a-pinned/flexitokens-h100.yaml"
    sources = yaml.safe_load(pinned.read_text())["data"]["sources"]
    assert {n: s["revision"] for n, s in sources.items()} == {n: commits[s["path"]] for n, s in sources.items()}
    shown = yaml.safe_load(r.stdout.split("\n# ")[0])["data"]["sources"]  # cipher-config's plan reads the copy
    assert {n: s["revision"] for n, s in shown.items()} == {n: s["revision"] for n, s in sources.items()}
    shutil.rmtree(tmp_path / "hub")  # a relaunch pins nothing again: the copy is kept, whatever the cache holds now
    assert chain(tmp_path, "flexitokens-h100", **env).returncode == 2 and pinned.read_text().count(
        commits[SPIDER_HUB[0]]
    )


def test_a_hub_source_not_in_the_cache_stops_the_chain_at_the_pin_with_exit_2(tmp_path):
    "No cached commit and no PIN_API=1: the pin's one line, the chain's, exit 2, nothing written."
    hub_cache(tmp_path / "hub", SPIDER_HUB[:1])  # one dataset of four cached
    r = chain(tmp_path, "flexitokens-h100", RUN_NAME="a", HF_HUB_CACHE=str(tmp_path / "hub"))
    assert r.returncode == 2, r.stderr[-3000:]
    err = [line for line in r.stderr.splitlines() if not line.startswith("== chain")]
    assert len(err) == 2 and "is not in the local cache" in err[0] and "PIN_API=1" in err[1], err
    assert "chain: step 'pin' failed (exit 2" in err[1]
    assert not (tmp_path / "runs/a-pinned/flexitokens-h100.yaml").exists() and not (tmp_path / "persist").exists()


def test_a_preset_with_no_unpinned_hub_source_is_read_as_given():
    "The h100 preset over local files: the pin step prints the preset itself and writes nothing."
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PY": sys.executable, "OMP_NUM_THREADS": "1"}
    script = 'source launch/common.sh; pinned_preset "$0" "$@"'
    r = run_cli("bash", "-c", script, "examples/configs/h100.yaml", "/nonexistent", "data.source=files", env=env)
    assert r.returncode == 0 and r.stdout.strip() == "examples/configs/h100.yaml", r.stderr[-3000:]
