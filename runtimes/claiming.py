"""Taking work off a lane for one batch, and answering what will not run.

The worker's step loop (runtimes.worker) claims through a `Claimer`: the lane's
head and what a batch as wide as the head holds, more while it lingers for
company, the over-pull given back at once (at its places in lane order),
late claims answered `timeout` unrun, a lane whose model cannot load answered
with the reason. Queue calls only: the sizes come from runtimes.policy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from fleet.errors import FleetError
from fleet.messages import STATUS_ERROR, Envelope, WorkError
from fleet.local_queue import Claim, QueueFull
from fleet.runtimes.linger import LastRun, linger_left_ms
from fleet.runtimes.policy import padded_tokens

log = logging.getLogger("fleet.worker")

_encode = msgspec.msgpack.Encoder().encode


@dataclass(frozen=True, slots=True)
class Claimer:
    """One worker's claims on the queue's lanes."""

    queue: object  # local_queue.LocalQueue
    worker: int
    lease_ms: int
    #: `<box>/<worker>` written into every result (the X-Served-By header).
    served_by: str
    clock_ns: Callable[[], int] = time.monotonic_ns

    def claim_batch(self, lane: int, max_items: int, cap: int, *, queued: int | None = None) -> list:
        """Claim the head, then at most as many items as a batch as wide as the head
        can hold (cap // head tokens): a long head must not pull a lane's worth of
        short items only to return them (each return re-inserts by seq under the lock).
        `queued` (the lane's depth when it was chosen) bounds the second claim: a lone
        request skips it (one lock round less on the latency path); items that came
        since are claimed by the linger or the next round."""
        claims = self.queue.claim(lane, worker=self.worker, max_items=1, max_tokens=cap, lease_ms=self.lease_ms)
        if not claims:
            return claims
        room = min(max_items, cap // max(1, claims[0].tokens), max_items if queued is None else queued) - 1
        if room > 0:
            claims += self.queue.claim(lane, worker=self.worker, max_items=room,
                                       max_tokens=max(1, cap - claims[0].tokens), lease_ms=self.lease_ms)
        return claims

    def linger_for_more(self, lane: int, claims: list, linger_ms: float, since_ns: int, max_items: int, cap: int,
                        *, answered: LastRun | None = None) -> list:
        """While the lane is drained and the batch short, wait (on the queue's wake-ups)
        up to `linger_ms` from `since_ns` and claim what arrives in this lane. The wait
        ends early once as many items came after the `answered` batch's ack as it held:
        clients that each wait for their answer send again one each, and are all back."""
        back = 0 if answered is None else sum(c.enqueue_ns >= answered.acked_ns for c in claims)
        while answered is None or back < answered.items:
            left = linger_left_ms(
                self.clock_ns(), since_ns, linger_ms, items=len(claims), max_items=max_items,
                padded_tokens=padded_tokens([c.tokens for c in claims]), max_padded_tokens=cap, lane_drained=True,
            ) if linger_ms > 0 else 0.0
            if left <= 0:
                return claims
            # Interactive items in the lane now came after the claim (a closed loop's clients
            # come back microseconds apart), or do not fit: claim at once, no wait. Ran
            # without them, the first client back ran alone while the rest waited. Batch
            # work at the head is a backlog the claim left by its cap: no linger, as before.
            waiting = next((s for s in self.queue.lane_stats() if s.lane == lane and s.depth), None)
            if waiting is not None and waiting.head_batch:
                return claims
            if waiting is None and not self.queue.wait_for_work(left / 1e3):
                return claims
            room = cap - sum(c.tokens for c in claims)
            more = self.queue.claim(lane, worker=self.worker, max_items=max_items - len(claims),
                                    max_tokens=max(1, room), lease_ms=self.lease_ms)
            if not more:
                return claims  # the wake-up was for another lane: run now rather than hold this batch
            claims = claims + more
            if answered is not None:
                back += sum(c.enqueue_ns >= answered.acked_ns for c in more)
        return claims

    def return_overpull(self, claims: list, keep: list[int]) -> tuple[list, int]:
        """Give back, at once, the claimed items this batch will not run (the queue puts
        them back at their places in lane order). Returns (kept claims, items returned)."""
        if len(keep) == len(claims):
            return claims, 0
        kept = set(keep)
        returned = self.queue.return_items([c.item_id for i, c in enumerate(claims) if i not in kept])
        return [claims[i] for i in keep], returned

    def drop_late(self, claims: list[Claim]) -> tuple[list[Claim], int]:
        """(the claims still in time, how many were late): a late one is acked
        `timeout` unrun (the daemon has answered it already and discards the ack)."""
        now = self.clock_ns()
        late = [c for c in claims if c.deadline_ns and c.deadline_ns <= now]
        if not late:
            return claims, 0
        self.ack_errors(late, WorkError("timeout", "the request's deadline passed before it ran"))
        return [c for c in claims if not (c.deadline_ns and c.deadline_ns <= now)], len(late)

    def error_ack(self, item_id: int, error: WorkError) -> tuple[int, bytes, int]:
        """The ack answering claim `item_id` with `error` (for `ack_many`)."""
        return item_id, _encode(Envelope(0.0, 0.0, self.served_by, error)), STATUS_ERROR

    def ack_errors(self, claims: list, error: WorkError) -> None:
        payload = _encode(Envelope(0.0, 0.0, self.served_by, error))
        self.queue.ack_many([(c.item_id, payload, STATUS_ERROR) for c in claims])

    def any_wanted(self, ids: list[int]) -> bool:
        """Is any of the claimed items `ids` still wanted (no deadline, or not passed)?
        Lock-free reads of their deadlines: `LocalQueue.cancel` sets a claimed item's to 1."""
        now = self.clock_ns()
        return any(not d or d > now for d in self.queue.deadlines(ids))

    def ack_batch(self, acks: list, claims: list[Claim], model: str) -> None:
        ack_all(self.queue, acks, [c.item_id for c in claims], self.served_by, model)

    def fail_lane(self, lane: int, exc: FleetError) -> int:
        """A model that cannot load answers what waits for it, and the worker goes on."""
        log.error("cannot serve lane %s: %s", self.queue.lane_name(lane), exc.message)
        claims = self.queue.claim(lane, worker=self.worker, max_items=1024, max_tokens=1 << 30, lease_ms=self.lease_ms)
        self.ack_errors(claims, WorkError(exc.code, exc.message))
        return len(claims)


def ack_all(queue, acks: list, ids: list[int], served_by: str, model: str) -> None:
    """A batch's answers (`acks` for the items `ids`) in one `ack_many`: one lock, one
    wake-up. With no slab room for some results right now, those items are still ours:
    they are answered with a short error (acks already done are skipped there)."""
    try:
        queue.ack_many(acks)
    except QueueFull as exc:
        log.error("results of %d items on %s do not fit the queue: %s", len(acks), model, exc.message)
        error = _encode(Envelope(0.0, 0.0, served_by,
                                 WorkError("overloaded", f"queue memory is full for results: {exc.message}")))
        queue.ack_many([(i, error, STATUS_ERROR) for i in ids])
