"""What a run leaves on disk: checksums, the completeness marker (`marker`), checkpoint files (`files`), the save policy (`checkpointer`), stages, exports, the record, the run lock.

Written by hand (nbdev writes the modules, not a package's `__init__`)."""
