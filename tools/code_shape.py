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
