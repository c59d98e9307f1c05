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
