"""Fair sharing of a model between clients: who shares it now, and whose request
runs between two micro-batches of another client's batch.

A client is a queue flow (the daemon's `X-Fleet-Client`, else the connection).
The lane's fair order (local_queue invariant 2) puts a light client's request
next; what it still waits for is the batch running when it arrives. The
worker's step loop (runtimes.worker) asks this room three things, and tells it
what every batch served:

- `shared` / `lighter`: while several clients are current, batches aim for a
  contended share of the target, and micro-batches are cut shorter while one of
  them sends shorter requests (runtimes.policy: `contended`, `lighter_client`).
- `interactive_padded`: how much batch work may fill the model's next batch
  (`batch_fill_cap`).
- `other_first` / `claim_other`: at a micro-batch boundary of a batch (the
  adapter's `batch` yields there, runtimes.base), whether another client's
  interactive request, shorter than the batch's heaviest client's part
  (`runs_first`), waits at the head of the lane or up to INTERJECT_LOOK places
  behind only this batch's clients' requests; and claiming it. The step loop
  then runs it as a batch of its own before the next micro-batch: a light
  client waits for one micro-batch of a flood, not for its batch (issue 25).

Plain data and queue reads only: no model code, no acks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from fleet.local_queue import Claim
from fleet.runtimes.policy import (
    FLOW_QUIET_NS, INTERACTIVE_QUIET_NS, INTERJECT_LOOK, contended, lighter_client, padded_tokens, runs_first,
)


@dataclass(frozen=True, slots=True)
class Interjection:
    """What a running batch lets run between its micro-batches (`Flows.plan`)."""

    lane: int
    #: The batch's interactive clients (queue flows).
    outer: frozenset[int]
    #: Its heaviest client's tokens in it: only a shorter request runs first (`runs_first`).
    heaviest: int
    #: Look before micro-batch 0 too: these clients had the lane's last forward as well.
    again: bool


@dataclass
class Flows:
    """What the batches run here say about the clients of each model and lane."""

    #: Per model, flow -> when its last interactive batch here was acked (`contended`).
    seen: dict[str, dict[int, int]] = field(default_factory=dict)
    #: Per model, flow -> the fewest tokens of an item of its last batch here (`lighter_client`).
    fewest: dict[str, dict[int, int]] = field(default_factory=dict)
    #: Per model, (acked at, padded tokens of its interactive part) of its last batch
    #: with interactive work in it (`batch_fill_cap`).
    interactive: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: Per lane, the clients of the last batch run on it, interjected ones included:
    #: a batch of the same clients looks for another's request before its micro-batch 0 too.
    last: dict[int, frozenset[int]] = field(default_factory=dict)

    def shared(self, model: str, now_ns: int) -> bool:
        """Several clients had interactive work in `model`'s batches lately (`contended`)."""
        return contended(self.seen.get(model, {}), now_ns)

    def lighter(self, model: str, flows: Iterable[int], tokens: int, now_ns: int) -> bool:
        """A current client other than `flows` sends requests shorter than `tokens` (`lighter_client`)."""
        return lighter_client(self.seen.get(model, {}), self.fewest.get(model, {}), set(flows), tokens, now_ns)

    def interactive_padded(self, model: str, now_ns: int) -> int:
        """Padded tokens of the interactive part of `model`'s last batch with
        interactive work, if that was within INTERACTIVE_QUIET_NS; else 0
        (`batch_fill_cap`: batch work alone fills whole budgets)."""
        at, padded = self.interactive.get(model, (0, 0))
        return padded if padded and now_ns - at < INTERACTIVE_QUIET_NS else 0

    def plan(self, lane: int, per_flow: dict[int, int]) -> Interjection | None:
        """The interjection rule of a batch whose interactive tokens are `per_flow`
        (client -> tokens); None for a batch of batch work alone."""
        if not per_flow:
            return None
        outer = frozenset(per_flow)
        return Interjection(lane, outer, max(per_flow.values()), self.last.get(lane, frozenset()) <= outer)

    def for_batch(self, lane: int, model: str, claims: list[Claim], tokens: int, shared: bool,
                  now_ns: Callable[[], int]) -> tuple[Interjection | None, bool]:
        """A batch of `claims` (`tokens` in all) that may let other clients run between
        its micro-batches: its interjection rule (`plan`), and whether its micro-batches
        are cut to the contended share (the model is `shared` and another current
        client sends shorter requests: `lighter`)."""
        per_flow: dict[int, int] = {}  # interactive tokens of the batch, client by client
        for c in claims:
            if not c.batch:
                per_flow[c.flow] = per_flow.get(c.flow, 0) + c.tokens
        return self.plan(lane, per_flow), shared and self.lighter(model, per_flow, tokens, now_ns())

    def served(self, lane: int, model: str, claims: list[Claim], at_ns: int) -> None:
        """A batch of `claims` ran on `lane` and was acked at `at_ns`: its clients were
        served, each with its fewest tokens an item; clients not seen for
        FLOW_QUIET_NS are forgotten."""
        interactive = [c for c in claims if not c.batch]
        self.last[lane] = frozenset(c.flow for c in interactive)
        if not interactive:
            return
        self.interactive[model] = (at_ns, padded_tokens([c.tokens for c in interactive]))
        seen, sizes = self.seen.setdefault(model, {}), self.fewest.setdefault(model, {})
        fewest: dict[int, int] = {}
        for c in interactive:
            fewest[c.flow] = min(c.tokens, fewest.get(c.flow, c.tokens))
        seen.update(dict.fromkeys(fewest, at_ns))
        sizes.update(fewest)
        if len(seen) > 1:
            for flow in [f for f, at in seen.items() if at_ns - at >= FLOW_QUIET_NS]:
                del seen[flow]
                sizes.pop(flow, None)


