"benchmarks/quality.py's comparison arithmetic (per-seed differences, tables) and its minimal GPT baseline."

import argparse
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

spec = importlib.util.spec_from_file_location("quality", Path(__file__).parent.parent / "benchmarks/quality.py")
quality = importlib.util.module_from_spec(spec)
spec.loader.exec_module(quality)
import minimal_gpt  # noqa: E402  (benchmarks/ is on the path once quality is loaded)


def run(name, seed, bpb):
    return dict(
        name=name,
        seed=seed,
        bpb=bpb,
        steps=10,
        tok_per_s=1.0,
        params=1e6,
        active=1e6,
        peak_gb=0.1,
        used=1.0,
        budget=8,
        clock="cpu",
        threads=1,
    )


def test_paired_matches_seeds_not_order():
    dense = [run("dense", 0, 2.0), run("dense", 1, 2.5)]
    moe = [run("moe", 1, 2.4), run("moe", 0, 2.1), run("moe", 2, 1.0)]  # seed 2 has no dense partner: left out
    assert [round(d, 6) for d in quality.paired(moe, dense)] == [-0.1, 0.1]


def test_table_weighs_the_gap_by_the_paired_spread():
    # seed 1 is harder for both: the unpaired spread is 0.3536, the per-seed gap is -0.05 on both seeds
    runs = [run("dense", 0, 2.0), run("dense", 1, 2.5), run("moe", 0, 1.95), run("moe", 1, 2.45)]
    row = next(line for line in quality.table(runs, ["dense", "moe"]).splitlines() if line.startswith("| moe |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1] == "2.2000 ± 0.3536"
    assert cells[2] == "-0.0500 ± 0.0000"
    assert cells[3] == "2/2 seeds"


def test_budget_takes_seconds_or_a_duration():
    assert [quality.parse_budget(x) for x in ("90", "90s", "1.5m", "2h")] == [90.0, 90.0, 90.0, 7200.0]
    with pytest.raises(argparse.ArgumentTypeError):
        quality.parse_budget("ninety")


def test_table_reports_both_references_and_every_seed():
    runs = [
        run("minimal-gpt", 0, 2.1),
        run("minimal-gpt", 1, 2.6),
        *(run("dense", s, b) for s, b in ((0, 2.0), (1, 2.5))),
    ]
    runs += [run("moe", 0, 1.95), run("moe", 1, 2.45)]
    names = ["minimal-gpt", "dense", "moe"]
    row = next(line for line in quality.table(runs, names).splitlines() if line.startswith("| moe |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[2:6] == ["-0.0500 ± 0.0000", "2/2 seeds", "-0.1500 ± 0.0000", "2/2 seeds"]
    seeds = quality.seed_table(runs, names).splitlines()
    assert seeds[2] == "| seed | minimal-gpt | dense | moe | dense - minimal-gpt | moe - minimal-gpt | moe - dense |"
    assert seeds[5] == "| 1 | 2.6000 | 2.5000 | 2.4500 | -0.1000 | -0.1500 | -0.0500 |"


def test_verdicts_state_the_interval_per_pair():
    # moe - dense per seed: -0.05, -0.04, -0.06: mean -0.05, sd 0.01, t(0.975, 2) = 4.303 from a printed table,
    # interval -0.05 +- 4.303 * 0.01 / sqrt(3) = [-0.0748, -0.0252]; moe+bp - dense: +0.06, -0.04, -0.05: mean -0.01,
    # sd 0.0608, interval -0.01 +- 0.1511: no verdict
    runs = [run("dense", s, 2.0) for s in range(3)] + [
        run("moe", s, 2.0 + d) for s, d in enumerate((-0.05, -0.04, -0.06))
    ]
    runs += [run("moe+bp", s, 2.0 + d) for s, d in enumerate((0.06, -0.04, -0.05))]
    lines = quality.verdict_table(runs, ["dense", "moe", "moe+bp"]).splitlines()[2:]
    assert lines == [
        "- moe - dense: -0.0500 [-0.0748, -0.0252] over 3 seeds, signs ---: moe better",
        "- moe+bp - dense: -0.0100 [-0.1611, +0.1411] over 3 seeds, signs +--: cannot tell at this budget with 3 seeds",
    ]
    assert quality.verdict_table(runs[3:], ["moe", "moe+bp"]) == ""  # no reference ran: no section


def test_windows_score_every_target_once():
    for T in (30, 64, 100, 256):
        seen = [p for s, first in minimal_gpt.windows(T, 64) for p in range(max(s, first), min(T, s + 64))]
        assert sorted(seen) == list(range(T)), T


def test_minimal_gpt_trains_and_is_scored_by_heldout_metrics():
    from cipher_nb.data.codecs import ByteCodec
    from cipher_nb.monitor.metrics import heldout_metrics

    codec = ByteCodec()
    text = b"def f(x):\n    return x + 1\n" * 40

    def batch(T):  # rows of one document each: BOS + bytes in, bytes + EOS out
        ids = torch.as_tensor(codec.encode_doc(text[: T - 1]))
        rows = ids.expand(4, -1)
        return dict(input_ids=rows[:, :-1], labels=rows[:, 1:], doc_ids=torch.zeros(4, T, dtype=torch.long))

    loader = (batch(128) for _ in range(100))
    tr = minimal_gpt.MinimalTrainer(loader, steps=20, seed=0)
    losses = [tr.train_step() for _ in range(20)]
    assert tr.step == 20 and tr.tokens == 20 * 12 * 64
    assert losses[-1] < losses[0] - 1.0, losses  # it learns the repeated line

    lengths = torch.as_tensor(codec.byte_lengths)
    tr.model.eval()
    for T in (64, 256):  # one window, and a sliding window over a row longer than the context
        held = [batch(T)]
        got = heldout_metrics(minimal_gpt.HeldoutView(tr.model), held, lengths)["val/bpb"]
        # independently: every byte target scored with its own full history up to 64 bytes, EOS left out
        x, y = minimal_gpt.to_bytes(held[0]["input_ids"], held[0]["labels"])
        nats, n = 0.0, 0
        with torch.no_grad():
            for t in range(T):
                if y[0, t] == -100:
                    continue
                s = max(0, t - 63) if T <= 64 else [s for s, f in minimal_gpt.windows(T, 64) if max(s, f) <= t][-1]
                logp = torch.log_softmax(tr.model(x[:, s : t + 1])[:, -1].double(), -1)
                nats -= logp[torch.arange(4), y[:, t]].sum().item()
                n += 4
        assert n == 4 * (T - 1)  # the EOS target does not count
        assert abs(got - nats / n / math.log(2)) < 1e-4, (T, got, nats / n / math.log(2))


def test_muon_contenders_add_the_optimizer_to_their_base():
    from cipher_nb.config.load import Config

    cfg = Config()
    assert quality.contender_overrides("moe+muon", cfg) == ["optim.name=muon"]
    assert quality.contender_overrides("dense+muon", cfg) == ["model.moe.n_routed=0", "optim.name=muon"]
    assert quality.contender_overrides("moe+muonx", cfg) == ["optim.name=muon", "optim.muon_experts=true"]


def test_heldout_rows_at_the_trained_length_cover_the_same_bytes():
    from cipher_nb.config.load import Config

    cfg = Config()
    cfg.training.seq_len, cfg.training.eval_batches = 256, 10
    assert quality.heldout_overrides(cfg, 64) == ["training.seq_len=64", "training.eval_batches=40"]
    assert quality.heldout_overrides(cfg, 100) == ["training.seq_len=100", "training.eval_batches=26"]  # ceil
    assert quality.trained_length("minimal-gpt", cfg) == minimal_gpt.CONTEXT
    assert quality.trained_length("moe", cfg) == 256
    runs = [{**run("moe", 0, 2.0), "eval_len": 64}]
    row = next(line for line in quality.table(runs, ["moe"]).splitlines() if line.startswith("| moe |"))
    assert [c.strip() for c in row.split("|")[1:-1]][6] == "64"


def test_peak_rss_is_the_child_own_not_the_parent_inherited():
    import subprocess
    import sys

    ballast = torch.ones(100_000_000, dtype=torch.uint8)  # 100 MB resident in this (parent) process
    code = f"import importlib.util as u; s = u.spec_from_file_location('q', {str(quality.__file__)!r}); "
    code += "q = u.module_from_spec(s); s.loader.exec_module(q); print(q.peak_rss_gb())"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert quality.peak_rss_gb() > ballast.numel() / 1e9
    assert child < quality.peak_rss_gb() - 0.05, (child, quality.peak_rss_gb())


def test_moe_muonx_puts_the_experts_on_muon(tmp_path):
    from types import SimpleNamespace

    a = SimpleNamespace(
        config=None, overrides=["model.n_layers=2", "schedule.warmup_steps=1"], plan="steps", clock="cpu"
    )
    tr = quality.contender_trainer(a, "moe+muon", 0, 5, tmp_path / "a")[0]
    assert tr.optimizer.experts is None and any(
        "experts" in n for g in tr.optimizer.adamw.param_groups for n in g["names"]
    )
    tr = quality.contender_trainer(a, "moe+muonx", 0, 5, tmp_path / "b")[0]
    assert [n.rsplit(".", 1)[-1] for n in tr.optimizer.experts.param_groups[0]["names"]][:3] == [
        "w_gate",
        "w_up",
        "w_down",
    ]


def test_a_benchmark_step_moves_the_balancing_bias_as_training_does(tmp_path):
    "`fit_step` runs the callbacks' after_step as `Trainer.fit` does: the MoE contender's bias moves every step."
    from types import SimpleNamespace

    from cipher_nb.model.moe import MoE

    a = SimpleNamespace(
        config=None,
        overrides=["model.n_layers=2", "training.seq_len=32", "schedule.warmup_steps=1"],
        plan="steps",
        clock="cpu",
    )
    tr = quality.contender_trainer(a, "moe", 0, 3, tmp_path / "a")[0]
    blocks = [m for m in tr.raw_model.modules() if isinstance(m, MoE)]
    biases = []
    for _ in range(2):
        quality.fit_step(tr)
        biases.append([m.expert_bias.clone() for m in blocks])
    assert blocks and all(b.abs().sum() > 0 for b in biases[0]), "the bias never moved: no after_step"
    assert all(not torch.equal(b0, b1) for b0, b1 in zip(*biases))  # and again at the next step


def test_fixed_steps_of_a_time_budget_recipe_are_planned(tmp_path):
    """`--plan steps` fixes the steps of a recipe with a time budget: planned from the start, so its MoE's bias takes
    the first steps' solved shift from step 1 (against the same step without it: `model.moe.center_steps=0`)."""
    from types import SimpleNamespace

    from cipher_nb.model.moe import MoE

    over = ["model.n_layers=2", "training.seq_len=32", "schedule.warmup_steps=1", "schedule.time_budget=90s"]
    biases = []
    for extra in ([], ["model.moe.center_steps=0"]):
        a = SimpleNamespace(config=None, overrides=over + extra, plan="steps", clock="cpu")
        tr = quality.contender_trainer(a, "moe", 0, 1600, tmp_path / f"a{len(extra)}")[0]  # 1600 = CENTER_PLAN x 200
        assert tr.schedule.planned and tr.schedule.horizon == 1600
        quality.fit_step(tr)
        biases.append([m.expert_bias.clone() for m in tr.raw_model.modules() if isinstance(m, MoE)])
    assert biases[0] and all(not torch.equal(s, b) for s, b in zip(*biases)), "the shift waited for a plan"


def test_the_calibration_times_the_steady_step_not_the_first_steps_solve(tmp_path):
    """The calibration's trainer plans a long run, as a contender's run of many steps does, but times the step past
    the first steps' solved shift (which that run pays only over its first `center_steps`); a run's trainer solves."""
    from types import SimpleNamespace

    over = ["model.n_layers=2", "training.seq_len=32", "schedule.warmup_steps=1"]
    a = SimpleNamespace(config=None, overrides=over, plan="steps", clock="cpu")
    solving = []
    for tr in (
        quality.contender_trainer(a, "moe", 0, 10**6, tmp_path / "run")[0],
        quality.calibration_trainer(a, "moe", tmp_path / "cal"),
    ):
        quality.fit_step(tr)
        solving.append(next(cb.solving for cb in tr.callbacks if hasattr(cb, "solving")))
    assert solving == [True, False]
    assert a.overrides == over  # the calibration's override stays out of the runs' overrides
    assert quality.calibration_trainer(a, "dense", tmp_path / "dense").raw_model  # a dense model takes it too


@pytest.mark.parametrize(
    "args, says",
    [(["--jobs", "0"], "--jobs must be at least 1"), (["--contenders", "nope"], "unknown contender 'nope'")],
)
def test_usage_errors_are_one_line_and_exit_2(args, says):
    "A usage error ends at once (--jobs 0 once waited forever), exit 2, its line last, no traceback."
    r = subprocess.run([sys.executable, quality.__file__, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and says in r.stderr.strip().splitlines()[-1] and "Traceback" not in r.stderr, r.stderr


def test_unequal_spends_are_flagged_not_read_as_equal_time():
    "Runs that used the budget within 10 points of each other pass quietly; a contender 20 points over is named."
    even = [{**run("dense", s, 2.0), "used": 8.4} for s in range(3)] + [
        {**run("moe", s, 2.0), "used": 8.8} for s in range(3)
    ]
    assert quality.spend_note(even, ["dense", "moe"]) == ""
    over = [{**r, "used": 9.6} if r["name"] == "moe" else r for r in even]  # +20% against dense's +5%
    note = quality.spend_note(over, ["dense", "moe"])
    assert note.startswith("unequal time: moe's runs used +20% of the budget (median), dense's +5%"), note
