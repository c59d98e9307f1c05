#!/usr/bin/env python3
"""Check the SkyPilot task files with SkyPilot's own parser, offline, before a release.

    python tools/validate_sky.py                  # every launch/sky/*.yaml
    python tools/validate_sky.py launch/sky/node.yaml

SkyPilot cannot join the project's environment (skypilot 0.14 pins `click<8.2`, which `datasets` through
`huggingface_hub` outgrows), so this script keeps its own virtual environment, `.venv-sky` at the repository root
(created and filled with `skypilot==0.14.*` on the first run, reused afterwards; `--venv` puts it elsewhere), and
runs itself again inside it. There, each file goes through `sky.Task.from_yaml` (the YAML schema, the envs
substituted into file_mounts, the resources and the bucket mount parsed) and `Task.validate()` (the workdir and the
file mounts), and the shell of `setup` and `run` must use only SkyPilot's variables, the task's `envs` and names
it sets itself. One line per file, PASS or FAIL with what the parser said; exit 1 on any failure.

SkyPilot runs with HOME in the virtual environment, so a user's `~/.sky` (its config, its cached catalogs) neither
changes the verdict nor is written to. Parsing `resources.accelerators` reads SkyPilot's accelerator catalog, which
SkyPilot downloads on first use; without network the script says so and parses against a stand-in catalog of a few
GPU names, so the other checks still run.
"""

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKYPILOT = "skypilot==0.14.*"
# names the shell itself provides, fine to read in setup or run
SHELL_VARS = {"HOME", "PATH", "PWD", "USER", "SHELL", "HOSTNAME", "CUDA_VISIBLE_DEVICES"}
# the stand-in accelerator catalog used offline: a few GPU names as SkyPilot's common catalog spells them
STAND_IN_GPUS = {"H100": 80, "H200": 141, "A100": 40, "A100-80GB": 80, "L40S": 48, "L4": 24}
CATALOG_MISSING = 3  # the inner run's exit code when the accelerator catalog cannot be fetched


def venv_python(venv: Path) -> Path:
    "The interpreter of the virtual environment `venv`."
    return venv / "bin" / "python"


def sky_env(home: Path) -> dict:
    "The environment SkyPilot runs in here: HOME (where it keeps ~/.sky) in a folder of the script's own."
    env = {**os.environ, "HOME": str(home), "SKY_RUNTIME_DIR": str(home)}
    env.pop("SKYPILOT_CONFIG", None)  # a user's config must not change the verdict
    return env


def ensure_venv(venv: Path) -> Path:
    "Create `venv` with SkyPilot installed unless it already has it; return its interpreter."
    py = venv_python(venv)
    (venv / "home").mkdir(parents=True, exist_ok=True)
    check = (
        subprocess.run([py, "-c", "import sky"], capture_output=True, env=sky_env(venv / "home"))
        if py.exists()
        else None
    )
    has = check is not None and check.returncode == 0
    if not has:
        t0 = time.monotonic()
        print(f"installing {SKYPILOT} into {venv} (once) ...", flush=True)
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", SKYPILOT], check=True)
        print(f"installed in {time.monotonic() - t0:.0f} s", flush=True)
    return py


def shell_names(script: str) -> tuple[set, set]:
    "The variables a shell script reads (`$X`, `${X...}`) and the ones it assigns (`X=` at the start of a word)."
    read = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", script))
    assigned = set(re.findall(r"(?:^|[\s;&|(])([A-Za-z_][A-Za-z0-9_]*)=", script))
    return read, assigned


def undeclared(script: str, envs: set, skypilot_vars: set) -> list:
    "The variables `script` reads that neither SkyPilot, the task's `envs`, the shell nor the script itself sets."
    read, assigned = shell_names(script)
    return sorted(read - envs - skypilot_vars - assigned - SHELL_VARS)


def file_mount_refs(text: str) -> set:
    "The `${X}` references in the file_mounts section of a task file (substituted from `envs` by the parser)."
    return set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", text))


def skypilot_env_vars() -> set:
    "Every SKYPILOT_* variable name SkyPilot defines (read from its constants module)."
    from sky.skylet import constants

    return {v for v in vars(constants).values() if isinstance(v, str) and re.fullmatch(r"SKYPILOT_[A-Z0-9_]+", v)}


