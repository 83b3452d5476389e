"""Promotion packages: why a version took an alias, kept in the store.

One JSON file per promotion attempt, `FLEET_HOME/models/.promotions/<id>.json`, written
whole (fleet.files) and never changed: what was promoted (source, revision, the sha256
and size of every file, licence, task, runtime), by whom and why, the evaluation (the
file's sha256 and line count, every metric for the candidate and the version it would
replace, the margin, the regressions), the serving profile it runs with, the capacity
the evaluation measured, and the rollback target. A refused attempt is kept too
(`kind` "refused"): the record of why a candidate did not ship. `fleetctl history
ALIAS` lists them with the alias's other changes (fleet.aliases.Event.package).
"""

from __future__ import annotations

import re
import secrets
import time
from pathlib import Path
from typing import Any

import msgspec

from fleet.errors import NotFound
from fleet.files import replace_file
from fleet.judge import JudgeReport
from fleet.store import FileEntry

PROMOTIONS_DIR = ".promotions"
PACKAGE_FORMAT = 1
ID_RE = re.compile(r"^prm_[0-9]{8}T[0-9]{6}Z_[0-9a-f]{8}\Z")


class VersionFacts(msgspec.Struct, kw_only=True):
    """The promoted version as the store holds it."""

    name: str
    source: str
    revision: str | None
    task: str
    runtime: str
    base: str | None
    pulled_at: str
    size_bytes: int
    #: From the catalog entry (by name, else by source); "unknown" when no entry says.
    licence: str
    files: list[FileEntry]


class GenerationLimit(msgspec.Struct, kw_only=True):
    """How long a generate evaluation's answers could be, per version: a short context
    bounds them (the answers are compared as they fit), it does not fail the lines."""

    #: Tokens an answer may take where its line names none.
    max_tokens: int
    #: Lines that named their own `max_tokens`.
    lines_with_max_tokens: int
    #: Each version's context (prompt and answer, tokens) as its store entry and config
    #: say; None where neither says.
    context: dict[str, int | None]
    #: Each version's answers that its context ended (the prompt left less room than
    #: the line's max_tokens).
    context_bound: dict[str, int]
    how: str = ("each answer runs to its line's max_tokens (else max_tokens) or, where the version's context less "
                "the prompt leaves less room, to the context's end; a prompt that alone does not fit a version "
                "refuses the promotion (422 naming the line), it is not scored")


class EvalReport(msgspec.Struct, kw_only=True):
    file_sha256: str
    lines: int
    metrics: list[str]
    lower_is_better: list[str]
    #: How much worse (absolute) the candidate may be on any metric.
    margin: float
    candidate: dict[str, float]
    #: None when the alias had no version yet (nothing to compare with).
    current: dict[str, float] | None
    #: "metric candidate vs current" for each metric past the margin.
    regressions: list[str]
    #: A generate evaluation's judge model and its verdicts (its win rates are in the metrics).
    judge: JudgeReport | None = None
    #: A generate evaluation's answer lengths (GenerationLimit).
    generation: GenerationLimit | None = None


class Capacity(msgspec.Struct, kw_only=True):
    tokens: int
    seconds: float
    tokens_per_s: float
    resident_bytes: int
    #: How the figures were measured.
    how: str


class Package(msgspec.Struct, kw_only=True):
    format: int = PACKAGE_FORMAT
    id: str
    alias: str
    #: promote | canary | refused
    kind: str
    at: str = msgspec.field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    owner: str
    reason: str = ""
    #: Promoted although the evaluation regressed (`--force`, with a reason).
    forced: bool = False
    candidate: VersionFacts
    #: The version the candidate replaces (None: a new alias); where `rollback` goes.
    replaced: str | None
    rollback_target: str | None
    canary_percent: float = 0.0
    evaluation: EvalReport
    capacity: Capacity
    #: The profile(s) the candidate runs with on this box's workers (or its manifest's).
    serving_profile: list[dict[str, Any]]


_decoder = msgspec.json.Decoder(Package)
_encoder = msgspec.json.Encoder()


def new_id() -> str:
    return f"prm_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}_{secrets.token_hex(4)}"


class PackageStore:
    def __init__(self, store_root: str | Path) -> None:
        self.root = Path(store_root) / PROMOTIONS_DIR

    def write(self, package: Package) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        replace_file(self.root / f"{package.id}.json", msgspec.json.format(_encoder.encode(package), indent=2),
                     what=f"the promotion package of {package.alias!r}")

    def read(self, package_id: str) -> Package:
        if not ID_RE.match(package_id):
            raise NotFound(f"no promotion package {package_id!r} (ids look like prm_20261207T101500Z_1a2b3c4d)")
        try:
            return _decoder.decode((self.root / f"{package_id}.json").read_bytes())
        except FileNotFoundError:
            raise NotFound(f"no promotion package {package_id!r}") from None
