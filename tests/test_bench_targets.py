"""What the bench puts on the wire per target, and how it reads replies (incl. chunked ones)."""

from __future__ import annotations

import asyncio
import math
import time

import msgspec
import pytest

from fleet.bench import corpus, httpclient
from fleet.bench.st_local import LocalTarget, STSetup, local_batches, local_target
from fleet.bench.targets import build_payloads, reply_tokens, request_windows
from fleet.bench.tokens import TokenCounter

TEXTS = corpus.load()


@pytest.fixture(scope="module")
def lengths() -> list[int]:
    return TokenCounter.for_default_model().count(TEXTS)


def split(request: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = request.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert int(headers["Content-Length"]) == len(body)
    return lines[0], headers, body


def test_corpus_is_varied_and_within_token_bounds(lengths):
    assert len(TEXTS) == len(set(TEXTS)) >= 300
    assert min(lengths) >= corpus.MIN_TOKENS and max(lengths) <= corpus.MAX_TOKENS
    # Short and long texts both present, not one length repeated.
    assert sum(n < 20 for n in lengths) > 50 and sum(n > 60 for n in lengths) > 50


def test_token_counts_include_special_tokens():
    counter = TokenCounter.for_default_model()
    # [CLS] hello world [SEP]
    assert counter.count(["hello world", "a b c"]) == [4, 5]


def test_windows_cycle_through_the_whole_corpus():
    windows = request_windows(len(TEXTS), 32, pool_size=len(TEXTS) // 32 + 1)
    seen = {i for w in windows for i in w}
    assert seen == set(range(len(TEXTS)))
    assert all(len(w) == 32 for w in windows)
    assert request_windows(len(TEXTS), 32) == request_windows(len(TEXTS), 32)  # same for every target


def test_sorted_batches_hold_every_text_once_shortest_first(lengths):
    setup = STSetup("unused", "fp32", "cpu", TEXTS, lengths, 32, sorted=True)
    batches, tokens = local_batches(setup)
    assert sorted(t for b in batches for t in b) == sorted(TEXTS)
    assert [len(b) for b in batches[:-1]] == [32] * (len(batches) - 1) and 0 < len(batches[-1]) <= 32
    order = [lengths[TEXTS.index(t)] for b in batches for t in b]
    assert order == sorted(order) and sum(tokens) == sum(lengths)
    # Sorting is what cuts padding: the padded size of a sorted batch is its longest text.
    padded = sum(max(lengths[TEXTS.index(t)] for t in b) * len(b) for b in batches)
    windows, _ = local_batches(STSetup("unused", "fp32", "cpu", TEXTS, lengths, 32))
    assert windows == [[TEXTS[i] for i in w] for w in request_windows(len(TEXTS), 32)]
    window_padded = sum(max(lengths[TEXTS.index(t)] for t in b) * len(b) for b in windows[:len(batches)])
    assert padded < 0.8 * window_padded


def test_in_process_names_resolve_per_machine():
    bf16, avx2 = {"avx512f", "avx512_bf16"}, {"avx2"}
    assert local_target("st-best", flags=bf16, openvino=False) == LocalTarget(
        "st-bf16", "torch", "bf16", note="st-best is st-bf16 (native bf16 on this CPU)")
    assert local_target("st-best", flags=avx2, openvino=False).name == "st-fp32"
    assert local_target("st-fp32", flags=bf16, openvino=False) == LocalTarget("st-fp32", "torch", "fp32")
    assert local_target("ov-best", flags={"amx_bf16"}, openvino=True) == LocalTarget(
        "ov-bf16", "openvino", "bf16", note="ov-best is ov-bf16 (native bf16 on this CPU)")
    # The offline limit runs the best engine there is, sorted.
    assert local_target("sorted", flags=bf16, openvino=True).name == "sorted-ov-bf16"
    lim = local_target("sorted", flags=avx2, openvino=False)
    assert (lim.name, lim.engine, lim.dtype, lim.sorted) == ("sorted-st-fp32", "torch", "fp32", True)
    assert "openvino is not installed" in lim.note
    assert local_target("sorted-st-bf16", flags=avx2, openvino=False) == LocalTarget("sorted-st-bf16", "torch", "bf16", True)
    # A runtime that is not installed is a line saying so; an unknown name is None.
    assert local_target("ov-fp32", flags=bf16, openvino=False) == (
        "ov-fp32: skipped: openvino is not installed (pip install 'fleet-serve[openvino]')")
    assert isinstance(local_target("sorted-ov-best", flags=bf16, openvino=False), str)
    for name in ("st-fp16", "ov", "sorted-fleet", "fleet", "sorted-sorted"):
        assert local_target(name, flags=bf16, openvino=True) is None, name


def test_fleet_embed_request_is_msgpack(lengths):
    p = build_payloads("fleet", "embed", "http://127.0.0.1:7744", "m1", TEXTS, lengths, 4, pool_size=3)[1]
    line, headers, body = split(p.request)
    assert line == "POST /v1/embed HTTP/1.1"
    assert headers["Content-Type"] == headers["Accept"] == "application/msgpack"
    doc = msgspec.msgpack.decode(body)
    assert doc["model"] == "m1" and len(doc["inputs"]) == 4 and p.inputs == 4
    assert p.tokens == sum(lengths[TEXTS.index(t)] for t in doc["inputs"])


def test_fleet_rerank_request_counts_query_per_document(lengths):
    p = build_payloads("fleet", "rerank", "http://127.0.0.1:7744", "rr", TEXTS, lengths, 3, pool_size=2)[0]
    line, _, body = split(p.request)
    assert line == "POST /v1/rerank HTTP/1.1"
    doc = msgspec.msgpack.decode(body)
    q = lengths[TEXTS.index(doc["query"])]
    assert p.tokens == sum(lengths[TEXTS.index(d)] for d in doc["documents"]) + 3 * q


def test_openai_and_infinity_requests(lengths):
    p = build_payloads("openai", "embed", "http://127.0.0.1:8000", "m", TEXTS, lengths, 2, pool_size=1)[0]
    line, headers, body = split(p.request)
    assert line == "POST /v1/embeddings HTTP/1.1" and headers["Content-Type"] == "application/json"
    doc = msgspec.json.decode(body)
    assert doc["encoding_format"] == "base64" and len(doc["input"]) == 2
    p = build_payloads("infinity", "embed", "http://127.0.0.1:7997", "m", TEXTS, lengths, 2, pool_size=1,
                       encoding="float", api_key="k")[0]
    line, headers, body = split(p.request)
    assert line == "POST /embeddings HTTP/1.1" and headers["Authorization"] == "Bearer k"
    assert msgspec.json.decode(body)["encoding_format"] == "float"
    # A URL with a path is used as given.
    p = build_payloads("openai", "embed", "http://127.0.0.1:8000/custom/emb", "m", TEXTS, lengths, 1, pool_size=1)[0]
    assert split(p.request)[0] == "POST /custom/emb HTTP/1.1"


def test_generate_requests_use_the_completions_route(lengths):
    p = build_payloads("fleet", "generate", "http://127.0.0.1:7744", "g", TEXTS, lengths, 1, pool_size=1)[0]
    line, headers, body = split(p.request)
    assert line == "POST /v1/completions HTTP/1.1" and headers["Content-Type"] == "application/json"
    doc = msgspec.json.decode(body)
    assert doc["prompt"] in TEXTS and doc["max_tokens"] == 16


def test_unsupported_combinations_are_refused(lengths):
    with pytest.raises(ValueError, match="rerank"):
        build_payloads("openai", "rerank", "http://127.0.0.1:1", "m", TEXTS, lengths, 1, pool_size=1)
    with pytest.raises(ValueError, match="only http"):
        build_payloads("fleet", "embed", "https://127.0.0.1:1", "m", TEXTS, lengths, 1, pool_size=1)


def test_reply_tokens_reads_usage_only():
    fleet = msgspec.msgpack.encode({"model": "m", "embeddings": b"\0" * 3072, "shape": [2, 384],
                                    "usage": {"input_tokens": 9}})
    assert reply_tokens("fleet", "embed", fleet) == 9
    openai = msgspec.json.encode({"data": [], "model": "m", "usage": {"prompt_tokens": 7, "total_tokens": 7}})
    assert reply_tokens("openai", "embed", openai) == 7
    gen = msgspec.json.encode({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 16}})
    assert reply_tokens("openai", "generate", gen) == 16
    assert reply_tokens("fleet", "generate", gen) == 16  # fleet generation is benched over JSON completions
    assert reply_tokens("openai", "embed", b'{"data": []}') == -1
    with pytest.raises(msgspec.DecodeError):
        reply_tokens("fleet", "embed", b"not msgpack at all \xc1")


def test_tei_and_ollama_targets_speak_their_servers_wire(lengths):
    (tei,) = build_payloads("tei", "embed", "http://127.0.0.1:1", "m", TEXTS, lengths, 3, pool_size=1)
    line, headers, body = split(tei.request)
    assert line == "POST /embed HTTP/1.1" and headers["Content-Type"] == "application/json"
    doc = msgspec.json.decode(body)
    assert list(doc) == ["inputs"] and len(doc["inputs"]) == 3  # one model per TEI server: no model field
    (oll,) = build_payloads("ollama", "embed", "http://127.0.0.1:1", "m", TEXTS, lengths, 3, pool_size=1)
    line, _, body = split(oll.request)
    assert line == "POST /api/embed HTTP/1.1" and msgspec.json.decode(body) == {"model": "m", "input": doc["inputs"]}
    # TEI answers a bare array and no count; Ollama counts in prompt_eval_count.
    assert reply_tokens("tei", "embed", b"[[0.1, 0.2], [0.3, 0.4]]") == -1
    with pytest.raises(msgspec.ValidationError):
        reply_tokens("tei", "embed", b'{"error": "busy", "error_type": "overloaded"}')
    assert reply_tokens("ollama", "embed", b'{"model": "m", "embeddings": [[0.1]], "prompt_eval_count": 12}') == 12
    for kind in ("tei", "ollama"):
        with pytest.raises(ValueError, match="embed only"):
            build_payloads(kind, "rerank", "http://127.0.0.1:1", "m", TEXTS, lengths, 1, pool_size=1)


def test_lineup_keeps_what_cannot_run_as_skipped_with_its_setup_script():
    """Every name asked for either runs or is skipped with why; peers not set up name their script."""
    from fleet.bench import peers
    from fleet.bench.lineup import choose

    names = ["fleet", "tei", "ollama", "infinity", "tei=http://127.0.0.1:8080", "ollama=http://127.0.0.1:11434"]
    lineup = choose(names, url="http://127.0.0.1:7744", url_given=True, compare=True)
    ran = {e.name: e for e in lineup.entries}
    assert (ran["fleet"].kind, ran["fleet"].url) == ("fleet", "http://127.0.0.1:7744")
    assert (ran["tei@127.0.0.1:8080"].kind, ran["tei@127.0.0.1:8080"].start_peer) == ("tei", False)
    assert ran["ollama@127.0.0.1:11434"].url == "http://127.0.0.1:11434"
    for peer in ("tei", "ollama", "infinity"):
        if peers.program(peer) is None:
            assert peer not in ran and lineup.skipped[peer].endswith(f"run bench/setup_{peer}.sh")
        else:
            assert ran[peer].start_peer and peer not in lineup.skipped
    assert set(ran) | set(lineup.skipped) >= {"fleet", "tei", "ollama", "infinity"}
    # Outside --compare, --target tei with --url benches that server in TEI's wire format.
    (only,) = choose(["tei"], url="http://127.0.0.1:9", url_given=True, compare=False).entries
    assert (only.kind, only.url, only.start_peer) == ("tei", "http://127.0.0.1:9", False)
    with pytest.raises(ValueError, match="mystery, tei=ftp://x"):
        choose(["fleet", "mystery", "tei=ftp://x"], url="http://127.0.0.1:9", url_given=True, compare=True)


def test_client_reads_chunked_and_content_length_replies_on_one_connection():
    async def scenario() -> list[tuple[int, bytes, bool]]:
        async def handle(reader, writer):
            for reply in (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Queue-Ms: 1.5\r\nx-inference-ms: 7.25\r\n"
                          b"\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
                          b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 4\r\nConnection: close\r\n\r\nbusy"):
                await reader.readuntil(b"\r\n\r\n")
                writer.write(reply)
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        ep = httpclient.Endpoint(f"http://127.0.0.1:{port}")
        req = httpclient.build_request(ep, "/x", b"", "application/json", "application/json")
        conn = await httpclient.connect(ep)
        out = [await httpclient.exchange(conn, req), await httpclient.exchange(conn, req)]
        conn.close()
        server.close()
        await server.wait_closed()
        return out

    first, second = asyncio.run(scenario())
    assert first == (200, b"hello world", True, 1.5, 7.25)
    assert second[:3] == (429, b"busy", False)
    assert math.isnan(second[3]) and math.isnan(second[4])  # no timing headers sent


def test_blocking_conn_sends_again_when_the_idle_connection_was_closed():
    """A server closes an idle keep-alive connection (fleet's after keep_alive_timeout_ms):
    the latency tools' connection sends its request again on a new one."""
    import socket
    import threading

    served: list[int] = []
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        for n in range(2):
            conn, _ = listener.accept()
            with conn:
                conn.recv(1 << 16)
                served.append(n)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                # The first connection is closed once idle, as a keep-alive timeout does.

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    ep = httpclient.Endpoint(f"http://127.0.0.1:{port}")
    conn = httpclient.BlockingConn(ep, timeout_s=10)
    req = httpclient.build_request(ep, "/x", b"", "application/json", "application/json")
    try:
        assert conn.exchange(req) == (200, {b"content-length": b"2"}, b"ok")
        t0 = time.monotonic()
        while len(served) < 1 and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        time.sleep(0.1)  # the server has closed the first connection
        assert conn.exchange(req) == (200, {b"content-length": b"2"}, b"ok")
    finally:
        conn.close()
        listener.close()
    t.join(timeout=10)
    assert served == [0, 1]  # the request reached the server once on each connection


def test_saturation_groups_requests_into_the_worker_batches_they_ran_in():
    from fleet.bench.saturation import analyse, padded

    assert padded([3, 1, 2, 8], 2, sort=False) == 2 * 3 + 2 * 8 and padded([3, 1, 2, 8], 2, sort=True) == 2 * 2 + 2 * 8
    # Cut as the worker cuts (runtimes/adapters/batching.padding_cuts): four short texts not padded to two long ones.
    assert padded([50, 1, 1, 50, 1, 1], 64, sort=True, fixed=10) == 4 * 1 + 2 * 50
    assert padded([50, 1, 1, 50, 1, 1], 64, sort=True) == 6 * 50
    lengths = [10, 40, 20, 30]
    windows = [[0, 1], [2, 3]]
    ms = 1_000_000

    def row(claimed: int, window: int) -> dict:
        # One request's stamps (ns): the worker's share those of its batch.
        return {"sent": 0, "handler": 1 * ms, "put": 2 * ms, "woke": claimed - ms, "claimed": claimed,
                "lingered": claimed, "decoded": claimed, "tokenized": claimed + 2 * ms,
                "forward": claimed + 12 * ms, "host": claimed + 12 * ms, "ran": claimed + 13 * ms,
                "collected": claimed + 14 * ms, "encoded": claimed + 15 * ms, "received": claimed + 16 * ms,
                "window": window}

    rows = [row(100 * ms, 0), row(100 * ms, 1), row(200 * ms, 0)]  # a batch of two requests, then one alone
    res = analyse(rows, windows, lengths, batch=2, micro=4, wall_s=1.0)
    assert res["batches"] == 2 and res["requests_per_batch"] == {"mean": 1.5, "min": 1, "max": 2}
    assert res["tokens_per_s"] == (100 + 50)
    stages = res["worker_stages"]
    assert stages["last micro-batch: forward + pool"]["total_s"] == pytest.approx(0.020)
    assert stages["tokenize + forward + pool, all micro-batches"]["per_batch_ms"] == 12
    assert res["worker_busy_share"] == pytest.approx(0.028)
    assert res["model_tokens_per_s"] == pytest.approx(150 / 0.024)
    pad = res["padding_fraction"]
    # Batch 1 sorted in one micro-batch of 4: 4 x 40 for 100 real; batch 2: 2 x 40 for 50.
    assert pad["worker (batch sorted, micro-batches of 4)"] == pytest.approx(1 - 150 / 240)
    # Per request unsorted: (2 x 40) + (2 x 30) + (2 x 40) for 150.
    assert pad["request windows unsorted (per request)"] == pytest.approx(1 - 150 / 220)
    # A batch run between two micro-batches of another (an interjection, runtimes.flows) lies
    # inside that batch's span: the worker was busy once, not twice.
    nested = [row(100 * ms, 0), row(100 * ms, 1), row(105 * ms, 0)]
    res = analyse(nested, windows, lengths, batch=2, micro=4, wall_s=1.0)
    assert res["batches"] == 2 and res["worker_busy_share"] == pytest.approx(0.019)  # 99 .. 118 ms
    assert res["model_tokens_per_s"] == pytest.approx(150 / 0.017)  # 100 .. 117 ms
