"""The `Trainer` (`trainer`), the run builder (`builder`), the command line (`cli`), SFT, LoRA and experiment tracking.

Written by hand (nbdev writes the modules, not a package's `__init__`)."""

from ..moved import old_getattr
from .builder import build_trainer
from .cli import cipher_train

__all__ = ["build_trainer", "cipher_train"]
__getattr__ = old_getattr(__name__)  # the names of the module cipher_nb.train of before the subpackages, for one release
