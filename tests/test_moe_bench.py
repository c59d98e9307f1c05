"benchmarks/moe.py's own parts: `--profile`'s operator classes, `--keep-freed`'s allocator switch, `--clock`."

import contextlib
import importlib.util
import io
import subprocess
import sys
import time

import torch
from conftest import ROOT

spec = importlib.util.spec_from_file_location("moe_bench", ROOT / "benchmarks/moe.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_operator_classes():
    got = [bench.op_class(k) for k in ("aten::mm", "aten::index_select", "aten::silu", "aten::fill_", "MulBackward0")]
    assert got == ["matmul", "gather / scatter", "elementwise", "other aten", "autograd / python"]


def test_profile_split_puts_the_extra_work_in_its_class():
    "Ours = dense's product plus a gather: the gap is the gather's class, and the shares sum to the whole gap."
    a, idx = torch.randn(256, 256), torch.randint(0, 256, (4096,))
    fns = {"ours": lambda: (a @ a, a.index_select(0, idx)), "dense": lambda: a @ a}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench.profile_step(fns, torch.device("cpu"), steps=3)
    rows = {line[:20].strip(): line[20:].split() for line in out.getvalue().splitlines()[-6:]}
    assert float(rows["gather / scatter"][2]) > 0 and float(rows["gather / scatter"][1]) == 0.0  # dense has none
    assert abs(sum(float(r[3].rstrip("%")) for r in rows.values()) - 100) <= 3  # rounded shares


def test_keep_freed_stops_paging_in_a_large_buffer_afresh():
    "glibc gives a freed 64 MB buffer back, so the next is paged in again; `keep_freed_memory` keeps it (once warm)."
    code = """
import resource, sys, torch
sys.path.insert(0, "benchmarks")
import moe

def faults():
    x = torch.empty(1 << 24); x.fill_(1.0); del x  # 64 MB, written: paged in unless the pages were kept
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(1 << 24); x.fill_(1.0); del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

before = faults()
kept = moe.keep_freed_memory()
faults()  # the first buffer after the switch may land past a small allocation made meanwhile: steady state after it
print(before, faults(), kept)
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    before, after, kept = r.stdout.split()
    assert kept == "True" and int(before) > 8000 and int(after) < 1000, r.stdout  # 16,384 pages of 4 KB


def test_clock_wall_counts_waiting_and_cpu_does_not():
    "A step that sleeps 50 ms: elapsed time counts the sleep, the process's CPU time does not."
    cpu = torch.device("cpu")
    assert bench.timeit(lambda: time.sleep(0.05), cpu, "wall") >= 0.05
    assert bench.timeit(lambda: time.sleep(0.05), cpu, "cpu") < 0.02