def other_first(queue, plan: Interjection, k: int) -> int | None:
    """Before micro-batch `k` of a batch with `plan`: does another client's
    interactive request run first? The number of this batch's clients' requests
    ahead of it in the lane (0: it is the head), or None. One lock-free read
    (`LocalQueue.first_other_flow`); before micro-batch 0 only with `again`."""
    if not (k or plan.again):
        return None
    other = queue.first_other_flow(plan.lane, plan.outer, INTERJECT_LOOK)
    return other[0] if other is not None and runs_first(other[2], plan.heaviest) else None


def claim_other(queue, worker: int, lease_ms: int, plan: Interjection, *, behind: int, budget: int, cap: int,
                max_items: int) -> list[Claim]:
    """Claim the other clients' interactive requests `other_first` found: the one
    `behind` requests of this batch's clients (those go back to their places),
    then, while the head is another client's, more of them up to `budget` tokens
    and `max_items`. Raced claims (another worker, an expiry changed the lane since
    it was read) go back at once."""
    claims: list[Claim] = []
    taken = 0
    if behind:
        got = queue.claim(plan.lane, worker=worker, max_items=behind + 1, max_tokens=1 << 40, lease_ms=lease_ms)
        if (len(got) == behind + 1 and all(c.flow in plan.outer for c in got[:-1]) and not got[-1].batch
                and got[-1].flow not in plan.outer):
            queue.return_items([c.item_id for c in got[:-1]])
            claims, taken = [got[-1]], got[-1].tokens
        elif got:
            queue.return_items([c.item_id for c in got])
    while len(claims) < max_items:
        head = queue.head_flow(plan.lane)
        if head is None or head[0] in plan.outer or (claims and taken + head[1] > budget):
            break
        got = queue.claim(plan.lane, worker=worker, max_items=1, max_tokens=cap, lease_ms=lease_ms)
        if not got:
            break
        if got[0].batch or got[0].flow in plan.outer:
            queue.return_items([got[0].item_id])
            break
        claims += got
        taken += got[0].tokens
    return claims
