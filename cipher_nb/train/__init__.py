"""The `Trainer` (`trainer`), the run builder (`builder`), the command line (`cli`), SFT, LoRA and experiment tracking.

Written by hand (nbdev writes the modules, not a package's `__init__`)."""

from .builder import build_trainer
from .cli import cipher_train

__all__ = ["build_trainer", "cipher_train"]
