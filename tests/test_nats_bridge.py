"""The NATS bridge's names, settings and fetch credit; its connection options against
real nats-servers that require a token, a user/password, or TLS: the settings reach
the server, and a client without them cannot get in (so cannot read the queue)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.daemon.cluster import (FetchCredit, box_token, check_settings, choose_replicas, choose_server, connect_options,
                            consumer_name, work_subject)
from fleet.daemon.controllers.cluster import public_url
from fleet.config import Settings
from fleet.errors import BadRequest
from tests.nats_fixture import NatsServer

pytestmark = pytest.mark.nats


def test_model_and_box_names_become_single_subject_tokens() -> None:
    assert work_subject("bge-small-en-v1.5") == "fleet.work.bge-small-en-v1~5"
    assert consumer_name("bge-small-en-v1.5") == "work_bge-small-en-v1~5"
    assert box_token("gpu-01.lab") == "gpu-01_lab"
    assert box_token("a b*>") == "a_b__"


def test_public_url_never_echoes_credentials() -> None:
    assert public_url("nats://u:secret@10.0.0.5:4222, tls://tok@h2") == "nats://10.0.0.5:4222,tls://h2"


def test_bad_nats_settings_fail_at_start() -> None:
    with pytest.raises(BadRequest, match="no server URL"):
        connect_options(Settings(nats=" , "))
    if importlib.util.find_spec("nkeys") is None:
        with pytest.raises(BadRequest, match="pip install nkeys"):
            connect_options(Settings(nats="nats://127.0.0.1:4222", nats_creds_file="/nonexistent.creds"))


def test_shipped_settings_let_redelivery_beat_the_deadline() -> None:
    shipped = Settings(nats="nats://127.0.0.1:4222")
    check_settings(shipped)
    # A dead box is noticed within ack_wait: at most a third of the deadline.
    assert shipped.nats_ack_wait_ms * 3 <= shipped.timeout_ms


@pytest.mark.parametrize("changes, message", [
    ({"nats_ack_wait_ms": 30_000}, r"nats_ack_wait_ms \(30000\) must be at most a third of timeout_ms \(30000\)"),
    ({"nats_ack_wait_ms": 5_000, "timeout_ms": 12_000}, r"at most a third of timeout_ms \(12000\)"),
    ({"nats_ack_wait_ms": 500}, "must be at least 1000"),
    ({"nats_fetch_per_worker": 0}, "nats_fetch_per_worker must be at least 1"),
])
def test_settings_that_would_lose_requests_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        check_settings(Settings(nats="nats://127.0.0.1:4222", **changes))


@pytest.mark.parametrize("setting, wanted, have, replicas", [
    (0, 3, 1, 3),   # a stream of the last release (one copy) on a three-server cluster: raised
    (0, 3, 3, 3),
    (0, 3, 5, 5),   # raised by an operator: never lowered by fleet
    (0, 1, 1, 1),   # a single server (or a cluster that cannot place three)
    (0, 1, 3, 3),
    (1, 3, 3, 1),   # the setting is the operator's: lowered to it
    (5, 3, 3, 5),
])
def test_shared_streams_get_three_replicas_unless_told_and_are_never_lowered_by_fleet(
        setting: int, wanted: int, have: int, replicas: int) -> None:
    assert choose_replicas(setting, wanted, have) == replicas


def test_nats_replicas_out_of_jetstreams_range_is_refused() -> None:
    with pytest.raises(BadRequest, match="nats_replicas must be between 0 .* and 5"):
        check_settings(Settings(nats="nats://127.0.0.1:4222", nats_replicas=7))


class _Server:
    def __init__(self, netloc: str, reconnects: int = 0) -> None:
        self.uri = type("uri", (), {"netloc": netloc})()
        self.reconnects = reconnects


def test_a_reconnect_goes_to_a_server_that_has_not_failed_and_not_the_one_left() -> None:
    pool = [_Server("n1:4222"), _Server("n2:4222"), _Server("n3:4222", reconnects=2)]
    # n1 was just lost (or cut off from JetStream's majority): n2, at once.
    for _ in range(20):
        server, wait_s = choose_server(pool, {"n1:4222"}, 1.0)
        assert (server.uri.netloc, wait_s) == ("n2:4222", 0.0)
    # Every other one has failed since: the least failed, after the reconnect wait.
    pool[1].reconnects = 3
    server, wait_s = choose_server(pool, {"n1:4222"}, 1.0)
    assert (server.uri.netloc, wait_s) == ("n1:4222", 1.0)
    # A single server: it, after the wait (a NATS restart).
    assert choose_server([_Server("only:4222")], {"only:4222"}, 1.0)[1] == 1.0


def test_serve_refuses_an_ack_wait_past_the_deadline_with_exit_1(tmp_path: Path) -> None:
    env = {**os.environ, "FLEET_HOME": str(tmp_path / "home"), "FLEET_NATS": "nats://127.0.0.1:9",
           "FLEET_NATS_ACK_WAIT_MS": "30000", "FLEET_PRELOAD": ""}
    out = subprocess.run([sys.executable, "-m", "fleetctl", "serve"], env=env, capture_output=True, text=True,
                         timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 1, out.stderr
    assert "nats_ack_wait_ms (30000) must be at most a third of timeout_ms (30000)" in out.stderr
    assert "FLEET_NATS_ACK_WAIT_MS" in out.stderr  # the hint: what to set


def test_fetch_credit_is_one_budget_for_every_puller_of_a_box() -> None:
    async def scenario() -> list[object]:
        capacity = 4
        credit = FetchCredit(lambda: capacity)
        seen: list[object] = []
        # Two models' pullers: the busy one takes all the room, the idle one waits for a message's worth.
        seen.append(await credit.take(32))
        idle = asyncio.create_task(credit.take(1))
        await asyncio.sleep(0)
        seen.append(idle.done())
        # The busy one's fetch filled 3 of 4: one comes back, and goes to the waiting puller.
        credit.give(1)
        seen.append(await asyncio.wait_for(idle, 1))
        seen.append(credit.used)
        # Waiters are served first come, first served: a puller that gives back and takes again
        # in a loop gets in line behind the one already waiting.
        first = asyncio.create_task(credit.take(2))
        await asyncio.sleep(0)
        credit.give(1)
        again = asyncio.create_task(credit.take(1))
        await asyncio.sleep(0)
        seen.append((first.done(), again.done()))
        seen.append(await asyncio.wait_for(first, 1))
        # More workers up: more room, handed out without anything given back.
        capacity = 6
        credit.wake()
        seen.append(await asyncio.wait_for(again, 1))
        seen.append(credit.used)
        # A cancelled waiter gives up its place, not the room.
        late = asyncio.create_task(credit.take(1))
        await asyncio.sleep(0)
        late.cancel()
        await asyncio.gather(late, return_exceptions=True)
        credit.give(2)
        seen.append(await asyncio.wait_for(credit.take(5), 1))
        return seen

    assert asyncio.run(scenario()) == [4, False, 1, 4, (True, False), 1, 1, 5, 2]


async def _roundtrip(settings: Settings) -> bytes:
    """Connect with the bridge's options, use JetStream once, return what came back."""
    import nats

    opts = connect_options(settings)
    opts.update(max_reconnect_attempts=0, allow_reconnect=False)

    async def quiet(_exc: Exception) -> None:
        return None

    nc = await nats.connect(**opts, error_cb=quiet)
    try:
        js = nc.jetstream()
        await js.add_stream(name="T", subjects=["t.>"])
        await js.publish("t.x", b"payload")
        return (await js.get_last_msg("T", "t.x")).data
    finally:
        await nc.close()


