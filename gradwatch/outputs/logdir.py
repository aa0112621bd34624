"""Finding and opening the files of a log directory so that nothing is skipped in silence.

``Path.rglob`` passes over a directory it may not read, and ``open`` on a FIFO named like a record waits forever:
:func:`find_files` walks the directory itself and raises :class:`ReportInputError` for every entry it cannot take into
account, and :func:`open_regular` opens without blocking and refuses anything but a regular file. Every message names
the path (:func:`shown`) and the reason in one line.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from gradwatch.errors import ReportInputError


def shown(path: Path | str) -> str:
    """``path`` as it can be printed: itself, or its ``ascii()`` form when its name is not valid UTF-8."""
    text = str(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return ascii(os.fsencode(text))[1:]  # b'...\xff...' without the b
    return text


def _reason(error: OSError) -> str:
    return error.strerror or type(error).__name__


def _decodable(path: Path) -> None:
    if shown(path) != str(path):
        raise ReportInputError(f"{shown(path)}: a file name that is not valid UTF-8, which gradwatch cannot decode")


def _entries(directory: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as entries:
            return sorted(entries, key=lambda entry: entry.name)
    except OSError as error:
        raise ReportInputError(f"{shown(directory)}: cannot read the directory ({_reason(error)})") from error


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"


def find_files(logdir: Path, wanted: Callable[[str], bool]) -> list[Path]:
    """Every file under ``logdir`` whose name ``wanted`` accepts, sorted; symbolic links to directories are not
    followed (a link cycle would never end).

    Raises:
        ReportInputError: A directory under ``logdir`` cannot be listed, a wanted name is not a regular file (a FIFO,
            a device, a directory) or cannot be read, or a wanted name or a directory name is not valid UTF-8.
    """
    found: list[Path] = []
    pending = [logdir]
    while pending:
        directory = pending.pop()
        for entry in _entries(directory):
            path = directory / entry.name
            if entry.is_dir(follow_symlinks=False):
                _decodable(path)
                pending.append(path)
            elif wanted(entry.name):
                _decodable(path)
                try:
                    mode = os.stat(path).st_mode  # follows a link: a link to a regular file is read
                except OSError as error:
                    raise ReportInputError(f"{shown(path)}: cannot read the file ({_reason(error)})") from error
                if not stat.S_ISREG(mode):
                    raise ReportInputError(f"{shown(path)}: {_kind(mode)}, not a regular file; refused (never opened)")
                found.append(path)
    return sorted(found)


def open_regular(path: Path) -> BinaryIO:
    """``path`` opened for reading in binary, if it is a regular file.

    Raises:
        ReportInputError: It cannot be opened, or it is not a regular file (checked on the open file, which was opened
            without blocking, so a FIFO is never waited on).
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        if error.errno == errno.ENXIO:  # a FIFO or socket without a writer, opened without blocking
            raise ReportInputError(f"{shown(path)}: not a regular file; refused") from error
        raise ReportInputError(f"{shown(path)}: cannot read the file ({_reason(error)})") from error
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise ReportInputError(f"{shown(path)}: {_kind(mode)}, not a regular file; refused")
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def check_directory(logdir: Path) -> None:
    """Raise :class:`ReportInputError` unless ``logdir`` is an existing directory."""
    if not logdir.exists():
        raise ReportInputError(f"log directory {shown(logdir)} does not exist")
    if not logdir.is_dir():
        raise ReportInputError(f"{shown(logdir)} is not a directory (pass the directory that holds the logs)")
