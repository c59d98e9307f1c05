"""The module graph: every module imports on its own, imports point only to earlier notebooks and never to a
higher band of the package, no private names cross."""

import ast
import re
import subprocess
import sys

import pytest
from conftest import ROOT

PKG = ROOT / "cipher_nb"
# the package's bands, lowest first: a module imports from its own band or a lower one, never a higher one
# (`all`, the one module cipher_nb.all, gathers a notebook user's names from every band, so it sits above them all)
BANDS = ["", "config", "data", "model", "monitor", "optim", "persist", "train", "eval", "viz", "all"]
TOP_BANDS = {"all"}  # bands that are a top-level module, not a subpackage


def notebook_of(path) -> str:
    "The notebook a generated module comes from (nbdev writes it in the module's header)."
    m = re.search(r"File to edit: (?:\.\./)+nbs/(\S+\.ipynb)", path.read_text())
    assert m, f"{path.relative_to(ROOT)} has no nbdev header: is it generated?"
    return m.group(1)


def dotted(path) -> str:
    return ".".join(path.relative_to(PKG).with_suffix("").parts)


MODULES = {dotted(p): notebook_of(p) for p in sorted(PKG.rglob("*.py")) if not p.name.startswith("_")}
PACKAGES = {dotted(p.parent) for p in PKG.rglob("__init__.py") if p.parent != PKG}


def band(module: str) -> int:
    top = module.split(".")[0]
    return BANDS.index(top if "." in module or top in TOP_BANDS else "")


def absolute(module: str, node: ast.ImportFrom) -> str:
    "The dotted name (under cipher_nb) an `ImportFrom` in `module` reads from."
    if node.level == 0:
        return (node.module or "").removeprefix("cipher_nb").removeprefix(".")
    base = module.split(".")[: -node.level]
    return ".".join(base + ([node.module] if node.module else []))


def cipher_imports(tree, module: str = "") -> list:
    "(module, [names]) for each import of a cipher_nb module, by any spelling; `from PKG import leaf` names leaf."
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "cipher_nb"):
            src, names = absolute(module, node), [a.name for a in node.names]
            if src in PACKAGES or src == "":  # from cipher_nb.persist import files: the module persist.files
                out += [(f"{src}.{n}".lstrip("."), []) for n in names]
            else:
                out.append((src, names))
        elif isinstance(node, ast.Import):
            out += [(a.name.removeprefix("cipher_nb."), []) for a in node.names if a.name.startswith("cipher_nb.")]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            arg = node.args[0] if node.args else None  # importlib.import_module("cipher_nb.x")
            if isinstance(arg, ast.Constant) and str(arg.value).startswith("cipher_nb."):
                out.append((arg.value.removeprefix("cipher_nb."), []))
    return out


def test_every_module_comes_from_a_notebook_in_a_band():
    assert {"core", "config.load", "train.trainer", "train.builder", "train.cli"} <= set(MODULES)
    assert len(set(MODULES.values())) == len(MODULES), "two modules from one notebook"
    assert all(band(m) >= 0 for m in MODULES)
    assert PACKAGES == set(BANDS[1:]) - TOP_BANDS, PACKAGES


def test_each_notebook_is_named_after_its_module():
    "nbs/05_model_moe.ipynb exports model.moe: the number orders the notebooks, the rest names the module."
    named = {m: nb.removesuffix(".ipynb").split("_", 1)[1] for m, nb in MODULES.items()}
    assert {m: n for m, n in named.items() if n != m.replace(".", "_")} == {}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down_and_to_public_names(name):
    tree = ast.parse((PKG / f"{name.replace('.', '/')}.py").read_text())
    for mod, names in cipher_imports(tree, name):
        if mod.split(".")[-1].startswith("_"):  # _modidx is nbdev's
            continue
        assert mod in MODULES, f"{name} imports cipher_nb.{mod}, which does not exist"
        assert MODULES[mod] < MODULES[name], f"{name} ({MODULES[name]}) imports the later {mod} ({MODULES[mod]})"
        assert band(mod) <= band(name), f"{name} imports {mod}, from the higher band {BANDS[band(mod)]}/"
        private = [n for n in names if n.startswith("_")]
        assert not private, f"{name} imports private names of {mod}: {private}"


# one interpreter with the heavy libraries loaded, then a fork per module: a fresh cipher_nb in each child
FORKS = """
import importlib, os, sys, traceback
import torch, torch._dynamo, torch.distributed.fsdp, numpy, fastcore.all, matplotlib.pyplot, yaml, datasets, tokenizers
failed = []
for m in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module("cipher_nb." + m)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    if os.waitpid(pid, 0)[1]:
        failed.append(m)
print(" ".join(failed))
"""


def test_each_module_imports_on_its_own():
    "No module needs another to have been imported first: each is imported into a cipher_nb-free process."
    r = subprocess.run([sys.executable, "-c", FORKS, *MODULES], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and not r.stdout.strip(), (r.stdout, r.stderr[-3000:])


def test_the_checker_sees_a_backward_import():
    "The graph test can fail: a later import, a private name, a higher band and a string import are all found."
    src = "from ..train.builder import x\nfrom .sources import _hidden\nimportlib.import_module('cipher_nb.train.sft')"
    found = cipher_imports(ast.parse(src), "data.loader")
    assert found == [("train.builder", ["x"]), ("data.sources", ["_hidden"]), ("train.sft", [])], found
    assert band("train.builder") > band("data.loader")
    assert band("all") > band("viz.plots") > band("core") == band("moved") == 0
    src = "from cipher_nb.persist import files as ck\nfrom .. import core"
    found = cipher_imports(ast.parse(src), "eval.harness")
    assert found == [("persist.files", []), ("core", [])], found


def test_the_module_table_lists_every_module_in_order():
    "MODULES.md's module map (the README links it) is the dependency order: every module, with its notebook, in order."
    section = (ROOT / "MODULES.md").read_text().split("## Modules", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\w+) \| ([\w.]+) \|", section, re.M)
    listed = [(nb, mod) for nb, mod in rows if nb != "notebook"]
    assert listed == sorted((nb.removesuffix(".ipynb"), m) for m, nb in MODULES.items()), listed
