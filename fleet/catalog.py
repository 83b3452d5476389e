"""The model catalog: which models fleet knows, where they come from, how to serve them.

The shipped `models.toml` (next to this file) is loaded first, then
`FLEET_HOME/models.toml` is overlaid on it: a user table with a shipped name
replaces only the keys it sets (its `profile` table merges key by key), so a
tuned profile can be written without repeating the entry; a new name adds an
entry. Every name that can become a store path is checked by `validate_name`.

Tuned profiles (`fleetctl tune`): `[models."<name>".profiles."<device class>"]`
holds a profile for one device class (`runtimes.device.device_class`: e.g.
`cpu-avx512bf16`, `cuda-sm90`); keys it does not set come from the entry's
`profile` (so an older one without `engine` takes the entry's: "auto" as
shipped); `fleetctl tune` names the engine with the dtype it measured.
`[models."<name>".tuned."<device class>"]` records how it was measured (date,
versions, knee, the load-time engine choice it held). `select_profile` is what a
worker uses: the profile of its device class, else `profile` (reported as "default").

This module is imported by `fleetctl --help` and by the API process: it must
stay free of heavy imports (STYLE.md 7).
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from fleet.calibration import Calibration, check_temperatures
from fleet.errors import BadRequest, ModelNotFound
from fleet.files import replace_file

Task = Literal["embed", "rerank", "classify", "extract", "generate", "decide"]
#: LLM rerankers' prompt formats (runtimes/adapters/llm_rerank.FORMATS).
RerankPrompt = Literal["qwen3", "mxbai-v2"]
#: sentence-transformers' pooling modes (1_Pooling/config.json), as catalog facts.
Pooling = Literal["cls", "mean", "max", "lasttoken", "weightedmean", "mean_sqrt_len_tokens"]
Positive = Annotated[int, msgspec.Meta(ge=1)]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
TASKS: tuple[str, ...] = ("embed", "rerank", "classify", "extract", "generate", "decide")
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
#: What runs an encoder's forward (runtimes/adapters/engines.py): `auto` measures at load.
Engine = Literal["auto", "torch", "openvino"]
#: Where a model's requests run (daemon/upstreams.py): here; here unless this box's
#: queue would make them wait past `spill_after_ms` or the model cannot load here
#: (then an upstream of config.toml); always an upstream.
Route = Literal["local", "spill", "remote"]

#: Lowercase, starts with a letter or digit, then letters, digits, `.`, `_`, `-`;
#: at most 128 characters. No slashes, so a name is always one path component;
#: `..` is refused separately (it matches the character class). Patterns end in
#: `\Z`, not `$`: `$` also matches before a final newline, and `nl` and `nl\n`
#: would be two store entries that list alike.
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}\Z")
#: Runtime names are registry keys (runtimes/), same alphabet as model names.
RUNTIME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}\Z")
SOURCE_KINDS: tuple[str, ...] = ("hf", "path", "pkg")
#: `ORG/NAME` on the hub (its own rules are looser than ours; this is enough to
#: keep the id a plain two-part path).
_HF_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*\Z")
_HF_REV_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,255}\Z")
_PKG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9._-]+)*\Z")

SHIPPED_CATALOG = Path(__file__).with_name("models.toml")


def validate_name(name: str) -> str:
    """Return `name` if it is a valid model name, else raise `BadRequest`."""
    if not isinstance(name, str) or not NAME_RE.match(name) or ".." in name:
        raise BadRequest(
            f"invalid model name {name!r}: use 1-128 lowercase letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (no '/', no '..')",
            hint="pick another name with --name",
        )
    return name


def derive_name(text: str) -> str:
    """A valid model name from a source's last path component (`BAAI/bge-small` -> `bge-small`)."""
    last = text.rstrip("/").rsplit("/", 1)[-1].lower()
    cleaned = re.sub(r"[^a-z0-9._-]+", "-", last)
    cleaned = re.sub(r"\.{2,}", ".", cleaned).lstrip("._-")[:128].rstrip("._-")
    if not cleaned:
        raise BadRequest(f"cannot derive a model name from {text!r}", hint="pass --name NAME")
    return validate_name(cleaned)


