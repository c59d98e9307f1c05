"benchmarks/train_step.py's own parts: what a bare step keeps, and the monitor bench end to end."

import argparse
import importlib.util

import torch
from conftest import ROOT, SMALL_MODEL

from cipher_nb.config.load import load_config
from cipher_nb.model.moe import moe_layers

spec = importlib.util.spec_from_file_location("train_step_bench", ROOT / "benchmarks/train_step.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

SHORT = [*SMALL_MODEL, "training.seq_len=32", "training.batch_size=2", "training.log_every=1"]


def test_a_bare_step_keeps_the_callbacks_that_train(tmp_path):
    "The curriculum and the balancing stay (the bias moves), the monitor goes."
    tr = bench.bare_trainer(load_config(None, [*bench.QUIET, *SHORT]), tmp_path / "run")
    kept = bench.training_callbacks(tr.callbacks)
    names = {type(c).__name__ for c in kept}
    assert {"Curriculum", "MoEBalancing"} <= names and "MonitorCallback" not in names
    assert "MonitorCallback" in {type(c).__name__ for c in tr.callbacks}
    before = [m.expert_bias.clone() for m in moe_layers(tr.raw_model).values()]
    bench.timed_steps(tr, kept, 1)
    after = [m.expert_bias for m in moe_layers(tr.raw_model).values()]
    assert all(not torch.equal(b, a) for b, a in zip(before, after))


def test_monitor_bench_prints_what_watching_costs(capsys):
    bench.bench_monitor(argparse.Namespace(steps=1, rounds=1, overrides=SHORT))
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert "MonitorCallback" in rows["full"] and "MonitorCallback" not in rows["bare"]
    assert "MoEBalancing" in rows["bare"] and "overhead" in rows
