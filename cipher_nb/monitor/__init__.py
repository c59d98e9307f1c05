"""What a run measures (`metrics`), the health checks it warns with (`health`) and the gate over a finished run (`gate`).

Written by hand (nbdev writes the modules, not a package's `__init__`)."""
