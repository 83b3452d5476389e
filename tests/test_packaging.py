"""What `pip install` of this folder puts on a machine: the wheel built from the checkout,
read as pip would install it.

The distribution is `fleet-serve`, not `fleet` (on PyPI, `fleet` is an unrelated older
project, also imported as `fleet`). The wheel installs exactly the project's six packages,
with the catalog, the bench corpus and the `fleetctl` command; `daemon` and `bench` are
also other distributions' import names (python-daemon, frappe-bench), which the README
says, telling users to give fleet a virtual environment of its own. Every install
command in the README, docs/, pyproject.toml and scripts/setup.sh names `fleet-serve`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fleet", "fleetctl", "daemon", "runtimes", "local_queue", "bench")
#: Top-level names this wheel shares with well-known distributions (import name -> who).
SHARED = {"daemon": "python-daemon", "bench": "frappe-bench"}
#: An install command naming the old distribution: `pip install fleet` or `fleet[extra]`.
OLD_NAME = re.compile(r"pip install fleet(?![\w-])|(?<![\w\-/.])fleet\[[a-z,]+\]")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel of the checkout, built from a copy (setuptools builds in the source tree
    and keeps what an earlier build left in build/: a copy has no such leftovers)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", ".venv-*", "results")
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=skip, symlinks=False)
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                            "--no-index", "-q", "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (path,) = out.glob("*.whl")
    return zipfile.ZipFile(path)


def dist_info(whl: zipfile.ZipFile, name: str) -> str:
    (member,) = [n for n in whl.namelist() if n.split("/")[0].endswith(".dist-info") and n.endswith("/" + name)]
    return whl.read(member).decode()


@pytest.mark.slow
def test_the_wheel_is_fleet_serve_and_installs_the_projects_packages_only(wheel: zipfile.ZipFile) -> None:
    meta = Parser().parsestr(dist_info(wheel, "METADATA"))
    assert meta["Name"] == "fleet-serve"
    assert {"server", "test", "openvino", "otel", "bench", "mcp"} <= set(meta.get_all("Provides-Extra"))
    tops = {n.split("/")[0] for n in wheel.namelist() if not n.split("/")[0].endswith(".dist-info")}
    assert tops == set(PACKAGES), tops
    assert set(dist_info(wheel, "top_level.txt").split()) == set(PACKAGES)
    names = set(wheel.namelist())
    assert {"fleet/models.toml", "bench/corpus.txt", "daemon/__init__.py", "runtimes/process.py"} <= names
    assert not [n for n in names if "/tests/" in n or n.endswith((".pyc", ".whl"))]
    assert re.search(r"^fleetctl = fleetctl\.app:main$", dist_info(wheel, "entry_points.txt"), re.M)


def test_install_commands_name_the_distribution_and_the_shared_names_are_said() -> None:
    pages = [ROOT / "README.md", ROOT / "pyproject.toml", ROOT / "scripts" / "setup.sh", *(ROOT / "docs").glob("*.md")]
    old = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in pages
           for i, line in enumerate(p.read_text().splitlines(), 1) if OLD_NAME.search(line)]
    assert not old, "install commands naming the old distribution (it is fleet-serve):\n" + "\n".join(old)
    readme = ROOT.joinpath("README.md").read_text()
    for name, other in SHARED.items():
        assert f"`{name}`" in readme and other in readme, (name, other)
