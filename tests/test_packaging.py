"The wheel a user installs ships every module and subpackage, and each imports from it, not from this checkout."

import subprocess
import sys
import zipfile

from conftest import ROOT, run_cli


def test_the_wheel_ships_and_imports_every_module(tmp_path):
    r = run_cli(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(ROOT))
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("cipher_nb-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    ours = {p.relative_to(ROOT).as_posix() for p in (ROOT / "cipher_nb").rglob("*.py")}
    assert ours <= shipped, f"missing from the wheel: {sorted(ours - shipped)}"
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    modules = sorted(n.removesuffix(".py").replace("/", ".").removesuffix(".__init__") for n in ours)
    modules = [m for m in modules if not m.endswith("__main__")]  # importing it would run cipher-train
    code = f"import importlib, cipher_nb\nfor m in {modules}: importlib.import_module(m)\nprint(cipher_nb.__file__)"
    env = {"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith(str(tmp_path / "site")), out.stdout
