"""The shape of the code, measured the way the architecture issue measured it: export-cell sizes, the share of export
cells with a test right below, functions that take the whole `Config`, the largest functions.

    python tools/code_shape.py            # one table
"""

import ast
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cells(nb: Path) -> list:
    return [(c["cell_type"], "".join(c["source"])) for c in json.loads(nb.read_text())["cells"]]


def is_export(kind: str, text: str) -> bool:
    return kind == "code" and text.lstrip().startswith(("#| export", "#|export"))


def export_cells() -> list:
    "(notebook, lines, tested right below) for every export cell of nbs/."
    out = []
    for nb in sorted((ROOT / "nbs").glob("*.ipynb")):
        cs = cells(nb)
        for i, (kind, text) in enumerate(cs):
            if is_export(kind, text):
                nxt = cs[i + 1] if i + 1 < len(cs) else ("markdown", "")
                tested = nxt[0] == "code" and not is_export(*nxt) and not nxt[1].lstrip().startswith("#| hide")
                out.append((nb.stem, len(text.splitlines()) - 1, tested))
    return out


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


if __name__ == "__main__":
    ex, fn = export_cells(), functions()
    whole = [f for f in fn if f[3]]
    largest = sorted(fn, key=lambda f: -f[2])[:5]
    print(
        f"export cells: {len(ex)}, median {statistics.median(e[1] for e in ex):g} lines, over 80 lines: "
        f"{sum(e[1] > 80 for e in ex)}"
    )
    tested = sum(e[2] for e in ex)
    print(f"export cells with a test right below: {tested}/{len(ex)} = {tested / len(ex):.0%}")
    print(f"functions taking the whole Config: {len(whole)} in {len({f[0] for f in whole})} modules")
    print("largest functions: " + ", ".join(f"{m}.{n} ({k} lines)" for m, n, k, _ in largest))
    for nb in ("10_train_trainer",):
        mine = [e for e in ex if e[0] == nb]
        print(f"{nb}: {sum(e[2] for e in mine)}/{len(mine)} export cells tested right below")
    patched = package_patches()
    print(f"methods attached to a class in its own module: {len(patched)} in {len({p[0] for p in patched})} modules")