class Source(msgspec.Struct, frozen=True):
    """A parsed `models.toml` source: `hf:ORG/NAME[@REV]`, `path:DIR` or `pkg:PACKAGE[/SUBDIR]`."""

    kind: str
    ref: str
    revision: str | None = None

    def __str__(self) -> str:
        return f"{self.kind}:{self.ref}" + (f"@{self.revision}" if self.revision else "")

    @property
    def unpinned(self) -> str:
        return f"{self.kind}:{self.ref}"


def parse_source(text: str) -> Source:
    kind, sep, rest = text.partition(":")
    if not sep or kind not in SOURCE_KINDS or not rest:
        raise BadRequest(
            f"invalid source {text!r}: expected hf:ORG/NAME[@REV], path:DIR or pkg:PACKAGE",
            hint="or pass a catalog name (see `fleetctl list --catalog`)",
        )
    if kind == "hf":
        repo, at, rev = rest.partition("@")
        if not _HF_REPO_RE.match(repo) or ".." in repo:
            raise BadRequest(f"invalid hub id {repo!r} in {text!r}: expected ORG/NAME")
        if at and (not _HF_REV_RE.match(rev) or ".." in rev):
            raise BadRequest(f"invalid revision {rev!r} in {text!r}")
        return Source("hf", repo, rev or None)
    if kind == "pkg":
        if not _PKG_RE.match(rest) or ".." in rest:
            raise BadRequest(f"invalid package {rest!r} in {text!r}: expected PACKAGE or PACKAGE/SUBDIR")
        return Source("pkg", rest)
    return Source("path", rest)


