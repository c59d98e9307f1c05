"""Plots of a run (`plots`) and the live dashboard (`dashboard`).

Written by hand (nbdev writes the modules, not a package's `__init__`)."""

from ..moved import old_getattr

__getattr__ = old_getattr(__name__)  # the names of the module cipher_nb.viz of before the subpackages, for one release
