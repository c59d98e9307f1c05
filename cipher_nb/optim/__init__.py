"""Precision (`precision`), optimizers and the learning-rate schedule (`optimizers`), parallelism and compilation (`parallel`).

Written by hand (nbdev writes the modules, not a package's `__init__`)."""
