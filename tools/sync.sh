#!/usr/bin/env bash
# After editing notebooks: export, clean, add the language_info JupyterLab expects, format, export the formatted code.
set -euo pipefail
cd "$(dirname "$0")/.."
nbdev-export
nbdev-clean
python tools/nb_metadata.py
ruff format -q .
nbdev-export
ruff check .
