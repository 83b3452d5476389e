"""Small files fleet replaces whole: the pins, the catalog override, the service's unit files.

A write goes to a temporary file beside the target, is fsynced and renamed over
it, so a reader sees the old file or the new one, never a torn one. Whatever
fails on the way (a full disk, a check of the new text), the temporary file is
removed and the old file stays as it was. A full disk (or quota) is
`InsufficientStorage` (507) naming what was being saved; other errors pass as
they are.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from pathlib import Path

from fleet.errors import InsufficientStorage

#: errno values of a write that found no room.
NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT})


def replace_file(path: Path, data: bytes, *, what: str, check: Callable[[Path], None] | None = None) -> None:
    """Make `data` the content of `path`; `what` names it in the error of a full disk
    ("the pin of 'm'": messages name models, not paths). `check(temporary path)` may
    refuse the new file before it replaces the old one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if check is not None:
            check(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno in NO_ROOM:
            raise InsufficientStorage(f"no space left to save {what}: the disk is full",
                                      hint="free space on the disk that holds FLEET_HOME (fleetctl doctor shows it)"
                                      ) from None
        raise


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
