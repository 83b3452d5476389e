"""daemon.pieces and daemon.clients: how a large request is cut and run as pieces, and
who a request comes from. Pure functions with tables; `run_pieces` with a fake
`send` on a real event loop (the queue and workers are exercised end to end in
test_fair_admission.py)."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

from fleet.daemon.broker import Answer
from fleet.daemon.clients import client_of, flow_of
from fleet.daemon.pieces import (
    INITIAL_PIECE_TOKENS, MIN_PIECE_TOKENS, Sizing, check_ceiling, check_deadline, in_request, joined, next_cut,
    run_pieces, text_costs, WHOLE_SHARE,
)
from fleet.errors import BadRequest, InputTooLong, Overloaded, PayloadTooLarge, Timeout


@pytest.mark.parametrize("costs, start, budget, end", [
    ([5, 5, 5, 100, 5], 0, 12, 2),  # as many as fit
    ([5, 5, 5, 100, 5], 0, 15, 3),  # exactly full
    ([5, 5, 5, 100, 5], 3, 50, 4),  # one over budget still goes, alone
    ([5, 5, 5, 100, 5], 4, 1000, 5),  # the rest
    ([5], 0, 1, 1),
])
def test_a_piece_holds_what_fits_its_budget_and_at_least_one_input(costs, start, budget, end):
    assert next_cut(np.cumsum(costs), start, budget) == end


def test_text_costs_count_what_the_model_reads():
    lengths = np.array([0, 8, 400, 4000])
    assert text_costs(lengths, None).tolist() == [2, 4, 102, 1002]
    assert text_costs(lengths, 256).tolist() == [2, 4, 102, 256]  # cut at the model's max_seq_len


def test_the_ceiling_names_the_setting_and_its_value():
    check_ceiling("m", 300_000, 300_000)
    check_ceiling("m", 10**9, 0)  # 0: no bound
    with pytest.raises(PayloadTooLarge) as err:
        check_ceiling("m", 300_001, 300_000)
    assert "max_request_tokens is 300000" in err.value.message and "300001" in err.value.message
    assert err.value.code == "payload_too_large" and err.value.status == 413


def answer(tokens: int, ms: float, served: str = "box/0", items: int = 1, read: int | None = None) -> Answer:
    """An answer whose batch was `tokens` in the daemon's estimate (what pieces are sized
    by) and `read` tokenizer tokens (X-Batch-Tokens; default: the same)."""
    return Answer(None, 1.0, ms, served, items, tokens if read is None else read, (), tokens)  # type: ignore[arg-type]


def test_pieces_and_whole_requests_are_sized_by_the_models_answers():
    s = Sizing(target_ms=1000.0)
    # Nothing answered yet: INITIAL_PIECE_TOKENS stand for a batch, a piece is a quarter,
    # a request is cut past WHOLE_SHARE batches, as once answers came.
    assert (s.whole("m", 16384), s.budget("m", 16384)) == (INITIAL_PIECE_TOKENS * WHOLE_SHARE,
                                                          INITIAL_PIECE_TOKENS // 4)
    assert s.budget("m", 100) == 100
    # 2 tokens/ms: 2 000 tokens a batch, 500 a piece, cut past 8 batches; in the estimate
    # pieces are cut by, whatever the tokenizer counted.
    s.observe("m", answer(2000, 1000.0, read=700))
    assert (s.whole("m", 16384), s.budget("m", 16384)) == (int(2000 * WHOLE_SHARE), 500)
    s.observe("m", answer(20000, 1000.0))  # smoothed towards 20 tokens/ms
    assert 500 < s.budget("m", 16384) < 5000
    s.observe("m", answer(0, 0.0))  # an answer without a batch (an error) changes nothing
    s.rates["m"] = 0.01
    assert s.budget("m", 16384) == s.whole("m", 16384) == MIN_PIECE_TOKENS
    s.rates["m"] = 1e6
    assert s.budget("m", 16384) == 16384  # a GPU: a piece is the profile's whole batch


def test_the_deadline_sizes_the_ceiling_at_the_rate_large_requests_run():
    s = Sizing(target_ms=250.0, window=2)
    s.observe("m", answer(MIN_PIECE_TOKENS - 1, 100.0))  # a short request's batch: not a piece's rate
    assert s.piece_rate("m") == (None, "")
    check_deadline("m", 10**9, 30.0, *s.piece_rate("m"))  # not measured yet: the request runs
    s.observe("m", answer(1000, 100.0))  # 10 tokens/ms on each of 2 workers: 20 000 tokens/s
    per_s, words = s.piece_rate("m")
    assert per_s == 20_000 and words == "about 20000 tokens/s over 2 workers"
    check_deadline("m", 600_000, 30.0, per_s, words)  # just fits 30 s
    with pytest.raises(PayloadTooLarge) as err:
        check_deadline("m", 600_001, 30.0, per_s, words)
    message = err.value.message
    assert "600001 tokens" in message and "about 20000 tokens/s over 2 workers" in message
    assert "need about 30 s, more than the request's timeout_ms of 30000" in message
    assert "at most about 600000 tokens per request" in message and err.value.status == 413


def test_a_timeout_says_how_long_the_whole_request_needs():
    async def send(payload: bytes, tokens: int, left_s: float) -> Answer:
        await asyncio.wait_for(asyncio.sleep(0.05), left_s)  # 0.05 s a piece: 20 of 50 tokens in 0.12 s
        return answer(tokens, 50.0)

    with pytest.raises(Timeout) as err:
        joined_run(10, 1, send, timeout_s=0.12)
    assert re.fullmatch(r"m: no answer within 120 ms \([1-4] of 10 inputs were answered\); at the rate they were "
                        r"answered the whole request needs about 0\.\d s: send fewer inputs per request, or a larger "
                        r"timeout_ms", err.value.message), err.value.message


def test_an_error_naming_an_input_is_numbered_in_the_whole_request():
    e = in_request(InputTooLong("input 3 has 300 tokens; m takes at most 256 tokens"), 10)
    assert isinstance(e, InputTooLong) and e.message.startswith("input 13 has 300 tokens")
    assert in_request(BadRequest("query + document 2 has 9 tokens"), 5).message == "query + document 7 has 9 tokens"
    same = Overloaded("input 3 of the queue")  # not a refusal of one input: unchanged
    assert in_request(same, 10) is same
    first = InputTooLong("input 3 has 300 tokens")
    assert in_request(first, 0) is first


def joined_run(n: int, window: int, send, budget: int = 10, timeout_s: float = 5.0):
    cum = np.cumsum([5] * n)
    return asyncio.run(run_pieces("m", cum, lambda a, b: f"{a}:{b}".encode(), send, budget=lambda: budget,
                                  window=window, timeout_s=timeout_s))


def test_pieces_queue_behind_one_another_within_the_window_and_answer_in_input_order():
    running, most, sent = set(), [0], []

    async def send(payload: bytes, tokens: int, left_s: float) -> Answer:
        running.add(payload)
        most[0] = max(most[0], len(running))
        sent.append((payload.decode(), tokens))
        await asyncio.sleep(0.01 if payload == b"0:2" else 0.001)  # the first piece is the slowest
        running.discard(payload)
        return answer(tokens, 1.0, served=payload.decode())

    got = joined_run(7, 2, send)
    assert [(a, ans.served_by) for a, ans in got] == [(0, "0:2"), (2, "2:4"), (4, "4:6"), (6, "6:7")]
    assert most[0] == 2 and sent[0] == ("0:2", 10) and sent[-1] == ("6:7", 5)
    one = joined([a for _, a in got], None)
    assert (one.pieces, one.batch_tokens, one.inference_ms, one.served_by) == (4, 10, 4.0, "0:2,2:4,4:6,6:7")


def test_the_first_failure_fails_the_request_once_and_withdraws_the_other_pieces():
    started, cancelled = [], []

    async def send(payload: bytes, tokens: int, left_s: float) -> Answer:
        started.append(payload)
        try:
            if payload == b"2:4":
                raise InputTooLong("input 1 has 300 tokens")
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(payload)
            raise
        return answer(tokens, 1.0)

    with pytest.raises(InputTooLong) as err:
        joined_run(20, 3, send)
    assert err.value.message.startswith("input 3 ")  # numbered in the request
    assert started == [b"0:2", b"2:4", b"4:6"] and sorted(cancelled) == [b"0:2", b"4:6"]


def test_the_requests_deadline_is_its_pieces_deadline():
    lefts = []

    async def send(payload: bytes, tokens: int, left_s: float) -> Answer:
        lefts.append(left_s)
        if payload == b"4:6":  # what the broker raises when a piece's time runs out
            raise Timeout("m: no answer within 123 ms")
        return answer(tokens, 1.0)

    with pytest.raises(Timeout) as err:
        joined_run(10, 1, send, timeout_s=0.5)
    # Said once, for the request: its own timeout and how far it got.
    assert err.value.message == "m: no answer within 500 ms (4 of 10 inputs were answered)"
    assert len(lefts) == 3 and lefts == sorted(lefts, reverse=True) and lefts[0] <= 0.5


@pytest.mark.parametrize("peer, headers, client", [
    (("127.0.0.1", 5000), [(b"x-fleet-client", b"tenant-a")], "name:tenant-a"),
    (("::1", 5000), [(b"x-fleet-client", b"app/1@box")], "name:app/1@box"),
    (("127.0.0.1", 5001), [], "addr:127.0.0.1"),  # one client for every loopback caller without a name
    (("127.0.0.1", 5001), [(b"x-fleet-client", b"bad name!")], "addr:127.0.0.1"),  # not a plain name
    (("10.0.0.7", 5000), [(b"x-fleet-client", b"tenant-a")], "addr:10.0.0.7"),  # remote: its address
    (None, [(b"x-fleet-client", b"sock")], "name:sock"),  # a Unix socket
])
def test_who_a_request_comes_from(peer, headers, client):
    assert client_of({"client": peer, "headers": headers}) == client
    assert flow_of(client) == flow_of(client) != 0
