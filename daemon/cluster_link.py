"""Several boxes: this daemon's one NATS connection, as every room of the bridge uses it.

The requester, the puller, the heartbeats and the payload store each need the same
few things of the connection: who this daemon is on the wire (box, instance, reply
subjects), the connection and its JetStream context (replaced when the box moves to
another server), publishing until JetStream acks, the tasks spawned on its behalf
(cancelled when the box leaves), and one rate-limited error log. They live here, once,
so no room reaches into another's state for them.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Coroutine
from typing import Any

from fleet.config import Settings
from fleet.errors import Overloaded, Timeout, Unavailable

from fleet.daemon.cluster_access import choose_server
from fleet.daemon.cluster_names import JETSTREAM_LOST_ACK_WAITS, REPLY_PREFIX, box_token, log

#: Seconds between two lines of `Link.log_error`: a NATS outage must not flood the log.
ERROR_LOG_EVERY_S = 10.0


class Link:
    """Who this daemon is to the other boxes, and its connection to NATS.

    `nc` and `js` are set by the join (`Cluster`); `stopping` once the daemon leaves.
    `jetstream_ok_at` is when a JetStream call last went through this box's server
    (monotonic s): publishes and heartbeat puts move it, `leave_server_without_jetstream`
    reads it. Event loop only (no lock)."""

    def __init__(self, settings: Settings, options: dict[str, Any]) -> None:
        self.settings = settings
        #: nats.connect keyword arguments (`connect_options`), validated before anything runs.
        self.options = options
        self.box = settings.box_name
        self.key = box_token(self.box)
        self.instance = secrets.token_hex(4)
        #: Replies to this daemon's requests arrive on <reply_prefix><n>, pieces on <...><n>.p.
        self.reply_prefix = f"{REPLY_PREFIX}{self.key}.{self.instance}."
        #: This daemon as a holder of work, in held notices and on its alive subject.
        self.holder_id = f"{self.key}.{self.instance}"
        self.nc: Any = None
        self.js: Any = None
        self.joined = asyncio.Event()
        self.stopping = False
        #: When a JetStream call last went through this box's NATS server (monotonic s), and
        #: the server (host:port) it left for not letting them through (`choose_server`).
        self.jetstream_ok_at = time.monotonic()
        self.avoid_server = ""
        #: The server (host:port) this box is (or was last) connected to.
        self.server_here = ""
        #: Tasks started for one message or one request (serving, replies, deletes, cancels).
        self.serving: set[asyncio.Task] = set()
        self._last_error_log = 0.0

    @property
    def reachable(self) -> bool:
        """Joined and connected now: requests can be queued in JetStream."""
        return self.joined.is_set() and self.nc is not None and self.nc.is_connected

    def is_mine(self, reply_to: str) -> bool:
        """A reply subject of this daemon's own requests (no NATS hop back)."""
        return reply_to.startswith(self.reply_prefix)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self.serving.add(task)
        task.add_done_callback(self.serving.discard)

    def log_error(self, text: str) -> None:
        now = time.monotonic()
        if now - self._last_error_log >= ERROR_LOG_EVERY_S:
            self._last_error_log = now
            log.warning("%s", text)

    async def publish(self, subject: str, body: bytes, headers: dict[str, str], deadline: float, *,
                      offline_gives_up: bool = False) -> Any:
        """Publish until JetStream acks (its PubAck: stream, seq) or the deadline passes.
        Retrying is safe: the stream drops a second copy with the same Nats-Msg-Id (dedup
        window). With `offline_gives_up`, a failure while disconnected returns None at once."""
        import nats.errors
        from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout("could not queue the request in JetStream before its deadline (NATS unreachable?)")
            try:
                ack = await self.js.publish(subject, body, headers=headers, timeout=min(left, 2.0))
                self.jetstream_ok_at = time.monotonic()
                return ack
            except APIError as exc:
                if exc.err_code == 10077 or "maximum messages" in (exc.description or ""):
                    raise Overloaded(f"the cluster queue is full ({self.settings.nats_max_queued} waiting); "
                                     "retry shortly", retry_after_s=1.0) from None
                in_process = "in process" in (exc.description or "")
                if not (in_process or isinstance(exc, ServiceUnavailableError) or exc.code == 503):
                    raise Unavailable(f"JetStream refused the request: {exc.description}") from None
                # For now: the stream has no leader (503: an election, a server cut from the
                # others), or this message id's first try is still being agreed on (a retry
                # after a timeout, 10158). Publish again within the deadline: the id dedups.
                self.log_error(f"JetStream is not taking the request yet ({exc.description or 'no stream leader'}); "
                               "publishing again")
                await asyncio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
            except (TimeoutError, NoStreamResponseError, nats.errors.ConnectionClosedError,
                    nats.errors.OutboundBufferLimitError, nats.errors.StaleConnectionError):
                if offline_gives_up and not self.nc.is_connected:
                    return None
                await asyncio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))

    async def leave_server_without_jetstream(self) -> None:
        """Connected, yet no JetStream call has gone through for JETSTREAM_LOST_ACK_WAITS
        ack waits (past any Raft election): this box's server is cut off from the cluster's
        majority. Reconnect elsewhere (`choose_server` avoids this one)."""
        lost_s = JETSTREAM_LOST_ACK_WAITS * self.settings.nats_ack_wait_ms / 1000.0
        if not self.nc.is_connected or time.monotonic() - self.jetstream_ok_at < lost_s:
            return
        log.warning("JetStream has not answered through NATS server %s for %.0f s (cut off from the "
                    "cluster's majority?): reconnecting to another server", self.server_here, lost_s)
        self.avoid_server = self.server_here
        self.jetstream_ok_at = time.monotonic()
        await self.nc.force_reconnect()

    def next_server(self, servers: list[Any], _info: dict[str, Any]) -> tuple[Any, float]:
        """nats.py's reconnect_to_server_handler: `choose_server`, then connect after the wait it says."""
        return choose_server(servers, {self.avoid_server, self.server_here}, self.options["reconnect_time_wait"])
