"""Remove what a killed queue owner left in /dev/shm.

A queue named `<prefix>-<pid>` (the daemon names its queue after its own pid)
is three entries in /dev/shm: the segment `<prefix>-<pid>`, its flock file
`<prefix>-<pid>.lock` and the results' wake-up FIFO `<prefix>-<pid>.wake`
(queues of earlier versions also had POSIX semaphores, which glibc keeps there:
`sem.<prefix>-<pid>.work` and `sem.<prefix>-<pid>.results`). The owner
unlinks them on a clean stop; a SIGKILL leaves them behind, and nothing else
ever would remove them.

An entry is stale only when its owner pid names no process: a live queue is
never removed (another user's process counts as alive). A dead owner's pid
reused by an unrelated process keeps its entries until that process ends:
the price of never guessing about a live one. Entries that only look alike
(another prefix, no pid, other suffixes) are never touched.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

SHM_DIR = Path("/dev/shm")

#: The entries of one queue, named after its owner's pid (and the semaphores of earlier versions).
_ENTRY = re.compile(r"(?:sem\.)?(?P<queue>(?P<prefix>[A-Za-z0-9_]+)-(?P<pid>[1-9][0-9]{0,9}))"
                    r"(?P<suffix>|\.lock|\.wake|\.work|\.results)")
_SEM_SUFFIXES = (".work", ".results")


def queue_name(prefix: str, pid: int) -> str:
    """The name of the queue owned by process `pid` (what `find_stale` recognises)."""
    return f"{prefix}-{pid}"


def owner_of(entry: str, prefix: str) -> tuple[str, int] | None:
    """(queue name, owner pid) when `entry` is one of the entries of a
    `<prefix>-<pid>` queue, else None."""
    m = _ENTRY.fullmatch(entry)
    if m is None or m["prefix"] != prefix:
        return None
    # The semaphores live under `sem.`; the segment and lock file never do.
    if (m["suffix"] in _SEM_SUFFIXES) != entry.startswith("sem."):
        return None
    return m["queue"], int(m["pid"])


def find_stale(entries: Iterable[str], prefix: str, alive: Callable[[int], bool]) -> list[str]:
    """The entries of `prefix` queues whose owner is gone, sorted. `alive(pid)` is
    asked once per queue."""
    verdicts: dict[str, bool] = {}
    stale = []
    for entry in entries:
        owner = owner_of(entry, prefix)
        if owner is None:
            continue
        queue, pid = owner
        if queue not in verdicts:
            verdicts[queue] = alive(pid)
        if not verdicts[queue]:
            stale.append(entry)
    return sorted(stale)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (in this pid namespace). Unknowable counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def sweep_stale(prefix: str, *, shm_dir: Path = SHM_DIR, alive: Callable[[int], bool] = pid_alive) -> list[str]:
    """Remove the stale entries of `prefix` queues from `shm_dir`; returns their
    names. Call it before creating this process's own queue: entries already
    named after this pid are then stale too (a pid reused, as a container's
    main process gets the same small pid at each restart), and would make the
    create fail. An entry that vanished meanwhile (another sweeper) or that
    belongs to another user (/dev/shm is sticky: only its owner may remove it)
    is skipped."""
    try:
        entries = os.listdir(shm_dir)
    except FileNotFoundError:
        return []
    me = os.getpid()
    removed = []
    for entry in find_stale(entries, prefix, lambda pid: pid != me and alive(pid)):
        try:
            os.unlink(shm_dir / entry)
        except (FileNotFoundError, PermissionError):
            continue
        removed.append(entry)
    return removed
