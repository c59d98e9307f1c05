#!/usr/bin/env python
"""Whether a run stopped cleanly during this launch: its newest complete checkpoint is a stop's (cipher-train saves
one tagged `emergency` when a SIGTERM or SIGINT ends the run) and is not the checkpoint the launch found before it
started. torchrun exits 1 with a traceback once it has passed a stop signal on, however its workers ended; the launch
scripts map that exit to 0 only when this says the run saved its stop checkpoint.

    python launch/stopped_cleanly.py RUN_DIR            # the newest complete checkpoint before the launch ('' if none)
    python launch/stopped_cleanly.py RUN_DIR BEFORE     # exit 0 with the stop checkpoint's path, or exit 1"""

import json
import sys
import warnings

from cipher_nb.persist.files import META, latest_checkpoint


def stop_checkpoint(run: str, before: str) -> str:
    "The newest complete checkpoint of `run` if a stop saved it and it is not `before`; else ''."
    ckpt = latest_checkpoint(run)
    if ckpt is None or str(ckpt) == before:
        return ""
    return str(ckpt) if json.loads((ckpt / META).read_text()).get("tag") == "emergency" else ""


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a damaged checkpoint is the run's to report, not this check's
        if len(sys.argv) == 2:
            print(latest_checkpoint(sys.argv[1]) or "")
            sys.exit(0)
        found = stop_checkpoint(sys.argv[1], sys.argv[2])
        print(found)
        sys.exit(0 if found else 1)
