"""The operator's admin key: what separates the operator from the other users of a box.

A loopback daemon is reachable by every user of the machine. Inference stays open
to them; what changes the daemon (pins, loads and unloads, pulls, deletes, copies,
creates) needs the admin key (daemon.operator). The daemon writes it on its first
start into `FLEET_HOME/admin.key` (`admin_key_file` elsewhere), mode 0600: the user
who owns FLEET_HOME (who runs `fleetctl`) reads it, other users cannot. `fleetctl`
and `fleetctl.Client` send it on their own (`client_key`); another client sends it
as `Authorization: Bearer <key>` (the `ollama` Python client: `OLLAMA_API_KEY`).

`admin = "open"` in config.toml drops the guard (a single-user box): then anyone who
may call the daemon may change it, as before.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from fleet.errors import BadRequest, Unauthorized

KEY_FILE = "admin.key"
#: Values of the `admin` setting.
KEY, OPEN = "key", "open"
#: Permission bits the key file may not have: written or read by others, written by the group.
LOOSE_BITS = stat.S_IRWXO | stat.S_IWGRP | stat.S_IXGRP


def key_path(home: str | Path, admin_key_file: str = "") -> Path:
    return Path(admin_key_file) if admin_key_file else Path(home) / KEY_FILE


def ensure_key(path: Path) -> str:
    """The admin key in `path`, made (0600, 256 random bits) when the file is missing.
    Refuses a key file others may read or write: it would guard nothing."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return read_key(path, strict=True)
    try:
        os.write(fd, (secrets.token_urlsafe(32) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return read_key(path, strict=True)


def read_key(path: Path, *, strict: bool = False) -> str:
    """The key in `path`, stripped. `strict` (the daemon): an empty file, or one whose
    permissions let other users read or write it, is refused with the fix."""
    try:
        st = path.stat()
        key = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise BadRequest(f"cannot read the admin key {path}: {exc.strerror}",
                         hint="check admin_key_file / FLEET_ADMIN_KEY_FILE and the file's owner") from None
    if strict and st.st_mode & LOOSE_BITS:
        raise Unauthorized(f"the admin key {path} may be read or written by other users "
                           f"(mode {stat.S_IMODE(st.st_mode):o})", hint=f"chmod 600 {path}")
    if strict and not key:
        raise Unauthorized(f"the admin key {path} is empty", hint=f"remove it and restart: a new one is made: rm {path}")
    return key


def client_key(home: str | Path, url: str) -> str:
    """The admin key a client of `url` sends: `FLEET_ADMIN_KEY`, else the key of the
    daemon serving FLEET_HOME `home` when `url` is that daemon (its lock file names
    the URL and its pid is alive) and this user can read the key; else "".

    The key goes only to the daemon it belongs to: a process of another user that
    listens on a port the CLI might try (the default one, while the daemon is down)
    must not collect it."""
    env = os.environ.get("FLEET_ADMIN_KEY", "")
    if env:
        return env
    import msgspec

    from fleet.config import DAEMON_LOCK, load_settings

    home = Path(home)
    try:
        holder = msgspec.json.decode((home / DAEMON_LOCK).read_bytes())
        os.kill(int(holder["pid"]), 0)
        served = str(holder["url"])
    except (OSError, ValueError, KeyError, TypeError, msgspec.DecodeError):
        return ""
    if not same_url(served, url):
        return ""
    try:
        path = key_path(home, load_settings(home=str(home)).admin_key_file)
        return path.read_text(encoding="utf-8").strip()
    except (OSError, BadRequest):
        return ""  # another user's daemon, or no key yet: the request goes without it


def same_url(a: str, b: str) -> bool:
    """Do two daemon URLs name the same listener? (scheme, port, and host, loopback names alike)"""
    from urllib.parse import urlsplit

    try:
        x, y = urlsplit(a.rstrip("/")), urlsplit(b.rstrip("/"))
        ports = (x.port or 80, y.port or 80)
    except ValueError:
        return False
    if x.scheme != y.scheme or ports[0] != ports[1]:
        return False
    hx, hy = (x.hostname or "").lower(), (y.hostname or "").lower()
    return hx == hy or (loopback_name(hx) and loopback_name(hy))


def loopback_name(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
