"""A notebook-first toolkit for training Mixture-of-Experts language models: explore in Jupyter, launch the same config on H100s.

Modules:

- `cipher_nb.callbacks`: The hooks a trainer offers to what is optional in a run: the live dashboard, the loggers, a stage's extras, user code and the test-only faults.
- `cipher_nb.train`: From a config to a run: data, model, precision, optimizer, checkpoints, run record, monitor and evaluation wired into a `Trainer`, DDP / FSDP2 under `torchrun`, and `cipher-train`, which runs it all from a preset.
- `cipher_nb.trainer`: `Trainer`: one optimizer step at a time (gradient accumulation counted in optimizer steps, the loss averaged over real tokens), bf16 autocast without a scaler, global and per-group clipping, non-finite steps skipped, a clean stop on SIGTERM; `fit` calls the run's components in the order it reads."""

__version__ = "0.0.1"
