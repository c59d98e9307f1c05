"The module graph: every module imports on its own, imports point only to earlier notebooks, no private names cross."

import ast
import re
import subprocess
import sys

import pytest
from conftest import ROOT

PKG = ROOT / "cipher_nb"


def notebook_of(path) -> str:
    "The notebook a generated module comes from (nbdev writes it in the module's header)."
    m = re.search(r"File to edit: \.\./nbs/(\S+\.ipynb)", path.read_text())
    assert m, f"{path.name} has no nbdev header: is it generated?"
    return m.group(1)


MODULES = {p.stem: notebook_of(p) for p in sorted(PKG.glob("*.py")) if not p.name.startswith("_")}


def cipher_imports(tree) -> list:
    "(module, [names]) for each import of a cipher_nb module, by any spelling."
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            names = [a.name for a in node.names]
            if node.level == 1 or mod == "cipher_nb":  # from . import x / from cipher_nb import x
                out += [(mod, names)] if mod and mod != "cipher_nb" else [(n, []) for n in names]
            elif mod.startswith("cipher_nb."):
                out.append((mod.split(".")[1], names))
        elif isinstance(node, ast.Import):
            out += [(a.name.split(".")[1], []) for a in node.names if a.name.startswith("cipher_nb.")]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            arg = node.args[0] if node.args else None  # importlib.import_module("cipher_nb.x")
            if isinstance(arg, ast.Constant) and str(arg.value).startswith("cipher_nb."):
                out.append((arg.value.split(".")[1], []))
    return out


def test_every_module_comes_from_a_notebook_in_order():
    assert {"core", "config", "callbacks", "trainer", "train"} <= set(MODULES)
    assert len(set(MODULES.values())) == len(MODULES), "two modules from one notebook"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_to_earlier_notebooks_and_public_names(name):
    tree = ast.parse((PKG / f"{name}.py").read_text())
    for mod, names in cipher_imports(tree):
        if mod.startswith("_"):  # _modidx is nbdev's
            continue
        assert mod in MODULES, f"{name} imports cipher_nb.{mod}, which does not exist"
        assert MODULES[mod] < MODULES[name], f"{name} ({MODULES[name]}) imports the later {mod} ({MODULES[mod]})"
        private = [n for n in names if n.startswith("_")]
        assert not private, f"{name} imports private names of {mod}: {private}"


def test_each_module_imports_on_its_own():
    "A fresh interpreter per module: an import that only works after another module was loaded fails here."
    procs = {
        m: subprocess.Popen([sys.executable, "-c", f"import cipher_nb.{m}"], stderr=subprocess.PIPE, text=True)
        for m in MODULES
    }
    failed = {m: p.communicate()[1][-500:] for m, p in procs.items() if p.wait() != 0}
    assert not failed, failed


def test_the_checker_sees_a_backward_import():
    "The graph test can fail: a later import, a private name and a string import are all found."
    src = "from cipher_nb.train import x\nfrom .data import _hidden\nimportlib.import_module('cipher_nb.sft')\n"
    found = cipher_imports(ast.parse(src))
    assert found == [("train", ["x"]), ("data", ["_hidden"]), ("sft", [])], found


def test_the_readme_module_table_lists_every_module_in_order():
    "The README's module map is the dependency order: every module, each with its notebook, top to bottom."
    section = (ROOT / "README.md").read_text().split("## Modules", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\w+) \| (\w+) \|", section, re.M)
    listed = [(nb, mod) for nb, mod in rows if nb != "notebook"]
    assert listed == sorted((nb.removesuffix(".ipynb"), m) for m, nb in MODULES.items()), listed
