"""Evaluation and sampling (`harness`), runs reused and ablation grids (`experiments`), lm-evaluation-harness's adapter
(`lm_harness`).

Written by hand (nbdev writes the modules, not a package's `__init__`)."""
