"""Authenticated, encrypted NATS, for real: `fleetctl serve` against nats-servers that
demand credentials and speak TLS with a CA this test makes (openssl).

- `tls_server`: TLS with a server certificate from the test's CA, client certificates
  required (`verify: true`), users known by their public nkey only.
- `creds_server`: operator mode (JWTs: an operator, an account with JetStream, a user,
  made and signed here with nkeys, kept in the server's memory resolver).

A box with the right nkey and certificates, or the right .creds file, joins and answers
through the cluster; a wrong nkey, a user JWT from an account the server does not know,
a server certificate from a CA the box does not trust, or no client certificate ->
`serve` exits 1 before anything starts, with one error line naming the server and what
failed.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import DEFAULT_MODEL, start_daemon
from tests.nats_fixture import NatsServer

pytestmark = [pytest.mark.nats]

nkeys = pytest.importorskip("nkeys", reason="nkey and .creds auth need the nkeys package (the `test` extra)")


# -- a CA and certificates (openssl) ---------------------------------------------------


def openssl(*args: str, cwd: Path) -> None:
    out = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)}: {out.stderr.strip()}")


def make_ca(d: Path, name: str) -> None:
    """`name`.pem / `name`.key: a self-signed CA (P-256, two days)."""
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN=fleet test {name}",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            cwd=d)


def make_cert(d: Path, name: str, ca: str, extensions: str) -> None:
    """`name`.pem / `name`.key signed by `ca`, with `extensions` (an openssl extfile's lines)."""
    (d / f"{name}.ext").write_text(extensions)
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
            "-out", f"{name}.csr", "-subj", f"/CN=fleet test {name}", cwd=d)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


# -- nkeys and JWTs (nkeys) ------------------------------------------------------------


def new_key(prefix: int):
    return nkeys.from_seed(nkeys.encode_seed(secrets.token_bytes(32), prefix))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def jwt(claims: dict, subject, issuer) -> str:
    """A NATS JWT (v2): `claims` about `subject`'s public key, signed by `issuer`'s nkey."""
    body = {"jti": secrets.token_hex(16).upper(), "iat": int(time.time()), "iss": issuer.public_key.decode(),
            "sub": subject.public_key.decode(), **claims}
    signing = f"{_b64(json.dumps({'typ': 'JWT', 'alg': 'ed25519-nkey'}).encode())}.{_b64(json.dumps(body).encode())}"
    return f"{signing}.{_b64(issuer.sign(signing.encode()))}"


def creds(user_jwt: str, user) -> str:
    return (f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n------END USER NKEY SEED------\n")


UNLIMITED = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True, "conn": -1,
             "leaf": -1}
JETSTREAM = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}


