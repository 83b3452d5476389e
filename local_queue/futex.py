"""Wait for a 32-bit word of the shared segment to change, and wake every waiter on it.

Linux futexes on a shared mapping (not FUTEX_PRIVATE: the waiters are other
processes), through libc's `syscall` (ctypes releases the GIL for the call).
`wait(addr, seen, timeout_s)` sleeps only while the word still reads `seen`, so a
change made after the caller read it is never slept through; `wake_all(addr)`
wakes every process sleeping on it. That is the broadcast the work wake-up needs
(local_queue invariant 5): no waiter can take another's wake-up, as one can
take a post of a shared counting semaphore.

On an architecture whose syscall number is not known here, `wait` naps
POLL_S at a time instead (the caller re-checks the word between naps).
"""

from __future__ import annotations

import ctypes
import platform
import sys
import time

#: SYS_futex by machine (asm/unistd.h).
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_ALL = 0x7FFFFFFF
#: The nap of the fallback wait.
POLL_S = 0.005


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_syscall = ctypes.CDLL(None, use_errno=True).syscall if _SYS_FUTEX is not None else None
if _syscall is not None:
    _syscall.restype = ctypes.c_long


def low_word_address(buf: memoryview, offset: int) -> int:
    """The address of the low 32 bits of the int64 at `offset` in `buf` (a writable
    mapping that outlives every use of the address). No buffer export is kept."""
    word = ctypes.c_uint32.from_buffer(buf, offset + (0 if sys.byteorder == "little" else 4))
    addr = ctypes.addressof(word)
    del word
    return addr


def wait(addr: int, seen: int, timeout_s: float) -> None:
    """Sleep until the word at `addr` is woken on or no longer reads `seen` (the low 32
    bits), or `timeout_s` passes. Returns either way: the caller re-checks."""
    if timeout_s <= 0:
        return
    if _syscall is None:
        time.sleep(min(timeout_s, POLL_S))
        return
    whole = int(timeout_s)
    ts = _Timespec(whole, int((timeout_s - whole) * 1e9))
    # 0 (woken), EAGAIN (it changed first), ETIMEDOUT, EINTR: all "look again".
    _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_long(_FUTEX_WAIT),
             ctypes.c_long(seen & 0xFFFFFFFF), ctypes.byref(ts), None, ctypes.c_long(0))


def wake_all(addr: int) -> None:
    """Wake every process sleeping on the word at `addr`."""
    if _syscall is not None:
        _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_long(_FUTEX_WAKE), ctypes.c_long(_ALL),
                 None, None, ctypes.c_long(0))