def _refused(settings: Settings) -> bool:
    try:
        asyncio.run(_roundtrip(settings))
    except Exception:
        return True
    return False


@pytest.mark.parametrize("server_args, good, bad", [
    (["--auth", "s3cret-token"], {"nats_token": "s3cret-token"}, {"nats_token": "wrong"}),
    (["--user", "fleet", "--pass", "pw-1"], {"nats_user": "fleet", "nats_password": "pw-1"},
     {"nats_user": "fleet", "nats_password": "nope"}),
], ids=["token", "user-password"])
def test_auth_settings_reach_the_server(tmp_path: Path, server_args: list[str], good: dict, bad: dict) -> None:
    server = NatsServer(tmp_path / "nats", args=server_args)
    server.start()
    try:
        assert asyncio.run(_roundtrip(Settings(nats=server.url, **good))) == b"payload"
        assert _refused(Settings(nats=server.url, **bad))
        assert _refused(Settings(nats=server.url))
    finally:
        server.stop()


def _make_certs(d: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1, made with the openssl CLI."""
    d.mkdir(parents=True, exist_ok=True)
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True, cwd=d)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=fleet-test-ca",
        "-keyout", "ca.key", "-out", "ca.pem")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key", "-out", "server.csr")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
        "-extfile", "san.ext", "-out", "server.pem")
    return d / "ca.pem", d / "server.pem", d / "server.key"


def test_tls_ca_setting_verifies_the_server(tmp_path: Path) -> None:
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI to make a test certificate")
    ca, cert, key = _make_certs(tmp_path / "certs")
    server = NatsServer(tmp_path / "nats", args=["--tls", "--tlscert", str(cert), "--tlskey", str(key)])
    server.start()
    try:
        url = f"tls://127.0.0.1:{server.port}"
        assert asyncio.run(_roundtrip(Settings(nats=url, nats_tls_ca=str(ca)))) == b"payload"
        assert _refused(Settings(nats=url))  # the system CAs do not know this server
    finally:
        server.stop()
