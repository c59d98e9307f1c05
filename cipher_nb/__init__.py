"""A notebook-first toolkit for training Mixture-of-Experts language models: explore in Jupyter, launch the same config on H100s."""

__version__ = "0.0.1"

from .moved import install_old_paths

install_old_paths()  # the module paths of before the subpackages (cipher_nb.checkpoint, ...), for one release
