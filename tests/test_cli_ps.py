"""`fleetctl ps` and friends read well in an 80-column terminal (issue: CLI as people use it).

The view is rendered from a `/v1/ps` document shaped like a real daemon's, at
80 columns, and checked for what a person reads: titled tables, whole model
names (wrapped, never cut), numbers on one line, one size unit, LoRAs under
their base, the JSON's worker ids. The CLI's own flags: --version, flags shown
as flags, `config show` naming FLEET_URL, `list --catalog` sizes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from rich.console import Console

from fleetctl.commands.ps import render

LONG = "paraphrase-multilingual-minilm-l12-v2-finetuned-support-tickets"


def state(now: float) -> dict:
    model = {"task": "embed", "dtype": "bf16", "bytes": 90_868_376, "served": 12_345, "last_used": now - 3,
             "profile": "cpu-avx512bf16", "pinned": True,
             "cost": {"a_ms": 1.234, "b_ms_per_1k_tokens": 5.678, "samples": 40},
             "engine": {"engine": "openvino", "by": "measured", "tokens_per_s": 14143, "ms": {"1 short": 4.9}}}
    gen = {"task": "generate", "dtype": "fp32", "bytes": 10_100_000, "served": 7, "last_used": now - 60,
           "loras": ["support-tone", "legal-tone"]}
    long = {"task": "embed", "dtype": "fp32", "bytes": 470_000_000, "served": 1, "last_used": now - 100,
            "forward": {"traced": True, "speedup": 1.37, "up_to_tokens": 512}}
    return {
        "box": "workstation", "status": "ready", "uptime_s": 3600.4,
        "queue": {"depth": 3, "in_flight": 5},
        "workers": [
            {"worker": 65536, "index": 0, "pid": 4242, "device": "cpu", "up": True, "claimed": 32, "restarts": 0,
             "budget_bytes": 12 << 30, "used_bytes": 600 << 20, "loading": "",
             "models": {"all-minilm-l6-v2": model, "smollm2-135m-instruct": gen, LONG: long},
             "last_batch": {"model": "all-minilm-l6-v2", "items": 32, "tokens": 1_234, "padded": 1_500,
                            "ms": 12.5, "returned": 3}},
        ],
        "slots": [{"index": 1, "pid": None, "device": "cpu", "restarts": 2, "restart_in_s": 1.5}],
        "lanes": [{"model": LONG, "depth": 3, "estimated_tokens": 123_456, "claimed": 1, "oldest_wait_ms": 1_234.5}],
    }


def screen(doc: dict, now: float, width: int = 80) -> str:
    console = Console(width=width, record=True, highlight=False, color_system=None)
    console.print(render(doc, now))
    return console.export_text()


def test_ps_reads_well_at_80_columns():
    now = time.time()
    text = screen(state(now), now)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80
    assert "…" not in text  # nothing is cut
    for title in ("Workers", "Devices", "Models", "Profiles", "Lanes"):
        assert any(line.strip() == title for line in lines), title
    assert "all-minilm-l6-v2" in text and "smollm2-135m-instruct" in text  # short names whole, on one line
    # The long name is wrapped inside its column: its pieces, read top to bottom, give it back whole.
    pieces = [line for line in lines if any(p in line for p in ("paraphrase", "support-tickets"))]
    assert pieces, text
    # One unit: MiB (never MB/KB/GB), numbers on one line.
    assert " MB" not in text and " GB" not in text and "KB" not in text
    assert "86.7" in text  # 90,868,376 bytes = 86.7 MiB
    assert "12,288.0" in text and "11,688.0" in text  # the 12 GiB budget and what is free, in MiB
    # LoRAs under their base, right after it.
    base = next(i for i, line in enumerate(lines) if "smollm2-135m-instruct" in line)
    assert "└ support-tone" in lines[base + 1] and "└ legal-tone" in lines[base + 2]
    # What runs each model's forward, how it was chosen and its measured speed (runtimes/adapters/engines.py).
    flat = " ".join(text.split())
    assert "openvino" in flat and "14,143" in flat, text
    assert "torch; traced" in flat and "1.37x" in flat, text  # a traced CPU forward (runtimes/adapters/traced.py)
    # The JSON's worker id, the one `fleetctl pin` prints.
    assert "65536" in text
    assert "restarting" in text


def test_long_names_are_wrapped_not_cut_at_any_width():
    now = time.time()
    for width in (60, 80, 120):
        text = screen(state(now), now, width)
        assert "…" not in text and max(map(len, text.splitlines())) <= width
        joined = "".join(text.split())
        assert "paraphrase" in joined


def fleetctl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "COLUMNS": "80", **(env or {})}
    return subprocess.run([sys.executable, "-m", "fleetctl", *args], capture_output=True, text=True, env=full,
                          timeout=120)


def test_version_and_flags_shown_as_flags(tmp_path):
    r = fleetctl("--version")
    assert r.returncode == 0 and r.stdout.startswith("fleetctl ") and r.stdout.split()[1][0].isdigit()
    for verb in ("ps", "list", "pin"):
        help_text = fleetctl(verb, "--help").stdout
        assert "--json" in help_text and "<bool>" not in help_text and "BOOLEAN" not in help_text, help_text


def test_config_show_names_the_url_the_cli_uses(tmp_path):
    env = {"FLEET_HOME": str(tmp_path), "FLEET_URL": "http://127.0.0.1:9999"}
    toml = fleetctl("config", "show", env=env)
    assert toml.returncode == 0, toml.stderr
    assert 'url = "http://127.0.0.1:9999"' in toml.stdout and "FLEET_URL" in toml.stdout
    doc = json.loads(fleetctl("config", "show", "--json", env=env).stdout)
    assert doc["url"] == {"value": "http://127.0.0.1:9999", "source": "env"}


def test_list_catalog_shows_sizes_where_known(tmp_path):
    env = {"FLEET_HOME": str(tmp_path)}
    rows = {r["name"]: r for r in json.loads(fleetctl("list", "--catalog", "--json", env=env).stdout)}
    # The default model ships in a Python package: its size is measured offline ...
    assert rows["all-minilm-l6-v2"]["size_bytes"] > 80_000_000 and rows["all-minilm-l6-v2"]["size_from"] == "package"
    # ... a hub model's is the catalog's figure where it has one, said so, and unknown otherwise.
    hub = [r for r in rows.values() if r["source"].startswith("hf:")]
    assert any(r["size_from"] == "catalog" and r["size_bytes"] > 0 for r in hub)
    assert all(r["size_bytes"] is None for r in hub if r["size_from"] is None)
    assert any(r["size_from"] is None for r in hub)
    table = fleetctl("list", "--catalog", env=env).stdout
    assert " MB" in table and "~" in table and "unknown" in table
