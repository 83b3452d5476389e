"""Hostile input that reaches the model store, the decoder and the metrics (issue 16,
deliverables 4-7). Each probe is answered with a clean 4xx in the contract's shape,
or refused at start-up, and changes nothing else."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet.catalog import validate_name
from fleet.errors import BadRequest, IntegrityError, ModelNotFound
from fleet.pins import PinStore
from fleet.pull import pull_model
from fleet.store import Store
from tests.conftest import DEFAULT_MODEL, copy_default_model, free_port

MSGPACK = "application/msgpack"


def error_of(resp: httpx.Response) -> dict:
    if resp.headers["content-type"].startswith(MSGPACK):
        return msgspec.msgpack.decode(resp.content)["error"]
    return resp.json()["error"]


# ---- 4: nesting depth ----------------------------------------------------------------

DEPTHS = [1, 10, 100, 500, 900, 990, 1000, 1100, 5000, 100_000]


def nested_json(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def nested_msgpack(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"  # fixarray of one element, `depth` times, around nil


@pytest.mark.parametrize("depth", DEPTHS)
def test_every_nesting_depth_is_a_clean_4xx(daemon, depth):
    start = len(daemon.log())
    deep = nested_json(depth)
    chat = (b'{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "x": %s}]}]}'
            % (DEFAULT_MODEL.encode(), deep))
    fmt = b'{"model": "%s", "prompt": "hi", "format": {"a": %s}}' % (DEFAULT_MODEL.encode(), deep)
    embed = b'{"model": "%s", "inputs": [%s]}' % (DEFAULT_MODEL.encode(), deep)
    packed = (b"\x82\xa5model" + msgspec.msgpack.encode(DEFAULT_MODEL) + b"\xa8messages\x91\x82\xa4role\xa4user"
              b"\xa7content\x91\x81\xa1x" + nested_msgpack(depth))
    probes = [("/v1/chat/completions", "application/json", chat), ("/v1/generate", "application/json", fmt),
              ("/v1/embed", "application/json", embed), ("/v1/chat/completions", MSGPACK, packed),
              ("/v1/generate", MSGPACK, packed)]
    for path, ctype, body in probes:
        resp = httpx.post(daemon.url + path, content=body, headers={"Content-Type": ctype}, timeout=60)
        assert 400 <= resp.status_code < 500, (path, ctype, depth, resp.status_code, resp.content[:200])
        assert error_of(resp)["code"] in ("bad_request", "payload_too_large")
    log = daemon.log()[start:]
    assert "RecursionError" not in log and "Traceback" not in log


# ---- 4: model names ------------------------------------------------------------------

BAD_NAMES = ["nl\n", "nl\r", "nl\r\n", "\nnl", "n\x00l", "nl\t", "nl ", "n\x1bl", "nl\x7f", "nl\u2028", "nl\u0085",
             "NL", "", ".nl", "a/b", "..", "a" * 129]


@pytest.mark.parametrize("name", BAD_NAMES, ids=[repr(n)[:20] for n in BAD_NAMES])
def test_one_strict_name_pattern(name):
    with pytest.raises(BadRequest):
        validate_name(name)


def test_a_name_with_a_newline_never_becomes_a_second_store_entry(tmp_path):
    store = Store(tmp_path / "home" / "models")
    pull_model(store, f"path:{copy_default_model(tmp_path / 'src')}", name="nl")
    for bad in ("nl\n", "nl\r\n", "nl\x00"):
        with pytest.raises(BadRequest):
            pull_model(store, f"path:{tmp_path / 'src'}", name=bad)
    assert store.names() == ["nl"]
    pins = PinStore(tmp_path / "home")
    with pytest.raises(BadRequest):
        pins.add("nl\n", "cpu")
    # A hand-edited pins file with such a name is never used: it is set aside whole.
    (tmp_path / "home" / "pins.json").write_text('{"pins": {"nl\\n": {"device": "cpu", "at": "x"}}}')
    assert pins.load() == {}
    assert list((tmp_path / "home").glob("pins.json.damaged-*"))


def test_api_refuses_names_with_control_characters(daemon):
    for name in (DEFAULT_MODEL + "\n", DEFAULT_MODEL + "\r", DEFAULT_MODEL + "\x00"):
        resp = httpx.post(daemon.url + "/v1/embed", json={"model": name, "inputs": ["a"]}, timeout=60)
        assert 400 <= resp.status_code < 500 and error_of(resp)["code"] in ("bad_request", "model_not_found")
    for encoded in (DEFAULT_MODEL + "%0A", DEFAULT_MODEL + "%0D", DEFAULT_MODEL + "%00"):
        resp = httpx.post(daemon.url + f"/v1/models/{encoded}/pin", headers=daemon.admin, timeout=60)
        assert 400 <= resp.status_code < 500, (encoded, resp.status_code, resp.text)
    listed = [m["id"] for m in httpx.get(daemon.url + "/v1/models", timeout=30).json()["data"]]
    assert all(name.isprintable() for name in listed)


# ---- 5: keys, and errors that name models, never paths --------------------------------

@pytest.mark.parametrize("key", [" " * 16, "a" * 16, "ab" * 10])
def test_weak_key_is_refused_for_an_exposed_bind(tmp_path, key):
    env = {**os.environ, "FLEET_HOME": str(tmp_path), "FLEET_API_KEY": key, "FLEET_PORT": str(free_port())}
    env.pop("FLEET_API_KEY_FILE", None)
    out = subprocess.run([sys.executable, "-m", "fleetctl", "serve", "--host", "0.0.0.0"], env=env,
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "weak API key" in out.stderr


def test_cli_reads_the_key_file(tmp_path, monkeypatch):
    from fleetctl.client import Client

    key_file = tmp_path / "api_key"
    key_file.write_text("k3y-from-a-credential-file-0123\n")
    monkeypatch.delenv("FLEET_API_KEY", raising=False)
    monkeypatch.setenv("FLEET_API_KEY_FILE", str(key_file))
    with Client("http://127.0.0.1:9") as client:
        assert client.headers["Authorization"] == "Bearer k3y-from-a-credential-file-0123"
    monkeypatch.setenv("FLEET_API_KEY", "env-key-wins-0123456789")
    with Client("http://127.0.0.1:9") as client:
        assert client.headers["Authorization"] == "Bearer env-key-wins-0123456789"


def test_errors_name_models_not_paths(daemon, tmp_path):
    for path, body in (("/v1/embed", {"inputs": ["a"]}), ("/v1/rerank", {"query": "q", "documents": ["d"]})):
        resp = httpx.post(daemon.url + path, json={"model": "no-such-model", **body}, timeout=60)
        assert resp.status_code == 404
        message = error_of(resp)["message"]
        assert "no-such-model" in message and str(daemon.home) not in message and "/" not in message
    resp = httpx.post(daemon.url + "/v1/models/no-such-model/load", headers=daemon.admin, timeout=60)
    assert resp.status_code == 404 and str(daemon.home) not in resp.text
    # A stored model that fails to load: the loader's error quotes its folder.
    src = copy_default_model(tmp_path / "broken-src")
    (src / "config.json").write_text('{"architectures": ["NoSuchModel"]}')
    # Removed at once: the session's daemon is shared, and a second embed model would
    # make every request without `model` ambiguous for the tests after this one.
    live = Store(daemon.home / "models")
    pull_model(live, f"path:{src}", name="broken-model", task="embed", runtime="sentence-transformers")
    try:
        resp = httpx.post(daemon.url + "/v1/models/broken-model/load", headers=daemon.admin, timeout=120)
    finally:
        live.remove("broken-model")
    assert resp.status_code >= 400, resp.text
    message = error_of(resp)["message"]
    assert "broken-model" in message and str(daemon.home) not in message, message
    # The store's own errors, which the daemon passes on: a damaged model.
    store = Store(tmp_path / "models")
    pull_model(store, f"path:{copy_default_model(tmp_path / 'src')}", name="damaged")
    (store.path("damaged") / "vocab.txt").unlink()
    with pytest.raises(IntegrityError) as info:
        store.verify("damaged")
    assert str(tmp_path) not in info.value.message and "damaged" in info.value.message
    with pytest.raises(ModelNotFound) as missing:
        store.get("absent")
    assert str(tmp_path) not in missing.value.message


# ---- 6: store files ----------------------------------------------------------------------

def test_store_files_are_0640_owned_by_us_and_only_what_a_runtime_reads(tmp_path):
    src = copy_default_model(tmp_path / "src")
    for p in src.rglob("*"):
        p.chmod(0o777 if p.is_dir() else 0o666)  # the loosest source: its modes must not carry over
    (src / "run_me.py").write_text("print('hi')\n")
    (src / "logo.png").write_bytes(b"\x89PNG")
    old = os.umask(0o002)
    try:
        store = Store(tmp_path / "home" / "models")
        result = pull_model(store, f"path:{src}", name="modes")
    finally:
        os.umask(old)
    stored = store.path("modes")
    files = [p for p in stored.rglob("*") if p.is_file()]
    assert files and {p.name for p in files} >= {"manifest.json", "model.safetensors", "vocab.txt"}
    for p in files:
        st = p.stat()
        assert stat.S_IMODE(st.st_mode) & ~0o640 == 0, (p, oct(st.st_mode))
        assert st.st_uid == os.getuid()
    for d in [stored, *(p for p in stored.rglob("*") if p.is_dir())]:
        assert stat.S_IMODE(d.stat().st_mode) & 0o007 == 0, (d, oct(d.stat().st_mode))
    names = {f.path for f in result.manifest.files}
    assert not names & {"README.md", "run_me.py", "logo.png"}
    assert {"README.md", "run_me.py", "logo.png"} <= set(result.skipped)


# ---- 7: metrics labels ---------------------------------------------------------------------

def test_junk_model_names_share_one_metrics_label(daemon):
    for i in range(300):
        httpx.post(daemon.url + "/v1/embed", json={"model": f"junk-{i}", "inputs": ["a"]}, timeout=30)
    assert httpx.post(daemon.url + "/v1/embed", json={"model": DEFAULT_MODEL, "inputs": ["a"]},
                      timeout=60).status_code == 200
    text = httpx.get(daemon.url + "/metrics", timeout=30).text
    models = {s.labels["model"] for fam in text_string_to_metric_families(text) if fam.name == "fleet_requests"
              for s in fam.samples if "model" in s.labels}
    assert DEFAULT_MODEL in models  # a stored model keeps its own series after 300 junk names
    assert not any(m.startswith("junk-") for m in models)
    unknown = sum(s.value for fam in text_string_to_metric_families(text) if fam.name == "fleet_requests"
                  for s in fam.samples if s.name == "fleet_requests_total" and s.labels.get("model") == "_unknown")
    assert unknown >= 300