def check_file(path: Path, skypilot_vars: set) -> tuple[bool, str]:
    "Parse and validate one task file with SkyPilot; return (passed, what the parser said)."
    import sky
    import yaml

    try:
        task = sky.Task.from_yaml(str(path))
        task.validate()
    except Exception as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        return False, f"{type(e).__name__}: {msg}"
    envs = set(task.envs)
    problems = []
    for part in ("setup", "run"):
        script = getattr(task, part) or ""
        if missing := undeclared(script, envs, skypilot_vars):
            problems.append(f"{part} reads {', '.join(missing)}: neither SkyPilot's nor in envs")
    raw = yaml.safe_load(path.read_text())
    if missing := sorted(file_mount_refs(yaml.safe_dump(raw.get("file_mounts") or {})) - envs):
        problems.append(f"file_mounts use {', '.join(missing)}: not in envs")
    if problems:
        return False, "; ".join(problems)
    res = ", ".join(sorted(str(r) for r in task.resources))
    mounts = ", ".join(f"{k} <- {v.name} ({v.mode.value})" for k, v in task.storage_mounts.items())
    return True, f"{task.name}: {task.num_nodes} node(s), {res}; bucket {mounts or 'none'}; envs {len(envs)}"


def write_stand_in_catalog():
    "Write a tiny accelerator catalog where SkyPilot looks for its own (HOME points at a scratch folder)."
    from sky.catalog import common

    acc = Path(common.get_catalog_path("common/accelerators.csv"))
    meta = Path(common.get_catalog_path("common/metadata.csv"))
    acc.parent.mkdir(parents=True, exist_ok=True)
    acc.write_text("AcceleratorName,Clouds\n" + "".join(f"{g},\"['AWS', 'GCP', 'Azure']\"\n" for g in STAND_IN_GPUS))
    meta.write_text("GPU,MemoryGB,Manufacturer\n" + "".join(f"{g},{m},NVIDIA\n" for g, m in STAND_IN_GPUS.items()))


def catalog_reachable() -> bool:
    "Whether SkyPilot's accelerator catalog loads (cached, or downloaded now)."
    from sky.catalog import common

    try:  # SkyPilot reports the download on stdout: keep it out of the verdict lines
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            common.read_catalog("common/accelerators.csv")["AcceleratorName"]
        return True
    except Exception:
        return False


def inner(files: list, stand_in: bool) -> int:
    "Inside the SkyPilot environment: one line per file; 1 on any failure, CATALOG_MISSING without a catalog."
    if stand_in:
        write_stand_in_catalog()
    elif not catalog_reachable():
        return CATALOG_MISSING
    skypilot_vars = skypilot_env_vars()
    failed = 0
    for f in files:
        ok, said = check_file(Path(f), skypilot_vars)
        failed += not ok
        name = os.path.relpath(f, ROOT) if Path(f).is_relative_to(ROOT) else f
        print(f"{'PASS' if ok else 'FAIL'} {name}: {said}", flush=True)
    import sky

    note = " (offline: accelerator names checked against a stand-in catalog)" if stand_in else ""
    print(f"{len(files) - failed}/{len(files)} task files pass, skypilot {sky.__version__}{note}")
    return 1 if failed else 0


def outer(files: list, venv: Path) -> int:
    "Make or reuse the SkyPilot environment, then run the checks there with HOME in a folder of its own."
    py = ensure_venv(venv)
    cmd = [str(py), __file__, "--inner", *files]
    rc = subprocess.run(cmd, cwd=ROOT, env=sky_env(venv / "home")).returncode
    if rc != CATALOG_MISSING:
        return rc
    print("SkyPilot's accelerator catalog cannot be downloaded here: using a stand-in", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        return subprocess.run([*cmd, "--stand-in-catalog"], cwd=ROOT, env=sky_env(Path(scratch))).returncode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", help="task files (default: launch/sky/*.yaml)")
    p.add_argument("--venv", type=Path, default=ROOT / ".venv-sky", help="SkyPilot's own virtual environment")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stand-in-catalog", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    default = sorted(str(f) for f in (ROOT / "launch" / "sky").glob("*.yaml"))
    files = [str(Path(f).resolve()) for f in a.files] or default
    if not files:
        print("no task files", file=sys.stderr)
        return 2
    if a.inner:
        return inner(files, a.stand_in_catalog)
    return outer(files, a.venv.resolve())


if __name__ == "__main__":
    sys.exit(main())
