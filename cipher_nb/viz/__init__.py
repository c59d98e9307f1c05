"""Plots of a run (`plots`) and the live dashboard (`dashboard`).

Written by hand (nbdev writes the modules, not a package's `__init__`)."""
