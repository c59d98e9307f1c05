"""Give every notebook the `language_info` the kernel reports, so JupyterLab has less to rewrite when it opens one.

JupyterLab adds `language_info` from the kernel when it starts it; `pyproject.toml` lets `nbdev-clean` keep the key,
and this script writes it where it is missing (the version is this interpreter's, kept once written). JupyterLab
also replaces `kernelspec.display_name` with the kernel's own ("Python 3 (ipykernel)"), which still marks a notebook
modified on opening: `nbdev-clean` always sets the display name to the kernel's name (`python3`), and the notebooks
must stay as `nbdev-clean` leaves them, so that change is left to JupyterLab.

    python tools/nb_metadata.py            # nbs/ and examples/; run after nbdev-clean (tools/sync.sh does)
"""

import json
import platform
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
    "Add the notebook's `language_info` if it has none; whether the file changed."
    text = path.read_text(encoding="utf-8")
    nb = json.loads(text)
    md = nb.setdefault("metadata", {})
    if md.get("language_info", {}).get("version"):
        return False
    md["language_info"] = language_info()
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return True


def main(dirs=("nbs", "examples")):
    for d in dirs:
        for p in sorted((ROOT / d).glob("*.ipynb")):
            fix(p)


if __name__ == "__main__":
    main()
