"""The model: a forward's `context`, attention, MoE, the byte hourglass (`boundary`), the recurrent core, Engram memory, `CipherModel` (`lm`) and parameter `roles`.

Written by hand (nbdev writes the modules, not a package's `__init__`)."""

from ..moved import old_getattr

__getattr__ = old_getattr(__name__)  # the names of the module cipher_nb.model of before the subpackages, for one release
