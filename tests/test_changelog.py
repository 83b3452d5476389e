"""CHANGELOG.md, `fleet.__version__` and pyproject's `version` name one version.

A landed capability adds a version at the top of CHANGELOG.md; the package and the
distribution must say the same, or `fleetctl --version`, the OpenAPI document and a
bench result would name a release the changelog does not describe.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import fleet

ROOT = Path(__file__).resolve().parent.parent
HEADING = re.compile(r"^## (\d+)\.(\d+)\.(\d+) — (\d{4}-\d{2}-\d{2}): \S", re.MULTILINE)


def versions() -> list[tuple[tuple[int, int, int], str]]:
    """Every version heading of CHANGELOG.md, top first: ((major, minor, patch), date)."""
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    return [((int(a), int(b), int(c)), day) for a, b, c, day in HEADING.findall(text)]


def test_newest_changelog_version_is_the_package_and_distribution_version():
    newest = ".".join(map(str, versions()[0][0]))
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    assert fleet.__version__ == newest, (fleet.__version__, newest)
    assert project["version"] == newest, (project["version"], newest)


def test_versions_run_newest_first_and_every_heading_parses():
    found = versions()
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert len(found) == text.count("\n## "), "a version heading is not `## X.Y.Z — YYYY-MM-DD: what`"
    numbers = [v for v, _ in found]
    days = [d for _, d in found]
    assert numbers == sorted(numbers, reverse=True) and len(set(numbers)) == len(numbers), numbers
    assert days == sorted(days, reverse=True), days
