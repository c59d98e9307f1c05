"README.md is generated from nbs/index.ipynb and must agree with it; it must carry the two commands."

import importlib.util

from conftest import ROOT


def tool(name: str):
    "A script of tools/ as a module."
    spec = importlib.util.spec_from_file_location(name, ROOT / f"tools/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_matches_index():
    assert (ROOT / "README.md").read_text() == tool("readme").render(), "run python tools/readme.py"


def test_readme_has_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0 -e . && cipher-train" in text
    assert 'pip install torch==2.13.0 -e ".[dev]" && bash tools/check.sh' in text


def test_readme_links_the_pages_it_sends_readers_to():
    text = (ROOT / "README.md").read_text()
    for page in ("MODULES.md", "launch/README.md"):
        assert f"]({page})" in text and (ROOT / page).is_file(), page


def test_the_shape_guard_names_what_is_over_a_limit(monkeypatch):
    "`code_shape.py --check` holds the README to its limit here, and fails, naming the file, when it is over."
    shape = tool("code_shape")
    assert shape.over_readme([]) == []
    monkeypatch.setattr(shape, "README_WORDS", 100)
    assert shape.over_readme([]) == [f"README.md: {shape.readme_words()} words, over 100"]
    assert shape.check(["readme"], []) == 1 and shape.check(["no-such-check"], []) == 2
