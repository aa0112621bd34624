"""Writing the command's output when its reader may go away: ``gradwatch report DIR | head`` ends quietly.

Python ignores SIGPIPE, so writing to a pipe whose reader has exited raises ``BrokenPipeError`` (and again when the
interpreter flushes stdout at exit, a second traceback). :func:`emit` catches it once, points the stream at
``/dev/null`` so nothing later can raise, and tells the caller the reader is gone; the command still returns its
exit status (a CI gate with ``set -o pipefail`` sees the verdict, not a crash).
"""

from __future__ import annotations

import os
import sys
from typing import TextIO


def silence(stream: TextIO) -> None:
    """Point ``stream``'s file descriptor at ``/dev/null`` (after its reader went away)."""
    try:
        descriptor = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (a test's StringIO): nothing will be flushed at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, descriptor)
    finally:
        os.close(devnull)


def emit(text: str, stream: TextIO | None = None) -> bool:
    """Write ``text`` and a newline to ``stream`` (stdout by default) and flush; ``False`` when the reader is gone."""
    stream = sys.stdout if stream is None else stream
    try:
        stream.write(text + "\n")
        stream.flush()
    except BrokenPipeError:
        silence(stream)
        return False
    return True
