"""Evaluation and sampling (`harness`), runs reused and ablation grids (`experiments`).

Written by hand (nbdev writes the modules, not a package's `__init__`)."""
