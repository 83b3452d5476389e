"""Which targets a bench run has: what each `--targets` name means here, and what is skipped.

A name is one of:
  fleet, fleet-json, openai   the server at --url, spoken to in that wire format;
  infinity, tei, ollama       a peer the bench starts on loopback (bench/peers.py); outside
                              --compare, with --url given, the server at --url instead;
  KIND=URL                    a server already running at URL, spoken to as KIND (any of
                              the above: `tei=http://127.0.0.1:8080` is a TEI you started),
                              named KIND@HOST:PORT in the tables;
  st-*, ov-*, sorted, sorted-*
                              in-process targets (bench/st_local.py).

A target that cannot run on this box (a peer not set up, openvino not installed, a peer
that fails to start) is kept with the reason, so the tables and the JSON say it was
skipped and why, and which script sets it up. Nothing is silently absent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from fleet.bench import peers
from fleet.bench.runner import TargetSpec
from fleet.bench.st_local import LocalTarget, local_target
from fleet.bench.targets import KINDS

#: Kinds that name a server by URL (the rest of KINDS are peers the bench can start).
URL_KINDS = ("fleet", "fleet-json", "openai")


@dataclass(frozen=True)
class Entry:
    """One target to run: `kind` "st" (in-process), a peer to start, or a URL's server."""

    name: str
    kind: str
    url: str | None = None
    local: LocalTarget | None = None
    start_peer: bool = False


@dataclass
class Lineup:
    entries: list[Entry] = field(default_factory=list)
    #: --targets name -> why it does not run here (with the script or install that fixes it).
    skipped: dict[str, str] = field(default_factory=dict)
    #: Lines worth saying before the run (what st-best resolved to, ...).
    notes: list[str] = field(default_factory=list)

    def skip(self, name: str, reason: str) -> None:
        self.skipped.setdefault(name, reason)


def choose(names: list[str], *, url: str, url_given: bool, compare: bool) -> Lineup:
    """The targets `names` mean on this box. Raises ValueError naming unknown ones."""
    out = Lineup()
    unknown: list[str] = []
    seen: set[str] = set()
    for raw in names:
        name, _, at = raw.partition("=")
        if at:
            if name not in KINDS or not at.startswith("http://"):
                unknown.append(raw)
                continue
            entry = Entry(f"{name}@{urlsplit(at).netloc}", name, at.rstrip("/"))
        elif name in URL_KINDS or (name in peers.SETUP and url_given and not compare):
            entry = Entry(name, name, url)
        elif name in peers.SETUP:
            if (why := peers.skip_reason(name)) is not None:
                out.skip(name, why)
                continue
            entry = Entry(name, name, start_peer=True)
        else:
            lt = local_target(name)
            if lt is None:
                unknown.append(raw)
                continue
            if isinstance(lt, str):  # "<name>: skipped: <why>"
                out.skip(name, lt.split(": skipped: ", 1)[-1])
                continue
            if lt.note:
                out.notes.append(lt.note)
            entry = Entry(lt.name, "st", local=lt)
        if entry.name not in seen:  # st-best beside st-bf16 runs once
            seen.add(entry.name)
            out.entries.append(entry)
    if unknown:
        raise ValueError(f"unknown target(s) {', '.join(unknown)} in --targets")
    return out


def start_peer(entry: Entry, model_dir: Path, model: str, *, device: str, batch: int,
               infinity_dtype: str) -> tuple[peers.Child, dict[str, str]]:
    """Start the peer `entry` names on loopback: (the running peer, versions to record)."""
    if entry.kind == "infinity":
        p = peers.Infinity(model_dir, model, device=device, dtype=infinity_dtype)
        return p, {"infinity_emb": p.version, "infinity_dtype": p.dtype}
    if entry.kind == "tei":
        p = peers.TEI(model_dir, model, batch_size=batch)
        return p, {"text_embeddings_router": p.version}
    p = peers.Ollama(model_dir, model)
    return p, {"ollama": p.version}


def spec_of(entry: Entry, url: str | None = None, pids: list[int] | None = None) -> TargetSpec:
    if entry.local is not None:
        lt = entry.local
        return TargetSpec(name=lt.name, kind="st", dtype=lt.dtype, engine=lt.engine, sorted=lt.sorted)
    return TargetSpec(name=entry.name, kind=entry.kind, url=url or entry.url or "", pids=pids or [])
