"""The model catalog: which models fleet knows, where they come from, how to serve them.

The shipped `models.toml` (next to this file) is loaded first, then
`FLEET_HOME/models.toml` is overlaid on it: a user table with a shipped name
replaces only the keys it sets (its `profile` table merges key by key), so a
tuned profile can be written without repeating the entry; a new name adds an
entry. Every name that can become a store path is checked by `validate_name`.

This module is imported by `fleetctl --help` and by the API process: it must
stay free of heavy imports (STYLE.md 7).
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from fleetctl.errors import BadRequest, ModelNotFound

Task = Literal["embed", "rerank", "classify", "extract", "generate"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
TASKS: tuple[str, ...] = ("embed", "rerank", "classify", "extract", "generate")
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")

#: Lowercase, starts with a letter or digit, then letters, digits, `.`, `_`, `-`;
#: at most 128 characters. No slashes, so a name is always one path component;
#: `..` is refused separately (it matches the character class).
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
#: Runtime names are registry keys (runtimes/), same alphabet as model names.
RUNTIME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
SOURCE_KINDS: tuple[str, ...] = ("hf", "path", "pkg")
#: `ORG/NAME` on the hub (its own rules are looser than ours; this is enough to
#: keep the id a plain two-part path).
_HF_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_HF_REV_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,255}$")
_PKG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9._-]+)*$")

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
    #: How long a worker waits for more items of this model before running a
    #: short batch, in milliseconds.
    linger_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.max_batch_items < 1 or self.max_batch_tokens < 1 or self.linger_ms < 0:
            raise ValueError("max_batch_items and max_batch_tokens must be >= 1 and linger_ms >= 0")


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
    profile: Profile = msgspec.field(default_factory=Profile)

    @property
    def parsed_source(self) -> Source:
        return parse_source(self.source)


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
    for key, value in top.items():
        if key == "profile" and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _entry(name: str, table: Any, origin: str) -> CatalogEntry:
    if not isinstance(table, dict):
        raise BadRequest(f"{origin}: models.{name!r} must be a table")
    where = f"{origin}: models.{name!r}"
    if not NAME_RE.match(name) or ".." in name:
        raise BadRequest(f"{where}: invalid model name (lowercase letters, digits, '.', '_', '-')")
    try:
        entry = msgspec.convert({**table, "name": name}, CatalogEntry)
    except (msgspec.ValidationError, ValueError) as exc:
        raise BadRequest(f"{where}: {exc}") from None
    try:
        entry.parsed_source
        if entry.base is not None:
            validate_name(entry.base)
    except BadRequest as exc:
        raise BadRequest(f"{where}: {exc.message}") from None
    if not RUNTIME_RE.match(entry.runtime):
        raise BadRequest(f"{where}: invalid runtime {entry.runtime!r}")
    return entry


def load_catalog(home: str | Path | None = None, *, shipped: Path = SHIPPED_CATALOG) -> Catalog:
    """The shipped catalog overlaid by `<home>/models.toml` (home defaults to FLEET_HOME)."""
    if home is None:
        from fleetctl.config import default_home

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
