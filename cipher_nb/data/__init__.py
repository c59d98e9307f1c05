"""Documents in (`corpora`, `sources`, `conversations`), ids out (`codecs`), packed and resumable (`loader`), mixed by phase (`curriculum`).

Written by hand (nbdev writes the modules, not a package's `__init__`)."""
