"""A notebook-first toolkit for training Mixture-of-Experts language models: explore in Jupyter, launch the same config on H100s."""

__version__ = "0.0.1"
