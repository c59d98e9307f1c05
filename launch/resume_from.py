#!/usr/bin/env python
"""Print what `cipher-train --resume` should get: the newest complete checkpoint among the given run directories
(the local run and its mirror on the persistent volume), or `auto` when the first directory (the local run) holds
the newest or none has one (then the run starts at step 0). `auto` matters under `torchrun --max-restarts`: the
restarted group gets the same command line, and `auto` makes it resume from the newest checkpoint at that time.

    python launch/resume_from.py runs/h100-a /mnt/persist/h100-a

A machine that replaced a preempted one has an empty local disk: the mirror is where its checkpoints survived."""

import sys
import warnings

from cipher_nb.persist.files import checkpoint_step, latest_checkpoint


def newest(dirs) -> str:
    found = [p for d in dirs if (p := latest_checkpoint(d)) is not None]
    if not found:
        return "auto"
    best = max(found, key=checkpoint_step)
    local = latest_checkpoint(dirs[0]) if dirs else None
    return "auto" if local is not None and checkpoint_step(local) >= checkpoint_step(best) else str(best)


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        print(newest(sys.argv[1:]))
