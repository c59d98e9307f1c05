"""Give every notebook the kernel metadata JupyterLab writes when it starts the kernel, so that opening a notebook does
not mark it modified.

`nbdev-clean` sets `kernelspec.display_name` to the kernel's name (`python3`); JupyterLab replaces it with the kernel's
own display name and adds `language_info` from the kernel, and either change marks the notebook modified. This
script writes both the way JupyterLab would (`pyproject.toml` lets `nbdev-clean` keep `language_info`). JupyterLab
compares the Python version too, so a notebook opened under another Python version is still marked modified: the
version written is the one this interpreter runs, kept once written.

    python tools/nb_metadata.py            # nbs/ and examples/; run after nbdev-clean (tools/sync.sh does)
"""

import json
import platform
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def language_info() -> dict:
    "What ipykernel reports for this interpreter."
    return {
        "codemirror_mode": {"name": "ipython", "version": 3},
        "file_extension": ".py",
        "mimetype": "text/x-python",
        "name": "python",
        "nbconvert_exporter": "python",
        "pygments_lexer": "ipython3",
        "version": platform.python_version(),
    }


def fix(path: Path) -> bool:
    "Set the notebook's kernel metadata; whether the file changed."
    text = path.read_text(encoding="utf-8")
    nb = json.loads(text)
    md = nb.setdefault("metadata", {})
    md["kernelspec"] = dict(KERNELSPEC)
    md["language_info"] = {
        **language_info(),
        "version": md.get("language_info", {}).get("version") or platform.python_version(),
    }
    new = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def main(dirs=("nbs", "examples")):
    for d in dirs:
        for p in sorted((ROOT / d).glob("*.ipynb")):
            fix(p)


if __name__ == "__main__":
    main()
