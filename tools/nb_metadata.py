"""Give every notebook the metadata JupyterLab would write on opening it, so a notebook opens unmodified.

JupyterLab marks a notebook modified on opening when either of two things differs from what the kernel reports:
- `language_info`, which it adds from the kernel when it starts it. `pyproject.toml` lets `nbdev-clean` keep the
  key; this script writes it where it is missing (the version is this interpreter's, kept once written).
- `kernelspec.display_name`, which it replaces with the kernel's own ("Python 3 (ipykernel)"). This script writes
  that name into the notebooks of examples/, which `nbdev-clean` does not touch. In nbs/ it is left as `nbdev-clean`
  sets it, the kernel's name (`python3`): nbdev has no setting to keep a display name, and the project's sync check
  is plain `nbdev-clean`, so a notebook in nbs/ still opens marked modified.

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


# What ipykernel's `python3` kernelspec calls itself, and so what JupyterLab writes into a notebook it opens.
DISPLAY_NAMES = {"python3": "Python 3 (ipykernel)"}


def fix(path: Path, display_name: bool = True) -> bool:
    "Add the notebook's `language_info` if it has none (and set the kernel's display name); whether the file changed."
    text = path.read_text(encoding="utf-8")
    nb = json.loads(text)
    md = nb.setdefault("metadata", {})
    if not md.get("language_info", {}).get("version"):
        md["language_info"] = language_info()
    md.pop("widgets", None)  # widget state a browser saved: JupyterLab rewrites it on opening, and it goes stale
    spec = md.get("kernelspec", {})
    if display_name and spec.get("name") in DISPLAY_NAMES:
        spec["display_name"] = DISPLAY_NAMES[spec["name"]]
    if json.dumps(nb, indent=1, ensure_ascii=False) + "\n" == text:
        return False
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return True


def main(dirs=("nbs", "examples")):
    for d in dirs:
        for p in sorted((ROOT / d).glob("*.ipynb")):
            fix(p, display_name=d != "nbs")  # nbs/ stays as nbdev-clean leaves it


if __name__ == "__main__":
    main()