@dataclass
class Pki:
    dir: Path
    nkey_file: Path
    wrong_nkey_file: Path
    creds_file: Path
    stranger_creds_file: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command: the test makes its CA and certificates with it")
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    make_ca(d, "stranger-ca")
    make_cert(d, "server", "ca", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    make_cert(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    make_cert(d, "stranger-client", "stranger-ca", "extendedKeyUsage=clientAuth\n")
    # nkey users: the server knows the first one's public key.
    user, wrong = new_key(nkeys.PREFIX_BYTE_USER), new_key(nkeys.PREFIX_BYTE_USER)
    (d / "user.nk").write_bytes(user.seed + b"\n")
    (d / "wrong.nk").write_bytes(wrong.seed + b"\n")
    (d / "tls.conf").write_text(
        f"tls {{ cert_file: '{d}/server.pem', key_file: '{d}/server.key', ca_file: '{d}/ca.pem', verify: true }}\n"
        f"authorization {{ users: [ {{ nkey: {user.public_key.decode()} }} ] }}\n")
    # Operator mode: operator -> account (JetStream on) -> user, kept in the server's memory.
    operator, account = new_key(nkeys.PREFIX_BYTE_OPERATOR), new_key(nkeys.PREFIX_BYTE_ACCOUNT)
    account_jwt = jwt({"name": "fleet", "nats": {"type": "account", "version": 2, "limits": {**UNLIMITED, **JETSTREAM},
                                                 "default_permissions": {"pub": {}, "sub": {}}}}, account, operator)
    box, stranger, stranger_account = (new_key(nkeys.PREFIX_BYTE_USER), new_key(nkeys.PREFIX_BYTE_USER),
                                       new_key(nkeys.PREFIX_BYTE_ACCOUNT))
    user_claims = {"name": "box", "nats": {"type": "user", "version": 2, "pub": {}, "sub": {}, "subs": -1, "data": -1,
                                           "payload": -1}}
    (d / "box.creds").write_text(creds(jwt(user_claims, box, account), box))
    # A well-formed .creds file of an account this server has never heard of.
    (d / "stranger.creds").write_text(creds(jwt(user_claims, stranger, stranger_account), stranger))
    # JetStream in operator mode needs a system account.
    system = new_key(nkeys.PREFIX_BYTE_ACCOUNT)
    operator_jwt = jwt({"name": "fleet-test", "nats": {"type": "operator", "version": 2,
                                                       "system_account": system.public_key.decode()}}, operator, operator)
    system_jwt = jwt({"name": "SYS", "nats": {"type": "account", "version": 2, "limits": UNLIMITED}}, system, operator)
    (d / "creds.conf").write_text(
        f"operator: {operator_jwt}\nresolver: MEMORY\nsystem_account: {system.public_key.decode()}\n"
        f"resolver_preload: {{ {account.public_key.decode()}: {account_jwt}, {system.public_key.decode()}: {system_jwt} }}\n")
    return Pki(d, d / "user.nk", d / "wrong.nk", d / "box.creds", d / "stranger.creds")


@pytest.fixture(scope="module")
def tls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory):
    server = NatsServer(tmp_path_factory.mktemp("nats-tls"), args=["-c", str(pki.dir / "tls.conf")])
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def creds_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory):
    server = NatsServer(tmp_path_factory.mktemp("nats-creds"), args=["-c", str(pki.dir / "creds.conf")])
    server.start()
    yield server
    server.stop()


def tls_env(pki: Pki, server: NatsServer, **changes: str) -> dict[str, str]:
    env = {"FLEET_NATS": f"tls://127.0.0.1:{server.port}", "FLEET_NATS_NKEY_FILE": str(pki.nkey_file),
           "FLEET_NATS_TLS_CA": str(pki.dir / "ca.pem"), "FLEET_NATS_TLS_CERT": str(pki.dir / "client.pem"),
           "FLEET_NATS_TLS_KEY": str(pki.dir / "client.key"), "FLEET_BOX": "box-tls", "FLEET_WORKERS": "1",
           "FLEET_CPU_THREADS": "1"}
    env.update(changes)
    return {k: v for k, v in env.items() if v}


def refused(home: Path, env: dict[str, str]) -> str:
    """`fleetctl serve` with `env`: must exit 1; its error line."""
    full = {**os.environ, "FLEET_HOME": str(home), "HF_HUB_OFFLINE": "1", **env}
    full.pop("FLEET_URL", None)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "fleetctl", "serve", "--port", "9"], env=full, capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 1, f"exit {out.returncode}:\n{out.stderr[-3000:]}"
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error")]
    assert len(errors) == 1 and len(lines) == 1, lines
    assert time.monotonic() - t0 < 30
    assert not (home / "store").exists() or not any((home / "store").iterdir()), "something started"
    return errors[0]


