"""A launched script for ``tests/test_launcher.py``, which tests :func:`two_processes.run_launched` itself.

Usage: ``python tests/launcher_run.py OUT_DIR BEHAVIOUR`` on every rank. Behaviours: ``abort-once`` (rank 0's first
launch aborts as gloo's C++ runtime does at a teardown, the second writes its result), ``exit-1`` (rank 1 exits 1 at
once, rank 0 waits as a rank blocked in a collective would).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    out, behaviour, rank = Path(sys.argv[1]), sys.argv[2], int(os.environ["RANK"])
    if behaviour == "abort-once" and rank == 0 and not (out / "aborted").exists():
        (out / "aborted").touch()
        print("terminate called without an active exception", file=sys.stderr, flush=True)
        os.abort()
    if behaviour == "exit-1":
        if rank == 1:
            sys.exit(1)
        time.sleep(600)
    (out / f"{behaviour}_rank{rank}.json").write_text(json.dumps({"rank": rank}))
