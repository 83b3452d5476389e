"""The NATS bridge's names and connection options, against real nats-servers that
require a token, a user/password, or TLS: the settings reach the server, and a
client without them cannot get in (so cannot read the queue)."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
from pathlib import Path

import pytest

from daemon.cluster import box_token, connect_options, consumer_name, work_subject
from daemon.controllers.cluster import public_url
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