class Profile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How a worker batches and runs one model (the worker's budget, per claim)."""

    #: Items per batch, at most.
    max_batch_items: int = 64
    #: Padded tokens per batch (items x longest item), at most.
    max_batch_tokens: int = 16384
    dtype: Dtype = "auto"
    #: torch or OpenVINO (CPU encoders); `auto`: the fastest that agrees with torch
    #: fp32, measured at load (runtimes/adapters/engines.py). With `dtype`, forces the choice.
    engine: Engine = "auto"
    #: How long a worker waits for more items of this model before running a
    #: short batch, in milliseconds.
    linger_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.max_batch_items < 1 or self.max_batch_tokens < 1 or self.linger_ms < 0:
            raise ValueError("max_batch_items and max_batch_tokens must be >= 1 and linger_ms >= 0")


class TunedInfo(msgspec.Struct, kw_only=True):
    """How a per-device-class profile was measured (`fleetctl tune --write`).

    Throughputs are input tokens/s (output tokens/s for generators) at the
    bench's knee; `baseline_*` is the entry's default profile in the same run.
    """

    tuned_at: str
    knee_tokens_per_s: float
    knee_p95_ms: float
    knee_rps: float = 0.0
    baseline_tokens_per_s: float | None = None
    #: Worker processes / intra-op threads per worker the knee was measured with
    #: (daemon settings, FLEET_WORKERS / FLEET_CPU_THREADS: not applied from here).
    workers: int = 1
    cpu_threads: int = 0
    #: How the dtype was checked against fp32 (the load-time check's own words).
    dtype_check: str = ""
    #: The engine and dtype the default profile's load chose ("openvino bfloat16"): the
    #: engine every candidate named (the profile's `engine`), how it was chosen
    #: ("measured", "cached", "only", ...: runtimes/adapters/engines.py), its load-time tokens/s,
    #: and each engine's load-time timings or why it was refused. "" / None / {}: an
    #: older tune, or a load that weighed no engines.
    engine_choice: str = ""
    engine_by: str = ""
    engine_tokens_per_s: float | None = None
    engine_table: dict[str, str] = msgspec.field(default_factory=dict)
    candidates: int = 0
    budget_minutes: float = 0.0
    versions: dict[str, str] = msgspec.field(default_factory=dict)


class CatalogEntry(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    source: str
    task: Task
    runtime: str
    #: LoRA adapters: the name of the base model (its own catalog/store entry).
    base: str | None = None
    trust_remote_code: bool = False
    allow_pickle: bool = False
    #: Tokens per input the model accepts; None = the model's own config decides.
    max_seq_len: int | None = None
    #: Zero-shot extraction (runtime gliner): the score a span must exceed; None = 0.5.
    threshold: float | None = None
    profile: Profile = msgspec.field(default_factory=Profile)
    #: Device class -> tuned profile (missing keys filled from `profile` at load).
    profiles: dict[str, Profile] = msgspec.field(default_factory=dict)
    #: Device class -> how its profile was measured.
    tuned: dict[str, TunedInfo] = msgspec.field(default_factory=dict)
    #: Decision models: temperatures per question kind and option-count bucket, and
    #: where they came from (`fleetctl calibrate`, fleet.calibration); None: 1.0 everywhere.
    calibration: Calibration | None = None
    #: Embedders: instruction prompts by name (sentence-transformers' `prompts`), over
    #: those in the model's own config_sentence_transformers.json (a name set here wins).
    prompts: dict[str, str] | None = None
    #: The prompt a request gets when it names none (default: the folder's, else none).
    default_prompt_name: str | None = None
    #: LLM rerankers (runtime llm-rerank): the prompt format (None = qwen3), the
    #: instruction a request gets when it sends none (None = the format's), the
    #: answer tokens, vocabulary entries (None = the format's: yes/no, 1/0).
    prompt_format: RerankPrompt | None = None
    default_instruction: str | None = None
    true_token: str | None = None
    false_token: str | None = None
    #: Embedders: the widths the model was trained to be cut to (Matryoshka), largest
    #: first; None = unknown. Informational: a request may ask any `dimensions` up to
    #: the model's width, as sentence-transformers' `truncate_dim` and OpenAI allow.
    matryoshka_dims: list[int] | None = None
    #: Or, for models trained for any width in a range: [smallest, largest]. Informational too.
    matryoshka_range: tuple[int, int] | None = None
    # Facts from the model's card and hub repository: shown by `fleetctl list --catalog`
    # and the models table of docs/models.md, never applied (the model's folder decides how it
    # runs). A fact nobody could check is left out and reads "unknown".
    #: config.json `model_type`: the architecture tests/arch_models.PARITY proves.
    model_type: str | None = None
    #: Embedders: how token vectors are pooled (the folder's 1_Pooling/config.json).
    pooling: Pooling | None = None
    #: Embedders: the width of the vectors.
    dimensions: Positive | None = None
    #: The licence as the hub's `license:` tag names it (apache-2.0, mit, gemma, ...).
    license: str | None = None
    #: Parameter count.
    params: Positive | None = None
    #: Bytes of weights a pull downloads (approximate: from the card or hub listing).
    size_bytes: Positive | None = None
    #: The hub asks for its terms to be accepted first (a pull needs HF_TOKEN).
    gated: bool = False
    #: What to know before deploying it, in a line.
    note: str | None = None
    #: Upstreams (config.toml `[[upstream]]`, daemon/upstreams.py): where its requests run.
    route: Route = "local"
    #: `spill`: the local queue's expected wait (ms) past which a request goes upstream.
    spill_after_ms: Positive = 1000
    #: The upstream to use (its `name`); None: each configured one, in order.
    upstream: str | None = None
    #: The model's name there (an OpenAI-compatible server's own name); None: the same name.
    upstream_model: str | None = None

    @property
    def parsed_source(self) -> Source:
        return parse_source(self.source)


def select_profile(entry: CatalogEntry, device_class: str) -> tuple[Profile, str]:
    """(profile, key) a worker of `device_class` serves `entry` with: the tuned
    profile of that class, else the entry's default profile (key "default")."""
    tuned = entry.profiles.get(device_class)
    if tuned is not None:
        return tuned, device_class
    return entry.profile, "default"


#: Where a live profile setting came from (`profile_sources`): the shipped catalog's
#: `profile`, a tuned device-class profile (shipped, or `fleetctl tune --write`), the
#: user's `FLEET_HOME/models.toml` `profile`, the manifest (no catalog entry), or the
#: built-in default (set nowhere).
PROFILE_SOURCES = ("shipped", "tuned", "config", "manifest", "default")


def profile_sources(home: str | Path, name: str, device_class: str, *,
                    shipped: Path | None = None) -> dict[str, str]:
    """Per `Profile` setting, where the value `select_profile` gives a worker of
    `device_class` came from (PROFILE_SOURCES), by the precedence of `_merge`: the
    user's own tuned class wins, then the user's `profile` keys, then a shipped tuned
    class, then the shipped `profile`. Reads the two files' tables, not the merged entry."""
    shipped_tables = _read_toml(shipped or SHIPPED_CATALOG)
    user_path = Path(home) / "models.toml"
    user_tables = _read_toml(user_path) if user_path.is_file() else {}
    ship, user = shipped_tables.get(name), user_tables.get(name)
    keys = Profile.__struct_fields__
    if not isinstance(ship, dict) and not isinstance(user, dict):
        return dict.fromkeys(keys, "manifest")

    def table(t: Any, *path: str) -> dict[str, Any]:
        for key in path:
            t = t.get(key) if isinstance(t, dict) else None
        return t if isinstance(t, dict) else {}

    user_tuned, ship_tuned = table(user, "profiles", device_class), table(ship, "profiles", device_class)
    out = {}
    for key in keys:
        if key in user_tuned:
            out[key] = "tuned"
        elif key in table(user, "profile"):
            out[key] = "config"
        elif not user_tuned and key in ship_tuned:
            out[key] = "tuned"
        elif key in table(ship, "profile"):
            out[key] = "shipped"
        else:
            out[key] = "default"
    return out


class Catalog:
    """Entries by name, shipped file first, user overlay second."""

    def __init__(self, entries: dict[str, CatalogEntry], files: list[Path]) -> None:
        self._entries = entries
        #: The files this catalog was read from, in load order (for messages).
        self.files = files

    def get(self, name: str) -> CatalogEntry:
        validate_name(name)
        entry = self._entries.get(name)
        if entry is None:
            raise ModelNotFound(
                f"unknown model {name!r}: not in the catalog",
                hint="see `fleetctl list --catalog` or models.toml; pull a folder with "
                "`fleetctl pull path:DIR --name NAME`",
            )
        return entry

    def find(self, name: str) -> CatalogEntry | None:
        return self._entries.get(name)

    def all(self) -> list[CatalogEntry]:
        return sorted(self._entries.values(), key=lambda e: e.name)

    def find_by_source(self, source: Source) -> CatalogEntry | None:
        """The entry whose source names the same repo/folder/package (revision ignored)."""
        want = _source_key(source)
        for entry in self.all():
            if _source_key(entry.parsed_source) == want:
                return entry
        return None

    def __contains__(self, name: object) -> bool:
        return name in self._entries


def _source_key(source: Source) -> str:
    # Hub ids are case-insensitive; folders compare as absolute paths; packages as written.
    if source.kind == "hf":
        return f"hf:{source.ref.lower()}"
    if source.kind == "path":
        return "path:" + os.path.abspath(os.path.expanduser(source.ref))
    return source.unpinned


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise BadRequest(f"{path}: not valid TOML: {exc}") from None
    models = data.get("models", {})
    unknown = set(data) - {"models"}
    if unknown or not isinstance(models, dict):
        raise BadRequest(f"{path}: expected only [models.\"<name>\"] tables, found {sorted(unknown) or 'models ='}")
    return models


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    if isinstance(top.get("profile"), dict) and isinstance(out.get("profiles"), dict):
        # Keys the user sets in `profile` are explicit choices: they win over the
        # shipped file's tuned classes too (the user's own `profiles` win over both).
        out["profiles"] = {cls: ({**prof, **top["profile"]} if isinstance(prof, dict) else prof)
                           for cls, prof in out["profiles"].items()}
    for key, value in top.items():
        if key == "profile" and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        elif key in ("profiles", "tuned") and isinstance(value, dict) and isinstance(out.get(key), dict):
            # Per device class: a class set on top replaces that class whole (a
            # tuned profile is one measured unit); other classes stay.
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _fill_profiles(table: dict[str, Any]) -> dict[str, Any]:
    """Each device class's profile with the keys it does not set taken from `profile`."""
    profiles = table.get("profiles")
    if not isinstance(profiles, dict):
        return table
    default = table.get("profile") if isinstance(table.get("profile"), dict) else {}
    filled = {cls: ({**default, **prof} if isinstance(prof, dict) else prof) for cls, prof in profiles.items()}
    return {**table, "profiles": filled}


def _entry(name: str, table: Any, origin: str) -> CatalogEntry:
    if not isinstance(table, dict):
        raise BadRequest(f"{origin}: models.{name!r} must be a table")
    where = f"{origin}: models.{name!r}"
    if not NAME_RE.match(name) or ".." in name:
        raise BadRequest(f"{where}: invalid model name (lowercase letters, digits, '.', '_', '-')")
    try:
        entry = msgspec.convert({**_fill_profiles(table), "name": name}, CatalogEntry)
    except (msgspec.ValidationError, ValueError) as exc:
        raise BadRequest(f"{where}: {exc}") from None
    try:
        _ = entry.parsed_source  # validates the source
        if entry.base is not None:
            validate_name(entry.base)
    except BadRequest as exc:
        raise BadRequest(f"{where}: {exc.message}") from None
    if not RUNTIME_RE.match(entry.runtime):
        raise BadRequest(f"{where}: invalid runtime {entry.runtime!r}")
    if entry.calibration is not None and (problems := check_temperatures(entry.calibration.temperatures)):
        raise BadRequest(f"{where}: calibration.temperatures: {'; '.join(problems)}")
    if any(d < 1 for d in entry.matryoshka_dims or ()) or (
            entry.matryoshka_range is not None and not 1 <= entry.matryoshka_range[0] <= entry.matryoshka_range[1]):
        raise BadRequest(f"{where}: matryoshka_dims and matryoshka_range take widths >= 1 (range: [smallest, largest])")
    return entry


def load_catalog(home: str | Path | None = None, *, shipped: Path = SHIPPED_CATALOG) -> Catalog:
    """The shipped catalog overlaid by `<home>/models.toml` (home defaults to FLEET_HOME)."""
    if home is None:
        from fleet.config import default_home

        home = default_home()
    tables: dict[str, tuple[dict[str, Any], str]] = {}
    files = [shipped]
    for name, table in _read_toml(shipped).items():
        tables[name] = (table, str(shipped))
    user = Path(home) / "models.toml"
    if user.is_file():
        files.append(user)
        for name, table in _read_toml(user).items():
            if not isinstance(table, dict):
                raise BadRequest(f"{user}: models.{name!r} must be a table")
            if name in tables:
                tables[name] = (_merge(tables[name][0], table), f"{shipped} + {user}")
            else:
                tables[name] = (table, str(user))
    entries = {name: _entry(name, table, origin) for name, (table, origin) in tables.items()}
    return Catalog(entries, files)


#: Device class keys (`runtimes.device.device_class`): same alphabet as runtimes.
DEVICE_CLASS_RE = RUNTIME_RE


def _toml_value(value: Any) -> str:
    """One TOML value (strings, numbers, bools, flat string tables): what tuned tables hold."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        # JSON string escapes are valid TOML basic-string escapes.
        import json

        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_value(str(k))} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def _drop_tables(text: str, headers: set[str]) -> str:
    """`text` without the tables whose header line is one of `headers` (each up to the next header)."""
    out, skipping = [], False
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith("["):
            skipping = stripped in headers
        if not skipping:
            out.append(line)
    return "".join(out)


def manifest_entry(manifest: Any) -> dict[str, Any]:
    """A catalog entry's own keys for a stored model the catalog does not know (pulled
    from a folder), from its manifest: the `new_entry` of the writers below."""
    return {"source": manifest.source, "task": manifest.task, "runtime": manifest.runtime,
            "base": manifest.base, "max_seq_len": manifest.max_seq_len,
            "trust_remote_code": manifest.trust_remote_code, "allow_pickle": manifest.allow_pickle}


def write_calibration(home: str | Path, name: str, calibration: Calibration, *,
                      new_entry: dict[str, Any] | None = None) -> Path:
    """Store a decision model's calibration in `<home>/models.toml` as its
    `[models."<name>".calibration]` table, replacing an earlier one (as
    `write_tuned_profile`, whose `new_entry` this takes too)."""
    validate_name(name)
    if problems := check_temperatures(calibration.temperatures):
        raise BadRequest("; ".join(problems))
    table = [f"{k} = {_toml_value(v)}" for k, v in msgspec.structs.asdict(calibration).items() if v is not None]
    return _write_entry_tables(home, name, {"calibration": table}, new_entry=new_entry,
                               what=f"the calibration of {name!r} (models.toml)")


def write_tuned_profile(home: str | Path, name: str, device_class: str, profile: Profile, info: TunedInfo,
                        *, new_entry: dict[str, Any] | None = None) -> Path:
    """Store a tuned profile for (`name`, `device_class`) in `<home>/models.toml`.

    The file's other tables and comments are kept; an earlier profile of the same
    name and class is replaced. A model the catalog does not know (pulled from a
    folder) needs `new_entry` (source, task, runtime, ...: its manifest's), written
    as its `[models."<name>"]` table. The new text is parsed and the merged entry
    converted before it replaces the file (temp file, then rename), so a write
    never leaves a catalog that does not load.
    """
    validate_name(name)
    if not DEVICE_CLASS_RE.match(device_class):
        raise BadRequest(f"invalid device class {device_class!r}")
    return _write_entry_tables(home, name, {
        f'profiles."{device_class}"': [f"{k} = {_toml_value(v)}" for k, v in msgspec.structs.asdict(profile).items()],
        f'tuned."{device_class}"': [f"{k} = {_toml_value(v)}" for k, v in msgspec.structs.asdict(info).items()
                                    if v is not None],
    }, new_entry=new_entry, what=f"the tuned profile of {name!r} (models.toml)")


def _write_entry_tables(home: str | Path, name: str, tables: dict[str, list[str]], *,
                        new_entry: dict[str, Any] | None, what: str) -> Path:
    """Replace (or add) `[models."<name>".<sub>]` tables in `<home>/models.toml`, each
    with its lines; the entry's own table first when neither catalog has it. The merged
    entry must convert before the file is replaced (`write_tuned_profile`)."""
    path = Path(home) / "models.toml"
    text = path.read_text() if path.is_file() else ""
    base = f'models."{name}"'
    text = _drop_tables(text, {f"[{base}.{sub}]" for sub in tables})
    if text and not text.endswith("\n"):
        text += "\n"
    body = []
    known = name in _read_toml(SHIPPED_CATALOG) or f"[{base}]" in {ln.strip() for ln in text.splitlines()}
    if not known:
        if not new_entry:
            raise ModelNotFound(f"{name!r} is not in the catalog: its entry (source, task, runtime) is needed")
        body.append(f"[{base}]")
        body += [f"{k} = {_toml_value(v)}" for k, v in new_entry.items() if v is not None]
    for sub, lines in tables.items():
        body += [f"[{base}.{sub}]", *lines]
    text += ("\n" if text else "") + "\n".join(body) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)

    def check(tmp: Path) -> None:
        user = _read_toml(tmp)
        shipped = _read_toml(SHIPPED_CATALOG)
        table = _merge(shipped[name], user[name]) if name in shipped else user[name]
        _entry(name, table, str(path))  # the merged entry must still convert

    replace_file(path, text.encode(), what=what, check=check)
    return path
