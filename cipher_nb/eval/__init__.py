"""Evaluation and sampling (`harness`), runs reused and ablation grids (`experiments`), lm-evaluation-harness's adapter
(`lm_harness`).

Written by hand (nbdev writes the modules, not a package's `__init__`)."""

from importlib.util import find_spec

if find_spec("lm_eval") is not None:
    # lm-evaluation-harness finds models by name: register the adapter's, loaded (with torch) only when first asked for
    from lm_eval.api.registry import model_registry

    for _name in ("cipher_nb", "cipher"):
        model_registry.register(_name, target="cipher_nb.eval.lm_harness:CipherLM")
