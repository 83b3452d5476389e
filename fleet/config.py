"""Settings, in one place, with the FLEET_ prefix.

Precedence (highest first): command-line flags (passed as overrides), FLEET_*
environment variables, `FLEET_HOME/config.toml`, the defaults below.
Units are in the names: *_ms, *_bytes, *_s.
"""

from __future__ import annotations

import os
import socket
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from fleet.errors import BadRequest
from fleet.quotas import OwnerQuota

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7744
DEFAULT_MODEL = "all-minilm-l6-v2"


class UpstreamConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One `[[upstream]]` of config.toml: a server this box may send a model's requests
    to (daemon/upstreams.py): another fleet box, or any OpenAI-compatible server.
    Its key comes from a file or the environment, never the command line."""

    #: Its name in `X-Served-By: upstream/<name>`, metrics and `top`.
    name: str
    #: fleet: the box's base URL (`http://box-b:7744`); openai: the API's base URL
    #: as OpenAI clients take it (`https://host/v1`).
    url: str
    kind: Literal["fleet", "openai"] = "fleet"
    #: A file holding its bearer key (read at start and on SIGHUP), or the name of an
    #: environment variable holding it; neither: requests go without a key.
    key_file: str = ""
    key_env: str = ""


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    home: str = ""
    #: This daemon's name in X-Served-By and cluster views; default: the host name.
    box: str = ""
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    #: Number of worker processes; 0 = one per GPU, or one CPU worker without a GPU.
    workers: int = 0
    #: auto | cpu | cuda:K
    device: str = "auto"
    api_key: str = ""
    api_key_file: str = ""
    #: Who may change the daemon (pins, load/unload, Ollama's pull, delete, copy, create,
    #: blobs): "key" = only requests carrying the admin key (fleet.admin), which the
    #: daemon writes on first start to `admin_key_file` (default FLEET_HOME/admin.key,
    #: mode 0600) and `fleetctl` sends on its own; "open" = anyone who may call the
    #: daemon (a box with one user). Inference stays open either way.
    admin: Literal["key", "open"] = "key"
    admin_key_file: str = ""
    #: Names this daemon is reached by besides its bind address (and, on a loopback
    #: bind, the loopback names): any other `Host` is refused, so a web page cannot
    #: reach a loopback daemon through DNS rebinding. A wildcard bind accepts any Host
    #: unless names are listed here.
    allowed_hosts: list[str] = msgspec.field(default_factory=list)
    #: Browser origins allowed to call the API cross-origin (exact, or with `*`
    #: wildcards: "https://*.example.com"); loopback origins are always allowed.
    cors_origins: list[str] = msgspec.field(default_factory=list)
    #: A connection must deliver a request's headers within this time (from
    #: connecting or from its previous response), and its body at 1 KiB/s or more
    #: over each `body_timeout_ms` window; slower ones are closed (slowloris).
    header_timeout_ms: int = 10_000
    body_timeout_ms: int = 10_000
    #: The most bytes a request's head (request line and headers) may take; past it the
    #: answer is 431 and the rest is never parsed or kept (a bearer token and a few
    #: cookies take a few KiB; a 32 MB header once held 32 MB per connection).
    max_header_bytes: int = 64 << 10
    #: An idle keep-alive connection is closed after this long. Longer than the idle
    #: expiry of common clients (httpx 5 s, aiohttp 15 s, Go 90 s, load balancers
    #: 60 s): a client whose own expiry equals the server's sends its next request
    #: into the server's close and gets a reset. Idle connections are the first
    #: closed at the connection caps, so a long wait costs no capacity.
    keep_alive_timeout_ms: int = 120_000
    #: Open connections, in all (lowered to fit RLIMIT_NOFILE) and per client address
    #: (bench's load generator opens up to 512); at a cap a new connection closes the
    #: oldest idle one (waiting for headers or kept alive), else it is refused (503).
    max_connections: int = 1024
    max_connections_per_client: int = 512
    #: NATS server URL(s), comma-separated: set, the daemon joins the cluster (daemon/cluster.py).
    nats: str = ""
    #: NATS auth and TLS, passed through to the client: a .creds file (JWT + nkey seed), or
    #: an nkey seed file (a user the server's config lists by its public nkey), or a token,
    #: or user/password; a CA to verify the server, a client cert/key for mTLS. `serve`
    #: exits 1 when every server it reaches refuses them (daemon.cluster.check_access).
    nats_creds_file: str = ""
    nats_nkey_file: str = ""
    nats_token: str = ""
    nats_user: str = ""
    nats_password: str = ""
    nats_tls_ca: str = ""
    nats_tls_cert: str = ""
    nats_tls_key: str = ""
    #: Request bodies larger than this travel through the JetStream object store (the
    #: work message carries a reference); smaller ones travel inline.
    nats_large_payload_bytes: int = 1 << 20
    #: A box that holds a work message this long without answering or extending it
    #: (it died) loses it: JetStream redelivers it to another box. A live box extends
    #: what it holds every third of this (`in_progress`), so this is how fast a dead
    #: box is noticed; `serve` refuses a value over a third of `timeout_ms` (redelivery
    #: must leave another box time to answer before the deadline).
    nats_ack_wait_ms: int = 5_000
    #: Work messages one box holds at most (fetched, not yet answered) per worker: the
    #: box's free capacity is this times its workers, minus what it holds, shared by
    #: the pullers of all its models (one fetch credit per box).
    nats_fetch_per_worker: int = 32
    #: Work messages waiting in JetStream (all models) past which requests answer `overloaded`.
    nats_max_queued: int = 100_000
    #: Deliveries of one work message (each box death redelivers it) before it is failed as poison.
    nats_max_deliver: int = 10
    #: Period of this box's entry in the `fleet_boxes` KV bucket; entries expire after 3 periods.
    nats_heartbeat_ms: int = 2_000
    #: Copies JetStream keeps of the work and reply streams, the object store and the box
    #: bucket (1-5). 0: 3 on a NATS cluster that can place three (three JetStream servers
    #: or more), else 1; an existing stream with fewer is raised in place, never lowered.
    nats_replicas: int = 0
    #: Models loaded at start-up and kept resident (besides persisted pins);
    #: FLEET_PRELOAD="" (or `preload = []`) preloads none.
    preload: list[str] = msgspec.field(default_factory=lambda: [DEFAULT_MODEL])
    #: The model a request without `model` runs on, per task (`{embed = "all-minilm-l6-v2"}`;
    #: FLEET_DEFAULT_MODELS="embed=NAME,rerank=NAME"). A task not listed falls back to its
    #: only stored model; with several stored, the request must name one.
    default_models: dict[str, str] = msgspec.field(default_factory=dict)
    max_body_bytes: int = 16 << 20
    max_inputs: int = 2048
    #: Bytes of per-token vectors one reply may carry (`output: "tokens"`, TEI `/embed_all`):
    #: tokens x the model's width x bytes a value takes (4 in MessagePack, ~21 as JSON
    #: text); refused (413) before the work when the estimate is over, and before the
    #: reply is built when the worker's exact answer is. Building a JSON reply holds
    #: about twice this in the API process. 0 = no bound.
    max_token_vector_bytes: int = 128 << 20
    #: Text the API process itself tokenizes for one request (TEI `/tokenize`), in UTF-8
    #: bytes over all its inputs; more is refused (413) before any is tokenized. While
    #: tokenized, a text takes ~250x its size in memory (~500 bytes per token in the Rust
    #: encoding, ~300 in TEI's reply objects): 256 KiB is ~65 MiB, about 50 000 words.
    max_tokenize_bytes: int = 256 << 10
    #: Token ids one request may send in place of text (OpenAI `input`, TEI `inputs`), all
    #: inputs together (OpenAI's own bound per request); the API process decodes them to text.
    max_token_ids: int = 300_000
    #: Tokens one request's inputs may come to, as its model reads them (~4 characters a
    #: token plus special tokens per input, each at most the model's max_seq_len when it
    #: cuts): past this, 413 naming this setting, before anything is queued. OpenAI's
    #: bound per embeddings request. A request over one batch's work runs as pieces that
    #: other requests pass between (daemon.pieces); 0 = no bound.
    max_request_tokens: int = 300_000
    timeout_ms: int = 30_000
    #: Shared-memory queue geometry.
    queue_slots: int = 16384
    queue_slab_bytes: int = 256 << 20
    #: Items queued (not yet claimed) past which the API answers `overloaded`.
    queue_max_depth: int = 8192
    #: Lease a worker holds on claimed items; renewed while it runs.
    lease_ms: int = 10_000
    #: Attempts (claims that ended in a lost lease) before an item is failed as poison.
    max_attempts: int = 3
    #: How long a worker lingers for more items when its lane is nearly empty
    #: (the default for models whose profile sets no linger_ms).
    linger_ms: float = 0.0
    #: A lane whose oldest item has waited this long is served next by any worker,
    #: whatever models it holds (bounded wait: no lane starves).
    lane_max_wait_ms: int = 2_000
    #: Batch time a worker aims for: its cost model, fitted from its own batch
    #: times, caps a batch's padded tokens to fit (0 = only the profile's budget);
    #: a lane whose head has waited longer than this is behind and aims for
    #: 8 targets (runtimes.policy.behind).
    batch_target_ms: float = 250.0
    log_level: str = "info"
    #: One line per HTTP request in the log (daemon.access: method, route, model, status,
    #: ms, client); `false` turns it off (live on SIGHUP).
    access_log: bool = True
    #: Intra-op threads for CPU workers; 0 = torch's default.
    cpu_threads: int = 0
    #: Memory budget of the CPU device for models (bytes); 0 = `cpu_budget_fraction`
    #: of the RAM available when the worker starts.
    cpu_budget_bytes: int = 0
    cpu_budget_fraction: float = 0.5
    #: RAM a CPU load must leave available to the rest of the box (bytes).
    cpu_reserve_bytes: int = 256 << 20
    #: GPU memory never given to models (CUDA context, allocator slack), per GPU (bytes).
    gpu_reserve_bytes: int = 512 << 20
    #: How long an admin load / pin call waits for the worker's answer.
    load_timeout_ms: int = 300_000
    #: On SIGTERM, how long requests in flight may take to finish; those still
    #: unanswered then get `unavailable` (503) and the workers stop (each finishes its batch).
    drain_timeout_ms: int = 10_000
    #: Offline jobs (the Files and Batches API, daemon/batches.py): the largest input
    #: file a `POST /v1/files` takes, and its most request lines.
    batch_max_file_bytes: int = 4 << 30
    batch_max_lines: int = 1_000_000
    #: Bytes all batch files (uploads and results) may take together: an upload that
    #: would pass it is refused (507 insufficient_storage). 0 = a quarter of the disk
    #: that holds FLEET_HOME, so clients of the API never fill the box's disk.
    batch_files_max_bytes: int = 0
    #: Input, output and error files of batches are deleted this long after they were
    #: created (OpenAI's default for batch files; a file's own `expires_after` wins).
    batch_retention_days: float = 30.0
    #: A batch line queued this long behind interactive work is promoted to
    #: interactive (its starvation bound; 0 = never).
    batch_max_wait_ms: int = 60_000
    #: Lines of all running batches in flight at once, and their request bytes:
    #: enough to keep every worker's batches full, bounded so batches never fill the
    #: queue (`queue_max_depth`) or the API process's memory.
    batch_inflight: int = 512
    batch_inflight_bytes: int = 64 << 20
    #: Blobs uploaded for `ollama create` (`POST /api/blobs`, fleet.blobs) that no stored
    #: model holds are removed this long after their last use (upload, HEAD, create).
    blob_keep_ms: int = 3_600_000
    #: Models the store may hold: a copy, create or pull through the API that would add
    #: one past this is refused (507 insufficient_storage). A copy shares its original's
    #: files (hard links), so this bounds what copies make: directories and manifests.
    store_max_models: int = 1000
    #: Quotas per owner (fleet.quotas): `[owners.NAME]` with `models_match` (the model names
    #: that are the owner's, shell patterns), `models`, `adapters` and `resident_bytes`
    #: (0 = no bound). Past one, a pull, copy, create or load is refused 507 `quota_exceeded`.
    owners: dict[str, OwnerQuota] = msgspec.field(default_factory=dict)
    #: Upstreams (`[[upstream]]` tables): where a model whose catalog entry says
    #: `route = "spill"` or `"remote"` sends requests (daemon/upstreams.py).
    upstream: list[UpstreamConfig] = msgspec.field(default_factory=list)
    #: An upstream that failed (no answer, or 503) is left alone this long (circuit).
    upstream_down_ms: int = 10_000

    @property
    def home_path(self) -> Path:
        return Path(self.home)

    @property
    def store_path(self) -> Path:
        return Path(self.home) / "models"

    @property
    def box_name(self) -> str:
        return self.box or socket.gethostname().split(".")[0]

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"


def default_home() -> str:
    env = os.environ.get("FLEET_HOME")
    if env:
        return env
    base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return os.path.join(base, "fleet")


_FIELDS = {f for f in Settings.__struct_fields__}
#: Settings that are lists, written comma-separated in a FLEET_* variable.
_LISTS = ("preload", "allowed_hosts", "cors_origins")


def env_value(field: str) -> str | None:
    """The FLEET_* variable of a setting, or None where it does not set it. An
    empty one is unset, except for a list: an empty FLEET_PRELOAD preloads
    nothing (unset, the default model)."""
    raw = os.environ.get("FLEET_" + field.upper())
    return None if raw is None or (raw == "" and field not in _LISTS) else raw


def _env_overrides() -> dict[str, Any]:
    return {field: raw for field in _FIELDS if (raw := env_value(field)) is not None}


def load_settings(**overrides: Any) -> Settings:
    """Settings for this process: defaults < config.toml < FLEET_* env < overrides."""
    home = overrides.get("home") or default_home()
    merged: dict[str, Any] = {}
    cfg = Path(home) / "config.toml"
    if cfg.is_file():
        try:
            with cfg.open("rb") as f:
                merged.update(tomllib.load(f))
        except tomllib.TOMLDecodeError as exc:
            raise BadRequest(f"{cfg} is not valid TOML: {exc}",
                             hint=f"fix it, or move it away: mv {cfg} {cfg}.bad") from None
        except OSError as exc:
            raise BadRequest(f"cannot read {cfg}: {exc.strerror}") from None
    merged.update(_env_overrides())
    merged.update({k: v for k, v in overrides.items() if v is not None})
    merged["home"] = home
    for key in _LISTS:
        if isinstance(merged.get(key), str):
            merged[key] = [p.strip() for p in merged[key].split(",") if p.strip()]
    if isinstance(merged.get("default_models"), str):
        pairs = (p.partition("=") for p in merged["default_models"].split(","))
        merged["default_models"] = {task.strip(): name.strip() for task, _, name in pairs if task.strip()}
    # strict=False lets env strings ("8", "true") convert to the field types.
    try:
        settings = msgspec.convert(merged, Settings, strict=False)
    except msgspec.ValidationError as exc:
        keys = ", ".join(f for f in Settings.__struct_fields__ if f != "home")
        raise BadRequest(f"bad setting in {cfg} or a FLEET_* variable: {exc}",
                         hint=f"valid keys: {keys}" if "unknown field" in str(exc) else None) from None
    if settings.api_key_file and not settings.api_key:
        try:
            settings.api_key = Path(settings.api_key_file).read_text().strip()
        except OSError as exc:
            raise BadRequest(f"cannot read {settings.api_key_file}: {exc.strerror}",
                             hint="check api_key_file / FLEET_API_KEY_FILE") from None
    return settings


#: The running daemon's lock file under FLEET_HOME, holding `{pid, url}` (daemon.home).
DAEMON_LOCK = Path("run") / "daemon.lock"


def client_url() -> str:
    """Where the CLI finds the daemon (`client_url_source`)."""
    return client_url_source()[0]


def client_url_source() -> tuple[str, str]:
    """(URL, where it came from): FLEET_URL ("env"); else FLEET_HOME's config.toml or
    FLEET_HOST/FLEET_PORT when they set the host or port ("config"); else the URL in
    the lock file of the daemon running on this FLEET_HOME ("lock file"); else the
    default bind ("default")."""
    env = os.environ.get("FLEET_URL")
    if env:
        return env, "env"
    home = Path(default_home())
    cfg = home / "config.toml"
    configured = bool(os.environ.get("FLEET_HOST") or os.environ.get("FLEET_PORT"))
    if not configured and cfg.is_file():
        try:
            with cfg.open("rb") as f:
                configured = bool({"host", "port"} & set(tomllib.load(f)))
        except (tomllib.TOMLDecodeError, OSError):
            configured = True  # load_settings says what is wrong with it, in one line
    if configured:
        return load_settings(home=str(home)).url, "config"
    holder = live_daemon(home)
    if holder is not None:
        return holder[1], "lock file"
    return f"http://{DEFAULT_HOST}:{DEFAULT_PORT}", "default"


def live_daemon(home: str | Path) -> tuple[int, str] | None:
    """(pid, URL) of the daemon running on FLEET_HOME `home`, from its lock file; None
    when none runs (the lock file outlives its daemon: only a live pid counts)."""
    try:
        holder = msgspec.json.decode((Path(home) / DAEMON_LOCK).read_bytes())
        pid = int(holder["pid"])
        os.kill(pid, 0)
        return pid, str(holder["url"])
    except (OSError, ValueError, KeyError, TypeError, msgspec.DecodeError):
        return None
