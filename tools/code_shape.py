"""The shape of the code, measured the way the architecture issues measure it, and the guards that keep it there:
README length, module sizes, export-cell sizes, export cells with one top-level definition and with a test right
below, library imports used only by notebook tests, notebook numbers, functions that take the whole `Config`.

    python tools/code_shape.py                        # every figure
    python tools/code_shape.py --check                # exit 1 naming each offender of every limit below
    python tools/code_shape.py --check readme,modules # only those limits (tools/check.sh enforces a subset)
"""

import ast
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

README_WORDS = 2000  # `wc -w README.md`
MODULE_LINES = 700  # lines of a generated module
CELL_LINES = 80  # lines of an export cell, unless it is one class body
MEDIAN_CELL_LINES = 12  # the median export cell
ONE_DEF_SHARE = 0.75  # export cells holding exactly one top-level definition
TESTED_SHARE = 0.78  # export cells with a test cell right below


def cells(nb: Path) -> list:
    return [(c["cell_type"], "".join(c["source"])) for c in json.loads(nb.read_text())["cells"]]


def is_export(kind: str, text: str) -> bool:
    return kind == "code" and text.lstrip().startswith(("#| export", "#|export"))


def definitions(text: str) -> list:
    "The top-level definitions of a cell: `def`, `class` and assignments to public names, as (kind, name)."
    out = []
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.append(("class" if isinstance(node, ast.ClassDef) else "def", node.name))
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            out += [("name", n) for n in names if not n.startswith("_")]
    return out


def export_cells() -> list:
    "A dict per export cell of nbs/: notebook, lines, tested right below, its top-level definitions."
    out = []
    for nb in sorted((ROOT / "nbs").glob("*.ipynb")):
        cs = cells(nb)
        for i, (kind, text) in enumerate(cs):
            if is_export(kind, text):
                nxt = cs[i + 1] if i + 1 < len(cs) else ("markdown", "")
                tested = nxt[0] == "code" and not is_export(*nxt) and not nxt[1].lstrip().startswith("#| hide")
                defs = definitions(text)
                out.append(dict(nb=nb.stem, lines=len(text.splitlines()) - 1, tested=tested, defs=defs))
    return out


def test_only_imports() -> list:
    "(notebook, name) for each name an export cell imports that no exported code of its notebook uses."
    out = []
    for nb in sorted((ROOT / "nbs").glob("*.ipynb")):
        trees = [ast.parse(text) for kind, text in cells(nb) if is_export(kind, text)]
        used = {n.id for t in trees for n in ast.walk(t) if isinstance(n, ast.Name)}
        for t in trees:
            for node in t.body:
                if isinstance(node, ast.Import | ast.ImportFrom):
                    for a in node.names:  # `import a.b` binds a; `from m import x as x` is a deliberate re-export
                        name = (a.asname or a.name).split(".")[0]
                        if name != "*" and a.asname != a.name and name not in used:
                            out.append((nb.stem, name))
    # a module that only gathers names for others (cipher_nb.all) lists them in `_all_`
    return [(nb, n) for nb, n in out if nb != "14_all"]


def shared_numbers() -> dict:
    "Notebook number -> the notebooks that share it (`02_data_corpora` and `02_data_sources` share 02)."
    by = {}
    for nb in sorted((ROOT / "nbs").glob("[0-9]*.ipynb")):
        by.setdefault(nb.stem.split("_")[0], []).append(nb.stem)
    return {k: v for k, v in by.items() if len(v) > 1}


def module_lines() -> dict:
    "Lines of each generated module of the package (nbdev's index `_modidx` aside)."
    pkg = ROOT / "cipher_nb"
    return {
        p.relative_to(pkg).with_suffix("").as_posix().replace("/", "."): len(p.read_text().splitlines())
        for p in sorted(pkg.rglob("*.py"))
        if not p.name.startswith("_")
    }


