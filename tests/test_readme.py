"README.md is generated from nbs/index.ipynb and must agree with it; it must carry the two commands."

import importlib.util

from conftest import ROOT


def test_readme_matches_index():
    spec = importlib.util.spec_from_file_location("readme", ROOT / "tools/readme.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert (ROOT / "README.md").read_text() == mod.render(), "run python tools/readme.py"


def test_readme_has_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0 -e . && cipher-train" in text
    assert 'pip install torch==2.13.0 -e ".[dev]" && bash tools/check.sh' in text
