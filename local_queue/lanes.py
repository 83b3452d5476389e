"""Lanes: one doubly linked list of QUEUED slots per model, sorted by (key, seq)
(protocol invariant 2 in `local_queue.queue`), and the done list. Every helper
whose name starts with `_` expects the caller to hold the queue lock."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

from .layout import (
    BATCH_SEQ, DONE, F_ATTEMPTS, F_ENQ, F_FLOW, F_GEN, F_KEY, F_LANE, F_NEXT, F_OWNER, F_PREV, F_RES, F_SEQ, F_STATE,
    F_TOKENS, GEN_MASK, H_DEPTH, H_DONE_COUNT, H_DONE_HEAD, H_DONE_TAIL, H_FREE_TOP, H_N_LANES, L_CLAIMED, L_DEPTH,
    L_HEAD, L_NAME_LEN, L_TAIL, L_TOKENS, L_VTIME, LF, NAME_BYTES, QUEUED, SF, SLOT_BITS, SLOT_MASK, STATUS_POISON,
    W_CLAIMED, WF, _HEAD, _LINK, _RESULT,
)
from .records import LaneStats, QueueFull
from .slab import NIL

#: Flows' finish times a producer keeps before it forgets those of idle flows.
FLOWS_KEPT = 4096


class Lanes:
    """Lane and done-list operations of LocalQueue."""

    def lane_id(self, model: str, *, create: bool = True) -> int:
        """Lane of `model`, created if needed. KeyError if absent and not create."""
        lane = self._lane_ids.get(model)
        if lane is not None:
            return lane
        raw = model.encode()
        if not 1 <= len(raw) <= NAME_BYTES:
            raise ValueError(f"lane name must be 1..{NAME_BYTES} bytes of utf-8, got {len(raw)}")
        with self._lock:
            self._refresh_lane_names()
            lane = self._lane_ids.get(model)
            if lane is None:
                if not create:
                    raise KeyError(model)
                lane = self._h[H_N_LANES]
                if lane >= self._max_lanes:
                    raise QueueFull(f"no lane left for {model!r} ({self._max_lanes} in use)")
                self._names[lane * NAME_BYTES:lane * NAME_BYTES + len(raw)] = raw
                self._L[lane * LF + L_NAME_LEN] = len(raw)
                self._h[H_N_LANES] = lane + 1  # commit: lanes are never removed
                self._lane_ids[model], self._lane_names[lane] = lane, model
        return lane

    def _refresh_lane_names(self) -> None:
        for lane in range(len(self._lane_names), self._h[H_N_LANES]):
            ln = self._L[lane * LF + L_NAME_LEN]
            model = bytes(self._names[lane * NAME_BYTES:lane * NAME_BYTES + ln]).decode()
            self._lane_ids[model], self._lane_names[lane] = lane, model

    def lane_name(self, lane: int) -> str:
        if lane not in self._lane_names:
            if not 0 <= lane < self._h[H_N_LANES]:
                raise ValueError(f"no lane {lane}")
            with self._lock:
                self._refresh_lane_names()
        return self._lane_names[lane]

    def _check_lane(self, lane: int) -> None:
        if not 0 <= lane < self._h[H_N_LANES]:
            raise ValueError(f"no lane {lane}")

    def lane_stats(self) -> list[LaneStats]:
        """Lanes with queued or claimed items, in lane order."""
        with self._lock:
            n = self._h[H_N_LANES]
            if len(self._lane_names) < n:
                self._refresh_lane_names()
            # Two strided column reads, then only the busy lanes' fields: a worker
            # asks before every batch, and numpy's fixed cost (~10 µs) is more
            # than this for the few lanes a box serves.
            L, S, names, out = self._L, self._S, self._lane_names, []
            depth, claimed = L[L_DEPTH:n * LF:LF].tolist(), L[L_CLAIMED:n * LF:LF].tolist()
            for lane in range(n):
                if depth[lane] or claimed[lane]:
                    b = lane * LF
                    head = L[b + L_HEAD]
                    if head == NIL:
                        out.append(LaneStats(lane, names[lane], 0, L[b + L_TOKENS], 0, claimed[lane]))
                    else:
                        out.append(LaneStats(lane, names[lane], depth[lane], L[b + L_TOKENS], S[head * SF + F_ENQ],
                                             claimed[lane], S[head * SF + F_SEQ] >= BATCH_SEQ))
            return out

    def head_flow(self, lane: int) -> tuple[int, int] | None:
        """(flow, tokens) of `lane`'s head item when it is interactive work, else None
        (an empty lane, or batch work at the head). Lock-free reads (hints, invariant 1):
        a worker asks between the micro-batches of a batch whether another client
        waits (`runtimes.worker`); a claim under the lock decides."""
        L, S = self._L, self._S
        if not L[lane * LF + L_DEPTH]:
            return None
        head = L[lane * LF + L_HEAD]
        if head == NIL or head >= self._nslots:
            return None
        b = head * SF
        if S[b + F_STATE] != QUEUED or S[b + F_SEQ] >= BATCH_SEQ:
            return None
        return S[b + F_FLOW], S[b + F_TOKENS]

    def first_other_flow(self, lane: int, flows: Collection[int], look: int) -> tuple[int, int, int] | None:
        """(place, flow, tokens) of `lane`'s first item whose flow is not in `flows`,
        when it is interactive work, among the first `look` items (place 0: the head),
        and every item ahead of it is interactive work of `flows`; else None.
        Lock-free reads, hints as `head_flow`'s (a claim under the lock decides):
        between micro-batches a worker asks whether another client waits behind the
        next requests of the clients whose batch runs (`runtimes.worker`)."""
        L, S, n = self._L, self._S, self._nslots
        s = L[lane * LF + L_HEAD] if L[lane * LF + L_DEPTH] else NIL
        for place in range(look):
            if s == NIL or not 0 <= s < n:
                return None
            b = s * SF
            if S[b + F_STATE] != QUEUED or S[b + F_SEQ] >= BATCH_SEQ:
                return None
            if (flow := S[b + F_FLOW]) not in flows:
                return place, flow, S[b + F_TOKENS]
            s = S[b + F_NEXT]
        return None

    def promote(self, item_ids: list[int]) -> int:
        """Queued batch items become interactive (a batch item waited past its bound:
        `daemon.broker`): each takes its lane's virtual time as its key, so it goes
        ahead of the interactive items not yet due, by put order among those of the
        same key (invariant 2). Ids of items no longer queued, or not batch work, are
        skipped. Returns how many moved."""
        S, L, nslots = self._S, self._L, self._nslots
        with self._lock:
            by_lane: dict[int, list[tuple[int, int, int, int]]] = {}
            for item_id in item_ids:
                s, gen = item_id & SLOT_MASK, (item_id >> SLOT_BITS) & GEN_MASK
                b = s * SF
                if s >= nslots or S[b + F_GEN] != gen or S[b + F_STATE] != QUEUED or S[b + F_SEQ] < BATCH_SEQ:
                    continue
                self._unlink(s)
                lane = S[b + F_LANE]
                S[b + F_SEQ] -= BATCH_SEQ
                S[b + F_KEY] = L[lane * LF + L_VTIME]
                by_lane.setdefault(lane, []).append((S[b + F_KEY], S[b + F_SEQ], s, S[b + F_TOKENS]))
            for lane, items in by_lane.items():
                items.sort()
                self._insert_sorted(lane, items)
            return sum(len(items) for items in by_lane.values())
    # -- slot helpers (caller holds the lock) ----------------------------------
    def _unlink(self, s: int) -> None:
        S, L, b = self._S, self._L, s * SF
        Lb = S[b + F_LANE] * LF
        n, p = S[b + F_NEXT], S[b + F_PREV]
        if p == NIL:
            L[Lb + L_HEAD] = n
        else:
            S[p * SF + F_NEXT] = n
        if n == NIL:
            L[Lb + L_TAIL] = p
        else:
            S[n * SF + F_PREV] = p
        L[Lb + L_DEPTH] -= 1
        L[Lb + L_TOKENS] -= S[b + F_TOKENS]
        self._h[H_DEPTH] -= 1

    def _push_free_slot(self, s: int) -> None:
        h = self._h
        self._stack[h[H_FREE_TOP]] = s
        h[H_FREE_TOP] += 1

    def _append_done(self, s: int) -> None:
        h, S = self._h, self._S
        S[s * SF + F_NEXT] = NIL
        tail = h[H_DONE_TAIL]
        if tail == NIL:
            h[H_DONE_HEAD] = s
        else:
            S[tail * SF + F_NEXT] = s
        h[H_DONE_TAIL] = s
        h[H_DONE_COUNT] += 1

    def _complete_empty(self, s: int, status: int) -> None:
        """QUEUED/CLAIMED (already unlinked and uncounted) -> DONE with an empty result."""
        S, b = self._S, s * SF
        _RESULT.pack_into(self._Sb, b * 8 + F_RES * 8, NIL, 0, NIL, status)
        S[b] = DONE  # commit
        self._free_data(s)
        self._append_done(s)

    def _insert_sorted(self, lane: int, items: list[tuple[int, int, int, int]]) -> None:
        """Insert QUEUED slots, given as (key, seq, slot, tokens) sorted, into `lane` at
        their (key, seq) positions: one merge pass from the head (returns land near it)."""
        S, Sb, L, Lb, link = self._S, self._Sb, self._L, lane * LF, _LINK.pack_into
        prev, cur = NIL, L[Lb + L_HEAD]
        at = (S[cur * SF + F_KEY], S[cur * SF + F_SEQ]) if cur != NIL else (0, 0)
        ntok = 0
        before_cur = False  # items were inserted in front of cur: its PREV is stale
        for key, sq, s, t in items:
            while cur != NIL and at < (key, sq):
                if before_cur:
                    S[cur * SF + F_PREV] = prev
                    before_cur = False
                prev, cur = cur, S[cur * SF + F_NEXT]
                at = (S[cur * SF + F_KEY], S[cur * SF + F_SEQ]) if cur != NIL else (0, 0)
            link(Sb, s * SF * 8 + F_NEXT * 8, cur, prev)
            if prev == NIL:
                L[Lb + L_HEAD] = s
            else:
                S[prev * SF + F_NEXT] = s
            prev = s
            before_cur = True
            ntok += t
        if cur == NIL:
            if items:
                L[Lb + L_TAIL] = prev
        elif before_cur:
            S[cur * SF + F_PREV] = prev
        L[Lb + L_DEPTH] += len(items)
        L[Lb + L_TOKENS] += ntok
        self._h[H_DEPTH] += len(items)

    def _insert_from_tail(self, lane: int, items: list[tuple[int, int, int, int]]) -> None:
        """`_insert_sorted` walking from the tail: for puts, whose keys are the largest
        of their flow and land near the tail unless their flow was idle."""
        S, Sb, L, Lb, link = self._S, self._Sb, self._L, lane * LF, _LINK.pack_into
        nxt, cur = NIL, L[Lb + L_TAIL]
        ntok = 0
        for key, sq, s, t in reversed(items):
            while cur != NIL and (S[cur * SF + F_KEY], S[cur * SF + F_SEQ]) > (key, sq):
                nxt, cur = cur, S[cur * SF + F_PREV]
            link(Sb, s * SF * 8 + F_NEXT * 8, nxt, cur)  # s goes between cur and nxt
            if nxt == NIL:
                L[Lb + L_TAIL] = s
            else:
                S[nxt * SF + F_PREV] = s
            if cur == NIL:
                L[Lb + L_HEAD] = s
            else:
                S[cur * SF + F_NEXT] = s
            nxt = s
            ntok += t
        L[Lb + L_DEPTH] += len(items)
        L[Lb + L_TOKENS] += ntok
        self._h[H_DEPTH] += len(items)

    def _fair_keys(self, lane: int, flow: int, tokens: list[int]) -> list[int]:
        """Keys of interactive puts of `flow` into `lane` (invariant 2; start-time fair
        queueing): each item starts at its flow's finish time or at the lane's virtual
        time, whichever is later, and its flow then finishes `tokens` (at least 1)
        later. An idle flow (its finish time passed) starts at the lane's virtual time."""
        vtime = self._L[lane * LF + L_VTIME]
        flows = self._flows
        key = max(vtime, flows.get((lane, flow), 0))
        if len(tokens) == 1:  # the common put: one request
            t = tokens[0]
            flows[(lane, flow)] = key + (t if t > 0 else 1)
            if len(flows) > FLOWS_KEPT:
                self._forget_idle_flows()
            return [key]
        keys = []
        for t in tokens:
            keys.append(key)
            key += t if t > 0 else 1
        flows[(lane, flow)] = key
        if len(flows) > FLOWS_KEPT:
            self._forget_idle_flows()
        return keys

    def _forget_idle_flows(self) -> None:
        """Drop the finish times the lanes' virtual times have passed: such a flow's
        next item starts at the virtual time whether it is kept or not."""
        L = self._L
        self._flows = {k: f for k, f in self._flows.items() if f > L[k[0] * LF + L_VTIME]}

    def _requeue(self, recs: list[tuple[int, int, int, int, int, int]], *, bump: bool,
                 max_attempts: int) -> tuple[int, int]:
        """CLAIMED slots, as (key, seq, slot, lane, owner, tokens), back to their lanes
        (attempts += 1 if bump; poison at max_attempts). Returns (requeued, poisoned)."""
        S = self._S
        recs.sort()
        by_lane: dict[int, list[tuple[int, int, int, int]]] = {}
        poisoned = 0
        for key, sq, s, lane, _, t in recs:
            b = s * SF
            if bump:
                S[b + F_ATTEMPTS] += 1
                if S[b + F_ATTEMPTS] >= max_attempts:
                    self._complete_empty(s, STATUS_POISON)
                    poisoned += 1
                    continue
            S[b] = QUEUED  # commit (F_OWNER only means something while CLAIMED)
            by_lane.setdefault(lane, []).append((key, sq, s, t))
        self._drop_claimed(Counter(r[3] for r in recs), Counter(r[4] for r in recs))
        for lane, group in by_lane.items():
            self._insert_sorted(lane, group)
        return len(recs) - poisoned, poisoned

    def _requeue_recs(self, slots: list[int]) -> list[tuple[int, int, int, int, int, int]]:
        S, Sb, unpack, out = self._S, self._Sb, _HEAD.unpack_from, []
        for s in slots:
            r = unpack(Sb, s * SF * 8)
            out.append((S[s * SF + F_KEY], r[F_SEQ], s, r[F_LANE], r[F_OWNER], r[F_TOKENS]))
        return out

    def _drop_claimed(self, lanes: dict[int, int], owners: dict[int, int]) -> None:
        L, W = self._L, self._W
        for lane, n in lanes.items():
            L[lane * LF + L_CLAIMED] -= n
        for wid, n in owners.items():
            w = self._worker_index(wid)
            if w is not None:
                W[w * WF + W_CLAIMED] -= n
