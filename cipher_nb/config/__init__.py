"""The config tree (`schema`), loading presets and overrides with validation (`load`), model sizing (`sizing`).

Written by hand (nbdev writes the modules, not a package's `__init__`)."""
