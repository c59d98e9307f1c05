"""Documents in (`corpora`, `sources`, `conversations`), ids out (`codecs`), packed and resumable (`loader`), mixed by phase (`curriculum`).

Written by hand (nbdev writes the modules, not a package's `__init__`)."""

from ..moved import old_getattr

__getattr__ = old_getattr(__name__)  # the names of the module cipher_nb.data of before the subpackages, for one release
