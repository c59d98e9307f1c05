"""The config tree (`schema`), loading presets and overrides with validation (`load`), model sizing (`sizing`).

Written by hand (nbdev writes the modules, not a package's `__init__`)."""

from ..moved import old_getattr

__getattr__ = old_getattr(__name__)  # the names of the module cipher_nb.config of before the subpackages, for one release
