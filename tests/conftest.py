import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args, timeout=600, env=None, cwd=None):
    "Run a console script (or python -m module) in a subprocess; return the CompletedProcess."
    e = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=e, cwd=cwd or ROOT)


@pytest.fixture
def root():
    return ROOT
