"""The models table of docs/models.md, written from the shipped catalog (models.toml).

    python -m fleetctl.catalog_table           # rewrite the table in docs/models.md
    python -m fleetctl.catalog_table --check   # exit 1 when the table is stale

The table sits between `START` and `END` in docs/models.md; everything else in the
file is left as it is. `tests/test_catalog.py` runs the check, so a catalog
change without its table fails the suite. The same formatting serves
`fleetctl list --catalog`: a fact the catalog does not know reads "unknown".
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

from fleet.catalog import SHIPPED_CATALOG, CatalogEntry, load_catalog, parse_source

README = Path(__file__).resolve().parent.parent / "docs" / "models.md"
START = "<!-- models table: written by `python -m fleetctl.catalog_table` from models.toml; do not edit -->"
END = "<!-- end of models table -->"
UNKNOWN = "unknown"
TASK_ORDER = ("embed", "rerank", "classify", "extract", "generate", "decide")


def format_count(n: int | None) -> str:
    """A parameter count the way model cards write it: 22.7M, 596M, 1.5B."""
    if n is None:
        return UNKNOWN
    for scale, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= scale:
            value = n / scale
            return f"{value:.3g}{suffix}" if value < 100 else f"{value:.0f}{suffix}"
    return str(n)


def format_size(nbytes: int | None) -> str:
    """Bytes in decimal units (what the hub shows): 87.0 MB, 1.2 GB."""
    if nbytes is None:
        return UNKNOWN
    for scale, suffix in ((10**9, "GB"), (10**6, "MB"), (10**3, "kB")):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {suffix}"
    return f"{nbytes} B"


def notes(entry: CatalogEntry) -> str:
    """What a deployer checks before pulling: gating, pooling, width, Matryoshka widths,
    the catalog's prompt names, the entry's note."""
    parts = []
    if entry.gated:
        parts.append("gated (accept the terms on the hub; HF_TOKEN)")
    if entry.pooling:
        parts.append(f"{entry.pooling} pooling")
    if entry.dimensions:
        parts.append(f"{entry.dimensions} dims")
    if entry.matryoshka_dims:
        parts.append("Matryoshka " + "/".join(str(d) for d in entry.matryoshka_dims))
    if entry.matryoshka_range:
        parts.append("Matryoshka, any width {}-{}".format(*entry.matryoshka_range))
    if entry.prompts:
        parts.append("prompts " + ", ".join(f"`{name}`" for name in entry.prompts))
    if entry.note:
        parts.append(entry.note)
    return "; ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(entries: Iterable[CatalogEntry]) -> str:
    """The markdown table, one row per entry, by task then name."""
    rows = sorted(entries, key=lambda e: (TASK_ORDER.index(e.task), e.name))
    lines = ["| name | task | runtime | source | architecture | license | params | size | notes |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in rows:
        source = parse_source(e.source)
        where = f"[{source.ref}](https://huggingface.co/{source.ref})" if source.kind == "hf" else f"`{source.unpinned}`"
        cells = (f"`{e.name}`", e.task, e.runtime, where, e.model_type or UNKNOWN, e.license or UNKNOWN,
                 format_count(e.params), format_size(e.size_bytes), notes(e))
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def render(readme: str, entries: Iterable[CatalogEntry]) -> str:
    """`readme` with the text between START and END replaced by the table."""
    head, start, rest = readme.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise SystemExit(f"docs/models.md has no models table markers ({START!r} ... {END!r})")
    return f"{head}{START}\n{table(entries)}\n{END}{tail}"


def shipped_entries() -> list[CatalogEntry]:
    """The shipped catalog alone (never a user's FLEET_HOME overlay)."""
    import tempfile

    with tempfile.TemporaryDirectory() as empty_home:
        return load_catalog(empty_home, shipped=SHIPPED_CATALOG).all()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    check = "--check" in args
    current = README.read_text()
    wanted = render(current, shipped_entries())
    if check:
        if wanted != current:
            print("docs/models.md's models table is stale: run `python -m fleetctl.catalog_table`", file=sys.stderr)
            return 1
        return 0
    if wanted != current:
        README.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
