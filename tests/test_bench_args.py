"""The benchmark scripts' usage errors: one line naming the flag, exit 2, no traceback (each once ended in one)."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize(
    "script, args, says",
    [
        ("checkpoint.py", ["--config", "missing.yaml"], "config file 'missing.yaml' does not exist"),
        ("data_throughput.py", ["--rounds", "0"], "--rounds"),
        ("ema_spread.py", ["--steps", "abc"], "--steps"),
        ("generate.py", ["--new", "-5"], "--new"),
        ("overfit.py", ["--seeds", "0"], "--seeds"),
        ("overfit.py", ["--contenders", "nope"], "unknown contender 'nope'"),
        ("shuffle_buffer.py", ["--docs", "-1"], "--docs"),
        ("recurrence.py", ["--steps", "0"], "--steps"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(script, args, says):
    r = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert says in r.stderr.strip().splitlines()[-1], r.stderr


def test_at_least_names_the_bound():
    sys.path.insert(0, str(BENCH))
    import argparse

    from bench_args import at_least, int_list

    assert at_least(1)("3") == 3 and at_least(0.5, float)("0.5") == 0.5
    for bad in ("0", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            at_least(1)(bad)
    assert int_list("760, 800") == [760, 800]
    with pytest.raises(argparse.ArgumentTypeError):
        int_list("1,0")
