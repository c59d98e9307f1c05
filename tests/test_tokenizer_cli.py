"The token-level H100 preset on CPU: refused without a tokenizer (the command given), trained after cipher-tokenizer."

import json
import shutil
import sys
from pathlib import Path

from conftest import ROOT, run_cli

from cipher_nb.data.codecs import TokenizerCodec

H100 = str(ROOT / "examples/configs/h100.yaml")
DATA = ["data.source=stdlib", "model.vocab=512"]  # the tokenizer depends on these: the command carries them
SMALL = [
    "model.d_model=64",
    "model.n_layers=2",
    "model.moe.n_routed=4",
    "model.moe.n_pop_a=2",  # the preset's two populations, two experts each
    "model.moe.top_k=2",
    "model.moe.expert_d_ff=32",
    "training.seq_len=64",
    "training.batch_size=2",
    "training.grad_accum=1",
    "schedule.warmup_steps=1",
    "training.compile=false",
    "training.eval_batches=1",
]


def script(name):
    return shutil.which(name) or str(Path(sys.executable).parent / name)


def test_h100_preset_trains_on_cpu_after_its_tokenizer(tmp_path):
    r = run_cli(script("cipher-train"), H100, *DATA, *SMALL, "--max-steps", "2", "--out", str(tmp_path / "no"))
    assert r.returncode == 2 and "cipher-tokenizer" in r.stderr and "data.source=stdlib" in r.stderr, r.stderr
    assert not (tmp_path / "no").exists()  # refused before anything is written
    tok = tmp_path / "tok.json"
    r = run_cli(script("cipher-tokenizer"), H100, *DATA, "--out", str(tok), "--max-docs", "60")
    assert r.returncode == 0 and f"data.tokenizer={tok}" in r.stdout, r.stderr
    assert TokenizerCodec(tok).vocab_size == 512  # the preset's model.vocab, specials included
    run = tmp_path / "run"
    r = run_cli(
        script("cipher-train"),
        H100,
        *DATA,
        *SMALL,
        f"data.tokenizer={tok}",
        "--max-steps",
        "2",
        "--device",
        "cpu",
        "--out",
        str(run),
        "--quiet",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((run / "record.json").read_text())
    assert rec["codec"]["kind"] == "tokenizer" and rec["codec"]["vocab_size"] == 512, rec["codec"]
    assert rec["codec"]["tokenizer"] == str(tok)
    row = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert row["loss/ortho"] > 0 and 0 <= row["router/cross_pop_overlap"] <= 1, row  # the runbook's populations ran
