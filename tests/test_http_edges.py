"""The HTTP edges of a request's head (issue 42, item 9), over raw loopback sockets.

Before: a 32 MB header got 200 (eight such connections took the API process to
499 MiB); `Transfer-Encoding: gzip` got uvicorn's plain-text 400 and `gzip, chunked`
was read as plain chunked (200, the gzip ignored); two `Host` headers were read as
the last one. Now: 431, 501 and 400 in the contract's error shape, decided before
any app runs (daemon/connections.py), and the daemon serves everyone else meanwhile.

The session daemon's one changed setting (max_body_bytes) does not touch a head:
`max_header_bytes` and the rest are the shipped ones.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import httpx
import psutil
import pytest

from tests.conftest import DEFAULT_MODEL, DaemonProc

#: The issue's probe: eight connections, each a 32 MB header.
BIG_HEADERS, BIG_MB = 8, 32
EMBED = json.dumps({"model": DEFAULT_MODEL, "inputs": ["a text"]}).encode()


def answer(s: socket.socket, timeout_s: float = 60.0) -> tuple[int, dict[str, str], bytes]:
    """Read one response (status, headers, body by content-length) from `s`."""
    s.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        got = s.recv(65536)
        assert got, f"connection closed before an answer: {data!r}"
        data += got
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((k.lower(), v.strip()) for k, v in (ln.split(":", 1) for ln in lines[1:]))
    while len(body) < int(headers.get("content-length", 0)):
        got = s.recv(65536)
        if not got:
            break
        body += got
    return int(lines[0].split()[1]), headers, body


def send_raw(d: DaemonProc, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", d.port), timeout=30) as s:
        s.sendall(raw)
        return answer(s)


def error_of(status_headers_body: tuple[int, dict[str, str], bytes]) -> tuple[int, str, str]:
    status, headers, body = status_headers_body
    assert headers["content-type"] == "application/json", (status, headers, body)
    err = json.loads(body)["error"]
    return status, err["code"], err["message"]


def big_header(d: DaemonProc, out: list) -> None:
    """A client that sends a 32 MB header a MiB at a time and stops when an answer arrives."""
    with socket.create_connection(("127.0.0.1", d.port), timeout=60) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        mib = b"a" * (1 << 20)
        try:
            for _ in range(BIG_MB):
                if select.select([s], [], [], 0)[0]:
                    break
                s.sendall(mib)
            else:
                s.sendall(b"\r\n\r\n")
        except OSError:  # the server stopped reading: its answer is waiting
            pass
        out.append(answer(s))


def test_32_mb_headers_are_431_and_the_api_keeps_its_memory(daemon: DaemonProc) -> None:
    api = psutil.Process(daemon.proc.pid)
    assert httpx.post(daemon.url + "/v1/embed", content=EMBED, headers={"Content-Type": "application/json"},
                      timeout=60).status_code == 200
    before = peak = api.memory_info().rss
    answers: list = []
    clients = [threading.Thread(target=big_header, args=(daemon, answers)) for _ in range(BIG_HEADERS)]
    for c in clients:
        c.start()
    # Everyone else is served meanwhile.
    embedded = httpx.post(daemon.url + "/v1/embed", content=EMBED, headers={"Content-Type": "application/json"},
                          timeout=60)
    while any(c.is_alive() for c in clients):
        peak = max(peak, api.memory_info().rss)
        time.sleep(0.01)
    assert embedded.status_code == 200, embedded.text
    assert len(answers) == BIG_HEADERS
    for a in answers:
        status, code, message = error_of(a)
        assert (status, code) == (431, "headers_too_large") and "max_header_bytes" in message
    # Before: 499 MiB for the eight. Now the parser holds at most max_header_bytes each.
    assert peak - before < 64 << 20, f"API grew {(peak - before) >> 20} MiB"
    assert httpx.get(daemon.url + "/v1/models", timeout=30).status_code == 200


def test_a_head_just_under_the_cap_is_served(daemon: DaemonProc) -> None:
    filler = b"x" * (60 << 10)
    status, _, body = send_raw(daemon, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Filler: " + filler
                               + b"\r\nConnection: close\r\n\r\n")
    assert status == 200, body
    status, code, _ = error_of(send_raw(daemon, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Filler: "
                                        + filler + filler + b"\r\n\r\n"))
    assert (status, code) == (431, "headers_too_large")


def post_coded(coding: bytes, body: bytes) -> bytes:
    return (b"POST /v1/embed HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: " + coding + b"\r\nConnection: close\r\n\r\n" + body)


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


@pytest.mark.parametrize(("coding", "status", "code"), [
    (b"gzip", 501, "not_implemented"),
    (b"gzip, chunked", 501, "not_implemented"),  # before: 200, the body read as if not gzipped
    (b"identity", 501, "not_implemented"),
    (b"chunked, chunked", 400, "bad_request"),
])
def test_a_transfer_coding_other_than_chunked_is_refused(daemon: DaemonProc, coding: bytes, status: int,
                                                         code: str) -> None:
    got = error_of(send_raw(daemon, post_coded(coding, chunked(EMBED))))
    assert got[:2] == (status, code), got
    # Chunked alone is read, and the daemon serves on.
    ok, _, body = send_raw(daemon, post_coded(b"chunked", chunked(EMBED)))
    assert ok == 200 and json.loads(body)["model"] == DEFAULT_MODEL


@pytest.mark.parametrize("hosts", [(b"127.0.0.1", b"127.0.0.1"), (b"evil.example", b"127.0.0.1")])
def test_two_host_headers_are_400(daemon: DaemonProc, hosts: tuple[bytes, bytes]) -> None:
    raw = b"GET /api/tags HTTP/1.1\r\nHost: %s\r\nHost: %s\r\nConnection: close\r\n\r\n" % hosts
    status, headers, body = send_raw(daemon, raw)
    # /api/* answers in Ollama's error shape, with the contract's status.
    assert status == 400 and headers["content-type"] == "application/json", body
    assert "2 Host headers" in json.loads(body)["error"]


def test_a_request_httptools_cannot_parse_is_400_in_the_contract_shape(daemon: DaemonProc) -> None:
    status, code, _ = error_of(send_raw(daemon, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header: x\r\n\r\n"))
    assert (status, code) == (400, "bad_request")