def functions() -> list:
    "(module, name, lines, takes the whole Config) for every function of the package."
    out = []
    for py in sorted((ROOT / "cipher_nb").rglob("*.py")):
        if py.name.startswith("_"):
            continue
        for node in ast.walk(ast.parse(py.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                whole = any(isinstance(a.annotation, ast.Name) and a.annotation.id == "Config" for a in args)
                mod = py.relative_to(ROOT / "cipher_nb").with_suffix("").as_posix().replace("/", ".")
                out.append((mod, node.name, node.end_lineno - node.lineno + 1, whole))
    return out


def readme_words() -> int:
    "Words of README.md as `wc -w` counts them (runs of non-space)."
    return len(re.findall(r"\S+", (ROOT / "README.md").read_text()))


def is_class_body(cell: dict) -> bool:
    return [k for k, _ in cell["defs"]] == ["class"]


def long_cells(ex: list) -> list:
    return [c for c in ex if c["lines"] > CELL_LINES and not is_class_body(c)]


def share(ex: list, key) -> float:
    return sum(map(key, ex)) / len(ex)


def over_readme(ex: list) -> list:
    w = readme_words()
    return [f"README.md: {w} words, over {README_WORDS}"] if w > README_WORDS else []


def over_modules(ex: list) -> list:
    big = {m: n for m, n in module_lines().items() if n > MODULE_LINES}
    return [f"cipher_nb/{m.replace('.', '/')}.py: {n} lines, over {MODULE_LINES}" for m, n in big.items()]


def over_cells(ex: list) -> list:
    return [
        f"nbs/{c['nb']}.ipynb: an export cell of {c['lines']} lines ({', '.join(n for _, n in c['defs'][:3])}), "
        f"over {CELL_LINES} and not one class body"
        for c in long_cells(ex)
    ]


def over_median(ex: list) -> list:
    m = statistics.median(c["lines"] for c in ex)
    return [f"export cells: median {m:g} lines, over {MEDIAN_CELL_LINES}"] if m > MEDIAN_CELL_LINES else []


def under_defs(ex: list) -> list:
    s = share(ex, lambda c: len(c["defs"]) == 1)
    return (
        [f"export cells with one top-level definition: {s:.0%}, under {ONE_DEF_SHARE:.0%}"] if s < ONE_DEF_SHARE else []
    )


def under_tested(ex: list) -> list:
    s = share(ex, lambda c: c["tested"])
    return [f"export cells with a test right below: {s:.0%}, under {TESTED_SHARE:.0%}"] if s < TESTED_SHARE else []


def only_test_imports(ex: list) -> list:
    return [
        f"nbs/{nb}.ipynb: `{n}` is imported in an export cell but used only by tests" for nb, n in test_only_imports()
    ]


def shared(ex: list) -> list:
    return [f"nbs/: {', '.join(v)} share the number {k}" for k, v in shared_numbers().items()]


# name -> the offenders of one limit, as lines that name them (none: it holds). A new check is one more entry.
def _class_names(node) -> set:
    "The class names an annotation or a `patch_to` argument names: `Cls`, `A | B`, `Union[A, B]`, `(A, B)`, 'Cls'."
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            return _class_names(ast.parse(node.value, mode="eval").body)
        except SyntaxError:
            return set()
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _class_names(node.left) | _class_names(node.right)
    if isinstance(node, ast.Tuple | ast.List):
        return set().union(*map(_class_names, node.elts))
    if isinstance(node, ast.Subscript):  # Union[A, B], Optional[A]
        return _class_names(node.slice)
    return set()


def _patched_classes(fn) -> set:
    "The classes a `@patch` / `@patch(as_prop=True)` / `@patch_to(Cls)` function is attached to (empty: not a patch)."
    out = set()
    for dec in fn.decorator_list:
        call = dec if isinstance(dec, ast.Call) else None
        target = call.func if call else dec
        name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", None)
        if name == "patch":
            args = [*fn.args.posonlyargs, *fn.args.args]
            out |= _class_names(args[0].annotation) if args and args[0].annotation else set()
        elif name == "patch_to" and call and call.args:
            out |= _class_names(call.args[0])
    return out


def _module_statements(body: list):
    "The statements run at module level: the body, and inside top-level `if` / `try` / `with` blocks."
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(node, ast.If | ast.Try | ast.With) and isinstance(inner, list):
                yield from _module_statements(inner)


def same_module_patches(src: str, module: str = "<string>") -> list:
    "(module, class, method) for each method attached in `src` to a class `src` itself defines, after its definition."
    defined, out = set(), []
    for node in _module_statements(ast.parse(src).body):
        if isinstance(node, ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            out += [(module, cls, node.name) for cls in sorted(_patched_classes(node) & defined)]
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in defined:
                    out.append((module, t.value.id, t.attr))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):  # setattr(Cls, "name", fn)
            c = node.value
            if getattr(c.func, "id", None) == "setattr" and len(c.args) == 3 and isinstance(c.args[0], ast.Name):
                if c.args[0].id in defined and isinstance(c.args[1], ast.Constant):
                    out.append((module, c.args[0].id, c.args[1].value))
    return out


def package_patches() -> list:
    "`same_module_patches` over every module of the package: empty when every class is defined in one body."
    return [
        hit
        for py in sorted((ROOT / "cipher_nb").rglob("*.py"))
        for hit in same_module_patches(py.read_text(), py.relative_to(ROOT).as_posix())
    ]


CHECKS = {
    "readme": over_readme,
    "modules": over_modules,
    "cells": over_cells,
    "median": over_median,
    "defs": under_defs,
    "tested": under_tested,
    "imports": only_test_imports,
    "numbers": shared,
    "onebody": lambda ex: [
        f"{m}: {c}.{f} is attached after its class, in its own module" for m, c, f in package_patches()
    ],
}


def report(ex: list):
    "Print every figure the issue names."
    fn, mods = functions(), module_lines()
    whole = [f for f in fn if f[3]]
    big = sorted(mods.items(), key=lambda kv: -kv[1])[:3]
    print(f"README.md: {readme_words()} words (limit {README_WORDS})")
    print(f"modules: {len(mods)}, largest " + ", ".join(f"{m} ({n})" for m, n in big) + f" (limit {MODULE_LINES})")
    print(
        f"export cells: {len(ex)}, median {statistics.median(c['lines'] for c in ex):g} lines (limit "
        f"{MEDIAN_CELL_LINES}), over {CELL_LINES} lines: {sum(c['lines'] > CELL_LINES for c in ex)}, of which "
        f"not one class body: {len(long_cells(ex))}"
    )
    one = sum(len(c["defs"]) == 1 for c in ex)
    print(
        f"export cells with one top-level definition: {one}/{len(ex)} = {one / len(ex):.0%} (limit {ONE_DEF_SHARE:.0%})"
    )
    tested = sum(c["tested"] for c in ex)
    print(
        f"export cells with a test right below: {tested}/{len(ex)} = {tested / len(ex):.0%} (limit {TESTED_SHARE:.0%})"
    )
    print(f"library imports used only by notebook tests: {len(test_only_imports())}")
    print(f"notebook numbers shared: {len(shared_numbers())}")
    print(f"functions taking the whole Config: {len(whole)} in {len({f[0] for f in whole})} modules")
    print(
        "largest functions: " + ", ".join(f"{m}.{n} ({k} lines)" for m, n, k, _ in sorted(fn, key=lambda f: -f[2])[:5])
    )
    patched = package_patches()
    print(f"methods attached to a class in its own module: {len(patched)} in {len({p[0] for p in patched})} modules")


def check(names: list, ex: list) -> int:
    "Print FAIL and each offender of the limits `names`; 1 if any, else 0."
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(
            f"code_shape.py: no check named {', '.join(unknown)}; the checks are {', '.join(CHECKS)}", file=sys.stderr
        )
        return 2
    failed = [(n, line) for n in names for line in CHECKS[n](ex)]
    for n, line in failed:
        print(f"FAIL {n}: {line}", file=sys.stderr)
    print(f"code shape: {', '.join(names)}: " + ("FAIL" if failed else "ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    ex = export_cells()
    if "--check" in sys.argv:
        rest = sys.argv[sys.argv.index("--check") + 1 :]
        sys.exit(check(rest[0].split(",") if rest else list(CHECKS), ex))
    report(ex)
