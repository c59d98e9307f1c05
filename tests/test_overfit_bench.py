"benchmarks/overfit.py's pure parts: the contenders' names and overrides, and how the corpus is cut into splits."

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

spec = importlib.util.spec_from_file_location("overfit", Path(__file__).parent.parent / "benchmarks/overfit.py")
overfit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(overfit)


def test_contenders_combine_the_fixes():
    a = SimpleNamespace(dropout=0.1, memory_wd=0.05)
    assert overfit.contender_overrides(a, "recipe") == []
    assert overfit.contender_overrides(a, "recipe+dropout+stop") == ["model.dropout=0.1"]  # stopping is the loop's
    assert overfit.contender_overrides(a, "recipe+all") == ["model.dropout=0.1", "optim.memory_weight_decay=0.05"]
    assert overfit.contender_parts("minimal-gpt") == ()
    for bad in ("recipe+dropuot", "moe+stop", "recipe+"):
        with pytest.raises(SystemExit):
            overfit.contender_parts(bad)


def test_the_corpus_is_cut_into_whole_files_in_order(tmp_path):
    files = []
    for i, size in enumerate((400, 0, 300, 500, 200, 100)):
        files.append(tmp_path / f"f{i}")
        files[-1].write_bytes(b"x" * size)
    cut = overfit.cut_corpus(files, dict(train=600, val=300, test=100))
    assert {k: [f.name for f in v] for k, v in cut.items()} == dict(train=["f0", "f2"], val=["f3"], test=["f4"])
    with pytest.raises(SystemExit, match="too few bytes"):
        overfit.cut_corpus(files, dict(train=5000))


def run(name, seed, test):
    return dict(name=name, seed=seed, test=test, val=test, train=test - 0.5, gap=0.5, steps=9, planned=9, best_step=9)


def test_each_fix_gets_a_paired_verdict_against_the_recipe():
    runs = [run("recipe", s, t) for s, t in enumerate((2.0, 2.1, 1.9))]
    runs += [run("recipe+dropout", s, t) for s, t in enumerate((2.05, 2.12, 1.98))]  # +0.05 +0.02 +0.08
    table = overfit.budget_table(runs, ["recipe", "recipe+dropout"], 240.0)
    assert "- recipe+dropout - recipe: +0.0500 [" in table and "over 3 seeds, signs +++" in table
    assert "recipe - minimal-gpt" not in table and "vs minimal-gpt" not in table  # no baseline ran: no column
    head, rule, row = table.splitlines()[2:5]
    assert head.count("|") == rule.count("|") == row.count("|") == 8
    runs += [run("minimal-gpt", s, t) for s, t in enumerate((2.1, 2.2, 2.0))]
    head, rule, row = overfit.budget_table(runs, ["minimal-gpt", "recipe"], 240.0).splitlines()[2:5]
    assert "| vs minimal-gpt, same seed |" in head and head.count("|") == rule.count("|") == row.count("|") == 9
    recipe = overfit.budget_table(runs, ["minimal-gpt", "recipe"], 240.0).splitlines()[5]
    assert recipe.startswith("| recipe | 2.0000 ± 0.1000 | -0.1000 (3/3 ahead) | ")
    one = overfit.budget_table([r for r in runs if r["seed"] == 0], ["recipe", "recipe+dropout"], 240.0)
    assert "paired by seed" not in one  # one seed has no interval
