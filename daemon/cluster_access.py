"""Several boxes: how this box reaches NATS, and the settings it refuses at start.

Everything here runs before the bridge joins (`serve`'s checks) or when nats.py picks
a server to reconnect to: connection options from settings (servers, auth, TLS), one
connect per server at start to say which setting a server refused, the settings under
which accepted requests would be lost, and where a reconnect goes. It is kept apart
from the running bridge because it is plain functions over `Settings`, tested alone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import ssl
from typing import Any
from urllib.parse import urlsplit

import msgspec

from fleet.config import Settings
from fleet.errors import BadRequest

from fleet.daemon.cluster_names import (ACCESS_CHECK_S, ACK_WAIT_SHARE, MAX_REPLICAS, MIN_ACK_WAIT_MS, NATS_FILES,
                                        PENDING_BYTES, log)


def connect_options(settings: Settings) -> dict[str, Any]:
    """nats.connect keyword arguments from settings: servers, reconnects, auth, TLS.

    Reconnects never stop (a box outlives a NATS restart); pings every 5 s notice a
    dead TCP connection in about 15 s instead of nats.py's default 4 minutes."""
    servers = [s.strip() for s in settings.nats.split(",") if s.strip()]
    if not servers:
        raise BadRequest("--nats: no server URL given, e.g. nats://127.0.0.1:4222")
    opts: dict[str, Any] = {
        "servers": servers, "name": f"fleet {settings.box_name}", "max_reconnect_attempts": -1,
        "reconnect_time_wait": 1, "connect_timeout": 2, "ping_interval": 5, "max_outstanding_pings": 3,
        "pending_size": PENDING_BYTES,
    }
    if settings.nats_creds_file or settings.nats_nkey_file:
        try:
            import nkeys  # noqa: F401  (nats.py signs the server's nonce with it)
        except ImportError:
            raise BadRequest("nats_creds_file and nats_nkey_file need the nkeys package: pip install nkeys") from None
    for name in NATS_FILES:
        path = getattr(settings, name)
        if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            raise BadRequest(f"{name}: no readable file where it points")
    if settings.nats_creds_file:
        opts["user_credentials"] = settings.nats_creds_file
    elif settings.nats_nkey_file:
        opts["nkeys_seed"] = settings.nats_nkey_file
    if settings.nats_token:
        opts["token"] = settings.nats_token
    if settings.nats_user:
        opts["user"], opts["password"] = settings.nats_user, settings.nats_password
    if settings.nats_tls_ca or settings.nats_tls_cert:
        try:
            ctx = ssl.create_default_context(cafile=settings.nats_tls_ca or None)
        except ssl.SSLError as exc:
            raise BadRequest(f"nats_tls_ca: not a PEM certificate ({exc.reason or exc})") from None
        if settings.nats_tls_cert:
            try:
                ctx.load_cert_chain(settings.nats_tls_cert, settings.nats_tls_key or None)
            except ssl.SSLError as exc:
                raise BadRequest(f"nats_tls_cert / nats_tls_key: not a PEM certificate and its private key "
                                 f"({exc.reason or exc})") from None
        opts["tls"] = ctx
    return opts


def check_access(settings: Settings) -> None:
    """At start (`serve`, before anything runs): NATS must let this box in with its
    credentials and certificates, else `serve` exits 1 with one line naming the server
    and what it refused. Every server is tried once, all at once, within ACCESS_CHECK_S.

    A server that cannot be reached (down, not up yet, cut off) says nothing about the
    settings: the box starts and joins when one answers, serving its own models
    meanwhile. Refused by some servers but let in by another: a warning names them."""
    refused: list[str] = []
    reached = False
    # asyncio warns ("returning true from eof_received() has no effect when using ssl") when
    # a TLS server closes a refused connection: noise around the one line that matters.
    quiet = logging.getLogger("asyncio")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        tried = asyncio.run(_try_servers(settings))
    finally:
        quiet.setLevel(level)
    for url, exc, info in tried:
        if exc is None:
            reached = True
            continue
        why = refusal(exc, settings, info)
        if why is not None:
            refused.append(f"NATS at {_host_port(url)} {why}")
    if refused and not reached:
        raise BadRequest(refused[0])
    for line in refused:
        log.warning("%s (another server let this box in)", line)


async def _try_servers(settings: Settings) -> list[tuple[str, BaseException | None, dict[str, Any]]]:
    """Connect once to each server alone, no reconnects: (url, None, {}) or (url, the error,
    the INFO the server greets a plain connection with, when it answers one)."""
    import nats

    opts = connect_options(settings)

    async def quiet(_exc: Exception) -> None:
        return None

    async def one(url: str) -> tuple[str, BaseException | None, dict[str, Any]]:
        try:
            nc = await asyncio.wait_for(nats.connect(**{
                **opts, "servers": [url], "allow_reconnect": False, "max_reconnect_attempts": 0,
                "error_cb": quiet}), ACCESS_CHECK_S)
        except Exception as exc:  # any failure is `refusal`'s to read: it names those about the settings
            try:
                return url, exc, await asyncio.wait_for(_server_info(url), 2.0)
            except (OSError, ValueError):  # down, away, or not speaking NATS: it says nothing
                return url, exc, {}
        await nc.close()
        return url, None, {}

    return list(await asyncio.gather(*(one(url) for url in opts["servers"])))


