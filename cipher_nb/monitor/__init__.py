"""What a run measures (`metrics`), the health checks it warns with (`health`) and the gate over a finished run (`gate`).

Written by hand (nbdev writes the modules, not a package's `__init__`)."""

from ..moved import old_getattr

__getattr__ = old_getattr(__name__)  # the names of the module cipher_nb.monitor of before the subpackages, for one release
