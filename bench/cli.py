"""One runner for every bench: `python -m fleet.bench NAME [options]`.

A bench is a function in its own module, registered with `@bench(NAME, *options)`; it
takes the parsed options (an `argparse.Namespace`) and returns the exit code (None: 0).
The options several benches share (`--out`, `--json`, `--device`, `--rounds`, the daemon
to measure, ...) are declared once here and named by each bench, with `.but(...)` where
one needs another default or help line. `python -m fleet.bench --help` lists them all
with their modules' one-line purposes; `python -m fleet.bench NAME --help` prints the
module's whole docstring (its usage notes) and the options.

argparse rather than typer (which fleetctl uses): every bench already declared its options
as `add_argument` calls and reads them as `args.x`, so converting a script moved its
declarations into the decorator and left its logic untouched; a mutually exclusive group
(`--url | --start`) and hidden options (`--child`) are argparse's own; and the runner
imports nothing beyond the standard library itself.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

#: The modules holding benches, imported to fill BENCHES (tests/test_bench_runner.py
#: checks that every module with an `@bench` is here).
MODULES = (
    "access_log", "asgi_cold", "batch_memory", "batch_priority", "corpus", "decide", "decide_split",
    "embed_compare", "embed_controls", "embed_kinds", "engines_heads", "fairness", "generate_compare",
    "generate_engines", "gpu_check", "gpu_llamacpp", "gpu_prepare", "host_path", "inference_compare",
    "memory_load", "micro_batches", "nats_compare", "query_check", "queue_bench", "request_merging", "request_path", "saturation",
    "simulate", "synthetic", "timeline", "traced_heads", "wakeups",
)


class UsageError(Exception):
    """Options that parse but do not go together: the runner prints the bench's usage and exits 2."""


@dataclass(frozen=True)
class Option:
    """One `add_argument` call, kept until the bench's parser is built."""

    flags: tuple[str, ...]
    kwargs: dict[str, Any]
    #: Options with the same group name exclude each other (argparse's mutually exclusive group).
    exclusive: str | None = None

    def but(self, **kwargs: Any) -> Option:
        """This option with other `add_argument` keywords (a bench's own default or help)."""
        return replace(self, kwargs={**self.kwargs, **kwargs})


def option(*flags: str, exclusive: str | None = None, **kwargs: Any) -> Option:
    return Option(flags, kwargs, exclusive)


@dataclass(frozen=True)
class Bench:
    name: str
    run: Callable[[argparse.Namespace], int | None]
    options: tuple[Option, ...]
    module: str
    #: The line the listing shows; None: the module docstring's first paragraph.
    summary: str | None = None

    @property
    def doc(self) -> str:
        return sys.modules[self.module].__doc__ or ""

    @property
    def purpose(self) -> str:
        """`summary`, else the module docstring's first paragraph, on one line."""
        return self.summary or " ".join(self.doc.strip().split("\n\n")[0].split())


BENCHES: dict[str, Bench] = {}

# ---- shared options -----------------------------------------------------------------

OUT = option("--out", type=Path, default=None, metavar="PATH",
             help="the result JSON (default: bench/results/<time>-<bench>.json where the bench writes one)")
JSON = option("--json", action="store_true", help="print one JSON document instead of tables")
DEVICE = option("--device", default="cpu", help="cpu | cuda:K (default %(default)s)")
ROUNDS = option("--rounds", type=int, default=3, help="rounds; the median is reported (default %(default)s)")
DURATION = option("--duration", type=float, default=8.0, help="seconds per measurement (default %(default)s)")
CLIENTS = option("--clients", type=int, default=8, help="closed-loop clients (default %(default)s)")
REQUESTS = option("--requests", type=int, default=20, help="requests per measurement (default %(default)s)")
THREADS = option("--threads", type=int, default=1,
                 help="FLEET_CPU_THREADS of the daemon's worker (default %(default)s)")
URL = option("--url", default=None, help="a running daemon (default: start one)")
LOCK = option("--lock", default="/tmp/fleet-bench.lock",
              help="file flock'ed around the measured rounds only (building and loading run before); '' for none")
#: The daemon to measure, read by bench.daemon.daemon_from_args.
DAEMON = (option("--url", default=None, exclusive="daemon",
                 help="fleet daemon (default FLEET_URL, else 127.0.0.1:7744)"),
          option("--start", action="store_true", exclusive="daemon",
                 help="start fleetctl serve on a free port for the run"))


def bench(name: str, *options: Option | tuple[Option, ...],
          summary: str | None = None) -> Callable[[Callable], Callable]:
    """Register the decorated function as bench `name` with `options` (Options or tuples of
    them); `summary` for the listing where the module's first line does not say it."""
    flat = tuple(o for item in options for o in (item if isinstance(item, tuple) else (item,)))

    def register(fn: Callable[[argparse.Namespace], int | None]) -> Callable:
        if name in BENCHES:
            raise RuntimeError(f"bench {name!r} is registered twice ({BENCHES[name].module}, {fn.__module__}): "
                               "this is a bug")
        BENCHES[name] = Bench(name, fn, flat, fn.__module__, summary)
        return fn

    return register


def load(name: str | None = None) -> list[Bench]:
    """Bench `name` alone when the module named like it (host-path: host_path; fairness-big:
    fairness) registers it, else every bench (for the listing, or a name the convention
    does not find): a run imports one module, not every bench's dependencies (a second)."""
    name = name or ""
    for module in (name.replace("-", "_"), name.partition("-")[0]):
        if module in MODULES:
            importlib.import_module(f"fleet.bench.{module}")
            if name in BENCHES:
                return [BENCHES[name]]
    for module in MODULES:
        importlib.import_module(f"fleet.bench.{module}")
    return sorted(BENCHES.values(), key=lambda b: b.name)


def parser(benches: list[Bench]) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The runner's parser with `benches`, and each bench's own parser (by name)."""
    ap = argparse.ArgumentParser(prog="python -m fleet.bench", description="Run one bench: "
                                 "python -m fleet.bench NAME [options]; NAME --help for its notes and options.")
    sub = ap.add_subparsers(dest="bench", metavar="NAME", required=True)
    parsers = {}
    for b in benches:
        p = sub.add_parser(b.name, help=b.purpose, description=b.doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        groups: dict[str, Any] = {}
        for o in b.options:
            if o.exclusive is not None and o.exclusive not in groups:
                groups[o.exclusive] = p.add_mutually_exclusive_group()
            (p if o.exclusive is None else groups[o.exclusive]).add_argument(*o.flags, **o.kwargs)
        parsers[b.name] = p
    return ap, parsers


def run(argv: Sequence[str]) -> int:
    """Parse `argv` (NAME, then its options) and run that bench; its exit code. The bench
    sees `args.bench` (its name) and `args.argv` (these arguments, for its record of the command)."""
    argv = list(argv)
    if argv and not argv[0].startswith("-"):
        argv[0] = argv[0].replace("_", "-")  # `host_path`, the module's name, means host-path
    ap, parsers = parser(load(argv[0] if argv else None))
    args = ap.parse_args(argv)
    args.argv = argv
    try:
        return BENCHES[args.bench].run(args) or 0
    except UsageError as exc:
        parsers[args.bench].error(str(exc))  # exits 2
        raise


def main() -> None:
    sys.exit(run(sys.argv[1:]))
