#!/usr/bin/env python
"""Cold Run All of each example notebook, in chain order, in a fresh copy of examples/ (no earlier runs), timed
with nbclient under the notebooks' default switch (FULL_RUN = False). From the repository root:

    python tools/runall_timing.py
"""

import shutil
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

root = Path(__file__).resolve().parent.parent
with tempfile.TemporaryDirectory() as d:
    ex = Path(d) / "examples"
    shutil.copytree(root / "examples", ex, ignore=shutil.ignore_patterns("runs"))
    for name in ["01_pretrain", "02_refinement", "03_sft"]:
        nb = nbformat.read(ex / f"{name}.ipynb", as_version=4)
        t0 = time.perf_counter()
        NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(ex)}}).execute()
        print(f"{name}: Run All {time.perf_counter() - t0:.0f} s (cold: no earlier run)", flush=True)
