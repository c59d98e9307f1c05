"""A notebook-first toolkit for training Mixture-of-Experts language models: explore in Jupyter, launch the same config on H100s.

Modules:

- `cipher_nb.callbacks`: The hooks a trainer offers to what is optional in a run: the live dashboard, the loggers, a stage's extras, user code and the test-only faults."""

__version__ = "0.0.1"
