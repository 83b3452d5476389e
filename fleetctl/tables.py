"""Tables that fit the terminal and never break a name.

Names and ids are what people copy into the next command, so a table is laid out for
the width it is drawn at (a rich renderable: `fleetctl top` follows a resized
terminal) by four kinds of column:

- NAME: names, ids and numbers: one line, never cut, never folded.
- NAMES: names joined by ", " (or words around a name): wraps between words, never
  inside one.
- TEXT: a description: wraps over lines, a long word folds.
- CUT: a description kept on one line, cut with "…" when narrow.

When the columns at their least do not fit, the droppable ones go, lowest `drop`
first, and the caption names them (`--json` has every field). Only a name wider than
the terminal by itself folds: it is never cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

NAME, NAMES, TEXT, CUT = "name", "names", "text", "cut"
#: The narrowest a TEXT column is drawn (characters): narrower reads as noise.
TEXT_MIN = 12
#: The narrowest a CUT column is drawn (characters): less than a source's host and org.
CUT_MIN = 16
#: Space between two columns (rich's padding of one on each side, no edge padding).
GAP = 2


@dataclass
class _Column:
    header: str
    kind: str
    drop: int | None
    justify: str
    cells: list[str] = field(default_factory=list)

    def natural(self) -> int:
        """The width that shows every cell whole on one line."""
        return max([cell_len(self.header)] + [cell_len(line) for c in self.cells for line in c.splitlines() or [""]])

    def least(self) -> int:
        """The narrowest this column may be drawn without breaking a name."""
        natural = self.natural()
        if self.kind == NAME:
            return natural
        if self.kind == NAMES:
            return max(cell_len(word) for text in (self.header, *self.cells) for word in text.split() or [""])
        if self.kind == TEXT:
            return min(natural, max(TEXT_MIN, *(cell_len(w) for w in self.header.split())))
        return min(natural, max(CUT_MIN, cell_len(self.header)))


class FitTable:
    """A titled table of plain-text cells (never markup) laid out for the width it is
    drawn at. `add_column(header, kind, drop=N)`: a column with `drop` may be left out
    when narrow, lowest N first; one without is always shown."""

    def __init__(self, title: str | None = None, *, note: str = "--json has every field") -> None:
        self.title = title
        self.note = note
        self.columns: list[_Column] = []

    def add_column(self, header: str, kind: str = NAME, *, drop: int | None = None, justify: str = "left") -> None:
        if kind not in (NAME, NAMES, TEXT, CUT):
            raise ValueError(f"column kind {kind!r}: this is a bug")
        self.columns.append(_Column(header, kind, drop, justify))

    def add_row(self, *cells: str) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{len(cells)} cells for {len(self.columns)} columns: this is a bug")
        for column, cell in zip(self.columns, cells, strict=True):
            column.cells.append(cell)

    @property
    def row_count(self) -> int:
        return len(self.columns[0].cells) if self.columns else 0

    def shown(self, width: int) -> tuple[list[_Column], bool]:
        """The columns drawn at `width`, and whether they fit (False: a name alone is wider)."""
        def need(columns: list[_Column]) -> int:
            return sum(c.least() for c in columns) + GAP * (len(columns) - 1)

        shown = list(self.columns)
        droppable = sorted((c for c in shown if c.drop is not None), key=lambda c: c.drop)
        dropped = []
        while need(shown) > width:
            if not droppable:
                return shown, False
            dropped.append(droppable.pop(0))
            shown.remove(dropped[-1])
        # A column dropped early may fit beside what was left once later ones went.
        for c in reversed(dropped):
            wider = [k for k in self.columns if k in shown or k is c]
            if need(wider) <= width:
                shown = wider
        return shown, True

    def table(self, width: int) -> Table:
        """The rich Table for `width` columns: each column's width set here, so rich
        never shrinks a NAME column."""
        shown, fits = self.shown(width)
        widths = [c.least() for c in shown]
        spare = width - sum(widths) - GAP * (len(shown) - 1)
        # Share what is left among the flexible columns, by how much each lacks.
        wants = [c.natural() - w if c.kind != NAME else 0 for c, w in zip(shown, widths, strict=True)]
        if fits and sum(wants):
            give = [min(want, spare * want // sum(wants)) for want in wants]
            rest = spare - sum(give)
            for i, want in enumerate(wants):
                extra = min(want - give[i], rest)
                give[i] += extra
                rest -= extra
            widths = [w + g for w, g in zip(widths, give, strict=True)]
        dropped = [c.header for c in self.columns if c not in shown]
        caption = f"not shown at {width} columns: {', '.join(dropped)} ({self.note})" if dropped else None
        t = Table(title=self.title, title_justify="left", title_style="bold", caption=caption, caption_justify="left",
                  caption_style="dim", box=None, pad_edge=False)
        for c, w in zip(shown, widths, strict=True):
            if not fits and c.kind in (NAME, NAMES):  # a name wider than the terminal: folded, never cut
                t.add_column(c.header, justify=c.justify, overflow="fold")
            elif c.kind == NAME:
                t.add_column(c.header, justify=c.justify, no_wrap=True, width=w)
            elif c.kind == CUT:
                t.add_column(c.header, justify=c.justify, no_wrap=True, overflow="ellipsis", width=w)
            else:
                t.add_column(c.header, justify=c.justify, overflow="fold", width=w if fits else None)
        for i in range(self.row_count):
            t.add_row(*(Text(c.cells[i]) for c in shown))
        return t

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.table(options.max_width)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self.table(options.max_width))


#: The fewest characters of a path worth showing on the line it shares; fewer, it gets a line of its own.
PATH_MIN = 24


def cut_middle(text: str, width: int) -> str:
    """`text` in at most `width` cells, its middle given up for "…": a path's start (which
    tree) and end (which home) say most."""
    if cell_len(text) <= width:
        return text
    if width < 2:
        return "…"[:width]
    tail = (width - 1) * 2 // 3
    return text[:width - 1 - tail] + "…" + text[len(text) - tail:]


class WhereLine:
    """`<lead> · <label> <path>` on one line at the width it is drawn at: the lead (a
    URL people copy) whole, the path cut in the middle. When the path would keep fewer
    than PATH_MIN characters beside the lead, it goes on a line of its own, still cut
    to fit; the lead alone wider than the terminal folds, never cut."""

    def __init__(self, lead: str, label: str, path: str, *, cut: bool = True) -> None:
        self.lead, self.label, self.path, self.cut = lead, label, path, cut

    def lines(self, width: int) -> list[str]:
        tail = f"{self.label} {self.path}"
        one = f"{self.lead} · {tail}"
        if cell_len(one) <= width:
            return [one]
        room = width - cell_len(f"{self.lead} · {self.label} ")
        if self.cut and room >= PATH_MIN:
            return [f"{self.lead} · {self.label} {cut_middle(self.path, room)}"]
        room = width - cell_len(self.label) - 1
        return [self.lead, f"{self.label} {cut_middle(self.path, room) if self.cut else self.path}"]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for line in self.lines(options.max_width):
            yield Text(line, overflow="fold")
