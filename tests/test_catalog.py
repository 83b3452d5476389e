"""The shipped catalog: every entry can be served and is proven, its facts are
well formed, and what `fleetctl list --catalog` and the models table of docs/models.md show is the catalog.

"Can be served": its (task, runtime) has an adapter in runtimes/registry.py.
"Proven": its (task, runtime, model_type) is in `tests.arch_models.PARITY`,
which names the test that serves a tiny instance of that architecture, in its
hub folder layout, over HTTP and compares it with its reference library.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.catalog import load_catalog, parse_source
from fleetctl import catalog_table
from tests.arch_models import PARITY

ROOT = Path(__file__).resolve().parent.parent
#: Licence ids as the hub's `license:` tag writes them (SPDX-like, lowercase), or a named custom licence.
LICENSE_RE = re.compile(r"^[a-z0-9][a-z0-9.+-]*\Z")


@pytest.fixture(scope="module")
def entries(tmp_path_factory: pytest.TempPathFactory):
    return load_catalog(tmp_path_factory.mktemp("empty-home")).all()


def test_the_catalog_covers_every_task_with_current_models(entries):
    assert len(entries) >= 40
    by_task = {task: [e.name for e in entries if e.task == task] for task in catalog_table.TASK_ORDER}
    assert all(len(names) >= 3 for names in by_task.values()), by_task


def test_every_entry_has_a_runtime_adapter(entries):
    from fleet.runtimes.registry import ADAPTERS

    missing = [(e.name, e.task, e.runtime) for e in entries if (e.task, e.runtime) not in ADAPTERS]
    assert not missing, f"no adapter in runtimes/registry.py for {missing}"


def test_every_entry_architecture_has_a_parity_test(entries):
    uncovered = [(e.name, e.task, e.runtime, e.model_type) for e in entries
                 if (e.task, e.runtime, e.model_type) not in PARITY]
    assert not uncovered, f"no parity test for {uncovered}: add a case to tests/arch_models.py"


@pytest.mark.parametrize("key", sorted(PARITY), ids=lambda k: "/".join(k))
def test_each_parity_test_named_in_the_table_exists(key):
    """A name in the table is a test function of that file, and its parameter
    (when it has one) a case the test is parametrized over."""
    from tests import arch_models

    for node in PARITY[key]:
        path, _, test = node.partition("::")
        function, _, param = test.partition("[")
        text = (ROOT / path).read_text()
        assert re.search(rf"^def {re.escape(function)}\(", text, re.M), node
        if param:
            cases = {**arch_models.ENCODER_CASES, **arch_models.GENERATOR_CASES, **arch_models.DECIDE_CASES}
            assert param.rstrip("]") in cases or f'"{param.rstrip("]")}"' in text, node


def test_facts_are_well_formed(entries):
    for e in entries:
        source = parse_source(e.source)
        if source.revision is not None:  # a full commit, or a hub pull request's ref (refs/pr/N)
            assert re.fullmatch(r"[0-9a-f]{40}|refs/pr/[0-9]+", source.revision), e.name
        assert e.license is None or LICENSE_RE.match(e.license), e.name
        assert e.params is None or e.params >= 1_000_000, e.name
        assert e.size_bytes is None or e.size_bytes >= 1_000_000, e.name
        assert (e.pooling is None and e.dimensions is None) or e.task == "embed", e.name
        assert not e.trust_remote_code, e.name
        # Pickle weights only where the runtime reads them with torch.load(weights_only=True).
        assert not e.allow_pickle or e.runtime == "gliner", e.name


@pytest.mark.parametrize(("n", "text"), [
    (None, "unknown"), (22_713_216, "22.7M"), (33_400_000, "33.4M"), (595_776_512, "596M"),
    (1_230_000_000, "1.23B"), (7_567_295_488, "7.57B"), (999, "999"),
])
def test_parameter_counts_read_as_model_cards_write_them(n, text):
    assert catalog_table.format_count(n) == text


@pytest.mark.parametrize(("n", "text"), [
    (None, "unknown"), (91_226_112, "91.2 MB"), (1_191_182_336, "1.2 GB"), (640, "640 B"),
])
def test_sizes_read_in_decimal_units(n, text):
    assert catalog_table.format_size(n) == text


def test_readme_models_table_is_the_catalogs():
    readme = catalog_table.README.read_text()
    assert catalog_table.render(readme, catalog_table.shipped_entries()) == readme, \
        "docs/models.md's models table is stale: run `python -m fleetctl.catalog_table`"
    done = subprocess.run([sys.executable, "-m", "fleetctl.catalog_table", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_stale_table_is_found_and_rewritten(entries):
    readme = f"# x\n\n{catalog_table.START}\n| old |\n{catalog_table.END}\n\ntail\n"
    fresh = catalog_table.render(readme, entries)
    assert fresh != readme and fresh.startswith("# x\n\n") and fresh.endswith("\n\ntail\n")
    assert catalog_table.render(fresh, entries) == fresh
    for e in entries:
        assert f"| `{e.name}` | {e.task} | {e.runtime} |" in fresh


def fleetctl(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLEET_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("FLEET_URL", None)
    return subprocess.run([sys.executable, "-m", "fleetctl", *args], env=env, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


def test_list_catalog_shows_license_params_size_and_unknowns(tmp_path):
    # A user entry that states no facts: every one of them reads "unknown".
    (tmp_path / "models.toml").write_text(
        '[models."mine"]\nsource = "hf:org/mine"\ntask = "classify"\nruntime = "transformers"\n')
    rows = {r["name"]: r for r in json.loads(fleetctl(tmp_path, "list", "--catalog", "--json").stdout)}
    qwen = rows["qwen3-embedding-0.6b"]
    assert (qwen["license"], qwen["params"], qwen["size_bytes"], qwen["size_from"]) == \
        ("apache-2.0", 595_776_512, 1_191_182_336, "catalog")
    assert qwen["pulled"] is False and qwen["model_type"] == "qwen3" and qwen["pooling"] == "lasttoken"
    mine = rows["mine"]
    assert (mine["license"], mine["params"], mine["size_bytes"], mine["size_from"]) == (None, None, None, None)
    # The default model's size is measured from its package, not taken from the card.
    assert rows["all-minilm-l6-v2"]["size_from"] == "package"
    table = fleetctl(tmp_path, "list", "--catalog")
    assert table.returncode == 0, table.stderr
    lines = {line.split()[0]: line.split() for line in table.stdout.splitlines()[1:] if line.strip()}
    assert lines["qwen3-embedding-0.6b"][:6] == ["qwen3-embedding-0.6b", "embed", "sentence-transformers",
                                                 "apache-2.0", "596M", "~1.2"]
    assert lines["mine"][3:7] == ["unknown", "unknown", "unknown", "no"]
