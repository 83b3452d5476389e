"""Who acts on the store: the daemon that serves it, else this process on the files.

The daemon owns its store (docs/architecture.md, "The store and its owner"): a
worker keeps the weights it read, so a model pulled, replaced or removed behind the
daemon's back is not what it serves. `fleetctl pull | list | rm` find the daemon as
every verb does (fleet.config.client_url_source: FLEET_URL, FLEET_HOME's config,
the running daemon's lock file, the default bind) and, when one answers, act
through its API (daemon/controllers/store.py) with the operator's admin key, which
`fleetctl.Client` sends on its own to the daemon of this FLEET_HOME.

Only when no daemon answers do they act on the files of FLEET_HOME's store, and say
so in one line on stderr. Two silences are errors instead, never a reason to write
a store the daemon in question does not read: FLEET_URL set and unreachable, and
this FLEET_HOME's own daemon alive (its lock file) but not answering (starting).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from fleet.errors import FleetError, Forbidden, Unauthorized, Unavailable, from_code
from fleetctl.client import MSGPACK, Client, error_of, unreachable

#: How long the probe waits for a daemon to answer `/healthz` (a live one answers in ms).
PROBE_TIMEOUT_S = 3.0
#: Modules the store's own code needs where no daemon runs (the `server` extra's).
STORE_MODULES = ("huggingface_hub", "safetensors", "litestar")


def store_daemon() -> Client | None:
    """A client of the daemon that owns the store, or None when no daemon answers and
    this process may act on the files itself (module doc)."""
    from fleet.config import client_url_source, default_home, live_daemon

    url, source = client_url_source()
    client = Client(url, retries=0)
    try:
        client._http.get("/healthz", timeout=PROBE_TIMEOUT_S)
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # nothing listens there
        client.close()
        if source == "env":
            raise Unavailable(unreachable(url, exc).message, hint="start that daemon, or unset FLEET_URL to use "
                                                                  "this box's store with no daemon running") from None
        holder = live_daemon(default_home())
        if holder is not None:
            raise Unavailable(f"the daemon of this FLEET_HOME (pid {holder[0]}) holds its store but does not "
                              f"answer at {holder[1]}", hint="it may still be starting: `fleetctl logs`; try "
                                                             "again once `fleetctl ps` answers") from None
        return None
    except httpx.TransportError as exc:  # something listens there but does not answer
        client.close()
        raise unreachable(url, exc) from None
    return client


def without_daemon(doing: str) -> None:
    """Say, in one line on stderr, that no daemon answered and the files are used."""
    from fleet.config import client_url, load_settings

    print(f"no fleet daemon answers at {client_url()}: {doing} the store in {load_settings().store_path} "
          "directly", file=sys.stderr)


def need_server_side(doing: str) -> None:
    """Acting on the store's files takes the server side; a client-only install
    (`pip install fleet-serve`) says so instead of failing on a missing module."""
    missing = [m for m in STORE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise FleetError(f"{doing} with no daemon running needs fleet's server side, which this install lacks "
                         f"({', '.join(missing)} not installed)",
                         hint="pip install 'fleet-serve[server]', or point FLEET_URL at a running daemon")


def stream_lines(client: Client, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """POST `body` and yield the NDJSON lines of the reply; an `{error}` line raises its
    error (with its hint). The read has no timeout: the daemon ends the stream."""
    from msgspec import msgpack

    try:
        with client._http.stream("POST", path, content=msgpack.encode(body),
                                 headers={"Content-Type": MSGPACK, "Accept": "application/x-ndjson"},
                                 timeout=httpx.Timeout(30.0, read=None)) as resp:
            if resp.status_code >= 400:
                raise error_of(resp, resp.read())
            for raw in resp.iter_lines():
                if not raw.strip():
                    continue
                line = json.loads(raw)
                if "error" in line:
                    err = from_code(line["error"].get("code", "internal"), line["error"].get("message", ""))
                    err.hint = line["error"].get("hint")
                    raise err
                yield line
    except httpx.TransportError as exc:
        raise unreachable(client.url, exc) from None


@contextmanager
def as_operator(client: Client) -> Iterator[Client]:
    """Use `client` for the store's routes (the operator's): a refusal for want of the
    admin key says how to act as the daemon's operator."""
    with client:
        try:
            yield client
        except (Unauthorized, Forbidden) as exc:
            exc.hint = ("the daemon owns its store: run fleetctl as the daemon's user with its FLEET_HOME "
                        "(the service: sudo -u fleet env FLEET_HOME=/var/lib/fleet fleetctl ...), "
                        "or set FLEET_ADMIN_KEY")
            raise