async def _server_info(url: str) -> dict[str, Any]:
    """The INFO a NATS server greets any TCP connection with (before TLS, before auth)."""
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 4222)
    try:
        line = await reader.readline()
    finally:
        writer.close()
    return msgspec.json.decode(line[5:]) if line.startswith(b"INFO ") else {}


def refusal(exc: BaseException, settings: Settings, info: dict[str, Any] | None = None) -> str | None:
    """What a failed connect says against this box's settings, or None when it says
    nothing about them (refused or cut connections, timeouts: the server is down or away).
    `info`: the server's INFO, read after the failure (a server that asks for client
    certificates says so there, and may drop a connection without one after the handshake)."""
    from nats.errors import Error as NatsError

    if isinstance(exc, ssl.SSLCertVerificationError):
        return (f"has a certificate this box does not trust ({exc.verify_message}): "
                "nats_tls_ca must name the CA that signed it")
    asks_cert = bool((info or {}).get("tls_verify"))
    alert = isinstance(exc, ssl.SSLError) and "ALERT" in (exc.reason or "")  # the server's TLS alert
    if asks_cert and not settings.nats_tls_cert and (alert or isinstance(exc, (OSError, NatsError))):
        return "asks for a TLS client certificate and this box has none: set nats_tls_cert and nats_tls_key"
    if alert or (asks_cert and isinstance(exc, (ConnectionError, ssl.SSLError))):
        why = f" ({exc.reason})" if isinstance(exc, ssl.SSLError) and exc.reason else ""
        return f"refused this box's TLS client certificate{why}: nats_tls_cert must be signed by a CA it trusts"
    text = str(exc).removeprefix("nats: ").strip("'")
    if isinstance(exc, NatsError) and ("Authorization" in text or "Authentication" in text):
        return f"refused this box's credentials ({_credentials(settings)}): {text}"
    return None


def _credentials(settings: Settings) -> str:
    given = [name for name in ("nats_creds_file", "nats_nkey_file", "nats_token", "nats_user") if getattr(settings, name)]
    if any(urlsplit(u.strip()).username for u in settings.nats.split(",") if u.strip()):
        given.append("the URL's user")
    return ", ".join(given) or "none given: set nats_creds_file, nats_nkey_file, nats_token or nats_user"


def _host_port(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    return f"{parts.hostname}:{parts.port or 4222}"


def check_settings(settings: Settings) -> None:
    """Refuse, before anything starts, NATS settings under which accepted requests
    would be lost: a dead box's work redelivered too late to answer it before the
    request's deadline, or an ack wait so short that a busy live box loses its own."""
    connect_options(settings)
    ack_ms, timeout_ms = settings.nats_ack_wait_ms, settings.timeout_ms
    if ack_ms < MIN_ACK_WAIT_MS:
        raise BadRequest(f"nats_ack_wait_ms is {ack_ms}: it must be at least {MIN_ACK_WAIT_MS} (a box extends "
                         "the work it holds every third of it; shorter, a busy box loses work it is running)")
    check_deadline(timeout_ms, ack_ms)
    if not 0 <= settings.nats_replicas <= MAX_REPLICAS:
        raise BadRequest(f"nats_replicas must be between 0 (3 on a cluster that can place them, else 1) and "
                         f"{MAX_REPLICAS} (JetStream's most), got {settings.nats_replicas}")
    if settings.nats_fetch_per_worker < 1:
        raise BadRequest(f"nats_fetch_per_worker must be at least 1, got {settings.nats_fetch_per_worker}")


def choose_server(servers: list[Any], avoid: set[str], wait_s: float) -> tuple[Any, float]:
    """Where a reconnect goes, from nats.py's pool (each with `uri` and `reconnects`, the
    failed attempts since it was last connected): at random among those not yet failed,
    other than those in `avoid` (host:port: the server just lost, one cut off from
    JetStream's majority); when none is left, one of those that failed least, after `wait_s`."""
    fresh = [s for s in servers if s.reconnects == 0 and s.uri.netloc not in avoid]
    if fresh:
        return random.choice(fresh), 0.0
    fewest = min(s.reconnects for s in servers)
    return random.choice([s for s in servers if s.reconnects == fewest]), wait_s


def check_deadline(timeout_ms: int, ack_ms: int) -> None:
    """The default deadline must leave another box time to answer a dead box's requests:
    at least ACK_WAIT_SHARE ack waits (at start, and for a SIGHUP's new `timeout_ms`)."""
    if ack_ms * ACK_WAIT_SHARE > timeout_ms:
        raise BadRequest(
            f"nats_ack_wait_ms ({ack_ms}) must be at most a third of timeout_ms ({timeout_ms}): a box that dies "
            "holding a request is noticed only after the ack wait, and another box needs the rest of the "
            "deadline to answer it",
            hint=f"set FLEET_NATS_ACK_WAIT_MS to {timeout_ms // ACK_WAIT_SHARE} or less (default 5000)")
