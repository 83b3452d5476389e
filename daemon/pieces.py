"""A large request as pieces: queue items of about one batch's work each, run one
behind another, so other requests are taken between them (issue 25).

One request of 2 048 long texts was one queue item: a worker took it and ran its
micro-batches to the end (~100 s on a CPU), long past its deadline, while every
request behind it waited. Now:

1. `costs` (per input, the tokens the model reads: ~4 characters a token plus
   two special tokens, at most the model's `max_seq_len` when it cuts) are
   summed; past `max_request_tokens` the request is refused at once
   (`check_ceiling`, 413 naming the setting).
2. A request over one piece's budget (`Sizing.budget`) is cut into pieces of
   consecutive inputs (`next_cut`), each its own queue item in the request's
   flow (daemon.clients): at most `window` pieces (one per worker) are queued
   or running at once, the next one cut and queued when one is answered
   (`run_pieces`). A request that arrives meanwhile, from any client, is
   queued before that next piece (local_queue invariant 2), so it waits for
   the pieces running, not for the rest of the big request.
3. A piece holds what the model's workers process in PIECE_SHARE of the batch
   time they aim for (`batch_target_ms`), at the rate of the model's answers
   (every request's, pieces or not: batch tokens over inference time,
   smoothed); a request is cut when it holds more than WHOLE_SHARE of a batch
   time of work (`Sizing.whole`). Before any answer of the model, INITIAL_PIECE_TOKENS
   stand for a batch, for both (the cut was at one batch then: a cold start's
   burst of twelve 32-text requests all ran as pieces, processor sharing, and
   answered together 8 s later; CI saw none answered inside test_shutdown's
   drain). A request that comes meanwhile waits for one piece at most.
4. The first piece that fails fails the request, once: the pieces still queued
   or running are cancelled (their queue items withdrawn; a running one stops
   at its next micro-batch, `Adapter.wanted`) and no piece is answered again.
   The request's deadline is the pieces' deadline.
5. The deadline sizes the ceiling too (`check_deadline`): a request its model
   cannot read within its `timeout_ms` at the rate its batches of a piece's size
   or more ran on this box (`Sizing.piece_rate`: smoothed, times the workers
   that take pieces at once) is refused at once, 413 naming the rate, the time
   it needs and the most tokens that fit; before any such batch ran the rate is
   unknown and the request runs, and a timeout then says how long the whole
   would have needed at the rate its answered pieces ran. (1 150 texts of 256
   tokens, under `max_request_tokens`, need ~40-140 s of a 2-vCPU box's MiniLM:
   past the default 30 s, they were a 504 after 30 s of work.)

The pieces' answers come back in input order; the task's function joins their
results (daemon.tasks).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from fleet.errors import BadRequest, FleetError, InputTooLong, PayloadTooLarge, Timeout

from fleet.daemon.broker import Answer

#: Tokens of one batch's work before any answer of the model said how fast it goes (a CPU
#: reads ~1 000-5 000 tokens/s of a small encoder, a GPU far more: the first answer sizes the rest).
INITIAL_PIECE_TOKENS = 1024
#: A piece holds at least this many tokens (and at least one input), whatever the rate says.
MIN_PIECE_TOKENS = 128
#: A piece aims for this share of `batch_target_ms`: what workers aim a batch for
#: while several clients share a model (runtimes.policy.CONTENDED_SHARE).
PIECE_SHARE = 0.25
#: A request of more than this share of `batch_target_ms` is cut (8 x 250 ms: two
#: seconds of work). Pieces of one client's requests interleave in its flow, so
#: cutting mid-size requests turns their order into processor sharing: twelve
#: concurrent 32-text requests all finished at the end instead of one by one
#: (tests/test_shutdown.py: none finished inside the 2 s drain). Below this a
#: request runs whole; anything bigger still runs as PIECE_SHARE pieces.
WHOLE_SHARE = 8.0
#: Weight of the newest piece's rate in a model's smoothed rate.
RATE_WEIGHT = 0.3


def check_ceiling(model: str, total: int, limit: int, what: str = "inputs") -> None:
    """`max_request_tokens`: a request whose inputs the model would read as more tokens
    than `limit` is refused before anything is queued."""
    if limit > 0 and total > limit:
        raise PayloadTooLarge(
            f"the {what} of this request come to about {total} tokens as {model} reads them; "
            f"max_request_tokens is {limit} per request: send them in several requests",
            hint="raise max_request_tokens in config.toml (FLEET_MAX_REQUEST_TOKENS) to allow more")


def check_deadline(model: str, total: int, timeout_s: float, per_s: float | None, rate: str = "") -> None:
    """The ceiling the deadline sets (module doc, 5): `total` tokens at `per_s` tokens a
    second (`rate` in words; None: not measured yet, the request runs) within `timeout_s`."""
    if per_s and total > per_s * timeout_s:
        raise PayloadTooLarge(
            f"the inputs of this request come to about {total} tokens as {model} reads them; at the rate it "
            f"runs here ({rate}) they need about {seconds(total / per_s)} s, more than the request's timeout_ms of "
            f"{timeout_s * 1000:.0f}: send at most about {int(per_s * timeout_s)} tokens per request, "
            "or a larger timeout_ms",
            hint="timeout_ms may be set per request (at most 600000) or in config.toml")


def seconds(s: float) -> str:
    return f"{s:.0f}" if s >= 10 else f"{s:.1f}"


def text_costs(lengths: np.ndarray, cap: int | None) -> np.ndarray:
    """Tokens the model reads per text of `lengths` characters: ~4 characters a token
    plus two special tokens, at most `cap` (the model's max_seq_len, when it cuts)."""
    costs = lengths // 4 + 2
    return np.minimum(costs, cap) if cap else costs


def next_cut(cum: np.ndarray, start: int, budget: int) -> int:
    """End (exclusive) of the piece from input `start`: as many inputs as fit `budget`
    tokens by the cumulative costs `cum`, at least one."""
    before = int(cum[start - 1]) if start else 0
    end = int(np.searchsorted(cum, before + budget, side="right"))
    return max(end, start + 1)


@dataclass
class Sizing:
    """How many tokens a piece of each model holds (module doc, 3)."""

    target_ms: float
    #: Pieces of one request queued or running at once: one per worker of this box.
    window: int = 1
    #: Model (lane) -> tokens per ms its workers processed in the batches its pieces ran in.
    rates: dict[str, float] = field(default_factory=dict)
    #: The same, over batches of MIN_PIECE_TOKENS or more only: the rate a large request's
    #: pieces run at (short requests' batches read far fewer tokens per ms).
    piece_rates: dict[str, float] = field(default_factory=dict)

    def budget(self, lane: str, most: int) -> int:
        """Tokens a piece of a request for `lane` holds (at most `most`)."""
        rate = self.rates.get(lane)
        if rate is None:
            return min(int(INITIAL_PIECE_TOKENS * PIECE_SHARE), most)
        return int(min(most, max(MIN_PIECE_TOKENS, rate * self.target_ms * PIECE_SHARE)))

    def whole(self, lane: str, most: int) -> int:
        """Tokens a request for `lane` may have and still run as one item: WHOLE_SHARE of
        a batch's work (a request of two pieces or less is not cut: each of its
        pieces would wait for the pieces running when it comes)."""
        rate = self.rates.get(lane)
        if rate is None:  # the same rule, INITIAL_PIECE_TOKENS a batch
            return min(int(INITIAL_PIECE_TOKENS * WHOLE_SHARE), most)
        return int(min(most, max(MIN_PIECE_TOKENS, rate * self.target_ms * WHOLE_SHARE)))

    def piece_rate(self, lane: str) -> tuple[float | None, str]:
        """(tokens a second a large request of `lane` is read at, that in words): `piece_rates`
        times the pieces run at once; (None, "") before a batch of a piece's size ran."""
        rate = self.piece_rates.get(lane)
        if rate is None:
            return None, ""
        per_s = rate * 1000.0 * self.window
        return per_s, f"about {per_s:.0f} tokens/s" + (f" over {self.window} workers" if self.window > 1 else "")

    def observe(self, lane: str, answer: Answer) -> None:
        """Learn `lane`'s rate from an answer's batch, in the estimate pieces are cut by
        (`Answer.batch_estimate`, as `text_costs`), not in the tokenizer's tokens."""
        size = answer.batch_estimate
        if answer.inference_ms <= 0 or size <= 0:
            return
        rate = size / answer.inference_ms
        for rates, counts in ((self.rates, True), (self.piece_rates, size >= MIN_PIECE_TOKENS)):
            if counts:
                old = rates.get(lane)
                rates[lane] = rate if old is None else old + RATE_WEIGHT * (rate - old)


async def run_pieces(model: str, cum: np.ndarray, payload_of: Callable[[int, int], bytes],
                     send: Callable[[bytes, int, float], Awaitable[Answer]], *, budget: Callable[[], int],
                     window: int, timeout_s: float) -> list[tuple[int, Answer]]:
    """Run a request as pieces (module doc, 2 and 4): `send(payload, tokens, timeout_s)`
    queues one piece and waits for its answer; `payload_of(a, b)` is the request of
    inputs a..b. Returns (first input, answer) per piece in input order, or raises
    the first failure (an input it names is numbered in the whole request)."""
    n = len(cum)
    started = time.monotonic()
    deadline = started + timeout_s
    spans: dict[asyncio.Future, tuple[int, int]] = {}
    answers: list[tuple[int, Answer]] = []
    start = done_inputs = done_tokens = 0
    try:
        while start < n or spans:
            while start < n and len(spans) < window:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                end = next_cut(cum, start, budget())
                tokens = int(cum[end - 1]) - (int(cum[start - 1]) if start else 0)
                spans[asyncio.ensure_future(send(payload_of(start, end), tokens, left))] = (start, end)
                start = end
            finished, _ = await asyncio.wait(spans, return_when=asyncio.FIRST_COMPLETED)
            failed = None
            for fut in finished:
                a, b = spans.pop(fut)
                if fut.exception() is not None:
                    failed = failed or in_request(fut.exception(), a)
                    continue
                answers.append((a, fut.result()))
                done_inputs += b - a
                done_tokens += int(cum[b - 1]) - (int(cum[a - 1]) if a else 0)
            if failed is not None:
                raise failed
    except (Timeout, TimeoutError):
        # How long the whole would take at the rate its answered inputs came (module doc, 5),
        # said when that is past the deadline (not when the time went to waiting in the queue).
        whole_s = (time.monotonic() - started) * int(cum[-1]) / done_tokens if done_tokens else 0.0
        whole = (f"; at the rate they were answered the whole request needs about {seconds(whole_s)} s: send "
                 "fewer inputs per request, or a larger timeout_ms") if whole_s > timeout_s else ""
        raise Timeout(f"{model}: no answer within {timeout_s * 1000:.0f} ms "
                      f"({done_inputs} of {n} inputs were answered){whole}") from None
    finally:
        for fut in spans:  # a failure or the client gone: withdraw the rest (broker.run cancels their items)
            fut.cancel()
        if spans:
            await asyncio.gather(*spans, return_exceptions=True)
    answers.sort(key=lambda x: x[0])
    return answers


#: How a worker's error names an input: by its index in the request it ran.
_INPUT_INDEX = re.compile(r"\b(input|document) (\d+)")


def in_request(exc: BaseException, first: int) -> BaseException:
    """A piece's error, with the input it names numbered as in the whole request
    (the piece starts at input `first`)."""
    if not first or not isinstance(exc, FleetError) or exc.__class__ not in RENUMBERED:
        return exc
    message = _INPUT_INDEX.sub(lambda m: f"{m[1]} {int(m[2]) + first}", exc.message, count=1)
    return exc if message == exc.message else exc.__class__(message, hint=exc.hint, param=exc.param)


#: The refusals of one input a worker gives (`runtimes.adapters.batching.input_too_long`, images).
RENUMBERED = (BadRequest, InputTooLong, PayloadTooLarge)


def joined(answers: list[Answer], body: object) -> Answer:
    """One answer for a request run as pieces: `body` (their joined results), the sums
    of their queue and inference times, the largest batch one ran in, every worker
    that ran one and every LoRA adapter mixed in."""
    served = ",".join(dict.fromkeys(a.served_by for a in answers))
    return Answer(body, sum(a.queue_ms for a in answers), sum(a.inference_ms for a in answers), served,  # type: ignore[arg-type]
                  max(a.batch_items for a in answers), max(a.batch_tokens for a in answers),
                  tuple(sorted({lora for a in answers for lora in a.loras})),
                  max(a.batch_estimate for a in answers), pieces=len(answers))