def joined(url: str, box: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    view: dict = {}
    while time.monotonic() < deadline:
        view = httpx.get(url + "/v1/cluster", timeout=10).json()
        entry = next((b for b in view.get("boxes", []) if b["box"] == box), None)
        if entry is not None:
            return entry
        time.sleep(0.3)
    raise AssertionError(f"{box} never showed in the cluster view: {view}")


@pytest.mark.slow
def test_a_box_with_its_nkey_and_certificates_joins_over_tls(pki: Pki, tls_server: NatsServer,
                                                           tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "home", extra_env=tls_env(pki, tls_server))
    try:
        joined(d.url, "box-tls")
        r = httpx.post(d.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": ["over TLS, signed by an nkey"]},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-served-by"].startswith("box-tls/")
        # Through JetStream, not around it: the box's entry counts it as served from the stream.
        deadline = time.monotonic() + 15
        while (entry := joined(d.url, "box-tls"))["served"] < 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert entry["served"] >= 1, entry
    finally:
        d.stop()


def test_a_wrong_nkey_stops_serve_naming_it(pki: Pki, tls_server: NatsServer, tmp_path: Path) -> None:
    line = refused(tmp_path / "home", tls_env(pki, tls_server, FLEET_NATS_NKEY_FILE=str(pki.wrong_nkey_file)))
    assert f"NATS at 127.0.0.1:{tls_server.port} refused this box's credentials (nats_nkey_file)" in line, line
    assert "Authorization Violation" in line, line


def test_an_untrusted_server_certificate_stops_serve_naming_it(pki: Pki, tls_server: NatsServer,
                                                              tmp_path: Path) -> None:
    line = refused(tmp_path / "home",
                   tls_env(pki, tls_server, FLEET_NATS_TLS_CA=str(pki.dir / "stranger-ca.pem")))
    assert f"NATS at 127.0.0.1:{tls_server.port} has a certificate this box does not trust" in line, line
    assert "nats_tls_ca" in line, line


def test_no_client_certificate_stops_serve_naming_it(pki: Pki, tls_server: NatsServer, tmp_path: Path) -> None:
    line = refused(tmp_path / "home", tls_env(pki, tls_server, FLEET_NATS_TLS_CERT="", FLEET_NATS_TLS_KEY=""))
    assert f"NATS at 127.0.0.1:{tls_server.port} asks for a TLS client certificate and this box has none" in line, line
    assert "set nats_tls_cert and nats_tls_key" in line, line


def test_a_client_certificate_from_another_ca_stops_serve_naming_it(pki: Pki, tls_server: NatsServer,
                                                                    tmp_path: Path) -> None:
    line = refused(tmp_path / "home", tls_env(pki, tls_server, FLEET_NATS_TLS_CERT=str(pki.dir / "stranger-client.pem"),
                                              FLEET_NATS_TLS_KEY=str(pki.dir / "stranger-client.key")))
    assert f"NATS at 127.0.0.1:{tls_server.port} refused this box's TLS client certificate" in line, line
    assert "nats_tls_cert must be signed by a CA it trusts" in line, line


def test_a_missing_nkey_file_stops_serve_naming_the_setting(pki: Pki, tls_server: NatsServer, tmp_path: Path) -> None:
    line = refused(tmp_path / "home", tls_env(pki, tls_server, FLEET_NATS_NKEY_FILE=str(tmp_path / "nope.nk")))
    assert "nats_nkey_file: no readable file where it points" in line, line
    assert str(tmp_path) not in line  # settings are named, paths are not


@pytest.mark.slow
def test_a_box_with_its_creds_file_joins(pki: Pki, creds_server: NatsServer, tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "home", extra_env={
        "FLEET_NATS": creds_server.url, "FLEET_NATS_CREDS_FILE": str(pki.creds_file), "FLEET_BOX": "box-creds",
        "FLEET_WORKERS": "1", "FLEET_CPU_THREADS": "1", "FLEET_PRELOAD": ""})
    try:
        entry = joined(d.url, "box-creds")
        assert entry["box"] == "box-creds"
    finally:
        d.stop()


def test_creds_of_an_unknown_account_stop_serve_naming_them(pki: Pki, creds_server: NatsServer,
                                                            tmp_path: Path) -> None:
    line = refused(tmp_path / "home", {"FLEET_NATS": creds_server.url,
                                       "FLEET_NATS_CREDS_FILE": str(pki.stranger_creds_file)})
    assert f"NATS at 127.0.0.1:{creds_server.port} refused this box's credentials (nats_creds_file)" in line, line
