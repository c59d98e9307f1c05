"""Precision (`precision`), optimizers and the learning-rate schedule (`optimizers`), parallelism and compilation (`parallel`).

Written by hand (nbdev writes the modules, not a package's `__init__`)."""

from ..moved import old_getattr

__getattr__ = old_getattr(__name__)  # the names of the module cipher_nb.optim of before the subpackages, for one release
