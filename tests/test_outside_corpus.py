"""benchmarks/outside_corpus.py: a fortunes folder becomes text files the `files` source reads, index files skipped."""

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("oc", Path(__file__).parents[1] / "benchmarks/outside_corpus.py")
oc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(oc)


def test_text_files_copied_index_and_binary_skipped(tmp_path):
    src = tmp_path / "fortunes"
    src.mkdir()
    (src / "wisdom").write_text("Know thyself.\n%\nNothing in excess.\n")
    (src / "wisdom.dat").write_bytes(b"\x00\x01index")  # strfile's index
    (src / "wisdom.u8").write_text("a copy")
    (src / "latin1").write_bytes("caf\xe9\n".encode("latin-1"))  # not UTF-8
    rows = oc.write_corpus(src, tmp_path / "out")
    assert [r[0] for r in rows] == ["wisdom"] and rows[0][1] == len((src / "wisdom").read_bytes())
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["wisdom.txt"]
    assert (tmp_path / "out" / "wisdom.txt").read_text() == (src / "wisdom").read_text()


def test_an_empty_folder_says_what_to_install(tmp_path):
    with pytest.raises(SystemExit, match="install Debian's fortunes"):
        oc.write_corpus(tmp_path, tmp_path / "out")
