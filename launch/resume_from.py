#!/usr/bin/env python
"""Print what `cipher-train --resume` should get: the newest complete checkpoint among the given run directories
(the local run and its mirror on the persistent volume), or `auto` when none has one (then the run starts at step 0).

    python launch/resume_from.py runs/h100-a /mnt/persist/h100-a

A machine that replaced a preempted one has an empty local disk: the mirror is where its checkpoints survived."""

import sys
import warnings

from cipher_nb.checkpoint import checkpoint_step, latest_checkpoint


def newest(dirs) -> str:
    found = [p for d in dirs if (p := latest_checkpoint(d)) is not None]
    return str(max(found, key=checkpoint_step)) if found else "auto"


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        print(newest(sys.argv[1:]))
