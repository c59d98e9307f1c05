"""Write README.md from nbs/index.ipynb (Quarto, which nbdev-readme needs, is not installable offline).
`python tools/readme.py` writes it; `python tools/readme.py --check` exits 1 when README.md is out of date."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def render(nb_path=ROOT / "nbs" / "index.ipynb") -> str:
    "Markdown cells as they are; code cells (unless hidden) as python blocks."
    parts = []
    for c in json.loads(Path(nb_path).read_text())["cells"]:
        src = "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        if c["cell_type"] == "markdown":
            parts.append(src.strip())
        elif c["cell_type"] == "code" and not src.lstrip().startswith("#| hide"):
            parts.append(f"```python\n{src.strip()}\n```")
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    readme = ROOT / "README.md"
    if "--check" in sys.argv:
        if not readme.exists() or readme.read_text() != render():
            sys.exit("README.md is out of date with nbs/index.ipynb: run `python tools/readme.py` and commit both")
    else:
        readme.write_text(render())
