"Every class is defined in one body: no module attaches a method to a class it defines (`@patch` is for later modules)."

import importlib.util

import pytest
from conftest import ROOT

spec = importlib.util.spec_from_file_location("code_shape", ROOT / "tools/code_shape.py")
code_shape = importlib.util.module_from_spec(spec)
spec.loader.exec_module(code_shape)
same_module_patches = code_shape.same_module_patches

DEFINED = """
from fastcore.basics import patch, patch_to
from other import Imported

class A:
    def f(self): ...

class B: ...
"""


@pytest.mark.parametrize(
    "tail, hit",
    [
        ("@patch\ndef g(self: A): ...", ("m", "A", "g")),
        ("@patch(as_prop=True)\ndef g(self: A): ...", ("m", "A", "g")),
        ("@patch\ndef g(self: B | Imported): ...", ("m", "B", "g")),
        ("@patch\ndef g(self: (A, Imported)): ...", ("m", "A", "g")),
        ("@patch\ndef g(self: 'A'): ...", ("m", "A", "g")),
        ("@patch_to(A)\ndef g(self): ...", ("m", "A", "g")),
        ("@patch_to(A, as_prop=True)\ndef g(self): ...", ("m", "A", "g")),
        ("A.g = A.f", ("m", "A", "g")),
        ("def g(self): ...\nB.g = g", ("m", "B", "g")),
        ("setattr(A, 'g', len)", ("m", "A", "g")),
        ("if True:\n    @patch\n    def g(self: A): ...", ("m", "A", "g")),
    ],
)
def test_a_same_module_patch_is_caught(tail, hit):
    assert same_module_patches(DEFINED + tail, "m") == [hit]


@pytest.mark.parametrize(
    "tail",
    [
        "@patch\ndef g(self: Imported): ...",  # a later module adding to a class defined elsewhere
        "@patch_to(Imported)\ndef g(self): ...",
        "Imported.g = len",
        "def g(self: A): ...",  # annotated, not patched
        "def h():\n    A.x = 1",  # not at module level
        "a = A()\na.x = 1",  # an instance, not the class
    ],
)
def test_other_code_is_not_caught(tail):
    assert same_module_patches(DEFINED + tail, "m") == []


def test_a_patch_before_the_class_is_not_same_body():
    "Only what comes after the definition counts (before it the name is some other, imported class)."
    assert same_module_patches("@patch\ndef g(self: A): ...\nclass A: ...", "m") == []


def test_the_package_defines_every_class_in_one_body():
    hits = code_shape.package_patches()
    assert not hits, "methods attached to a class in its own module (move them into the class body): " + ", ".join(
        f"{m}: {c}.{f}" for m, c, f in hits
    )
