"""What `pip install` of this folder puts on a machine: the wheel built from the checkout,
read as pip would install it.

The distribution is `fleet-serve`, not `fleet` (on PyPI, `fleet` is an unrelated older
project, also imported as `fleet`). The wheel installs two top-level packages, `fleet` and
`fleetctl`, with the catalog, the bench corpus and the `fleetctl` command; the server's
folders (daemon/, runtimes/, local_queue/, bench/) install inside `fleet`, since `daemon`
and `bench` are other distributions' import names (python-daemon, frappe-bench). Every install
command the repository prints or documents (README, docs, hints in error messages,
scripts) names `fleet-serve`.
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
#: The repository's package folders (the wheel's sources).
FOLDERS = ("fleet", "fleetctl", "daemon", "runtimes", "local_queue", "bench")
#: What the wheel installs at the top of site-packages.
TOP_LEVEL = ("fleet", "fleetctl")
#: Import names of well-known distributions the wheel must not install (name -> who).
SHARED = {"daemon": "python-daemon", "bench": "frappe-bench"}
#: A pip command installing the old distribution, bare or with extras (any text file).
OLD_INSTALL = re.compile(r"pip install\s+['\"]?fleet(?![\w-])")
#: The old distribution's name in any form (the pages a user reads: docs, setup, CI).
OLD_NAME = re.compile(r"pip install fleet(?![\w-])|(?<![\w\-/.])fleet\[[a-z,]+\]")
#: Text files git tracks, and of them the pages a user reads.
TEXT = (".py", ".md", ".sh", ".toml", ".txt", ".yaml", ".yml", ".cfg", "Dockerfile", ".ci/run", ".service")
PAGES = (".md", ".sh", ".toml", ".ci/run", "Dockerfile")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel of the checkout, built from a copy (setuptools builds in the source tree
    and keeps what an earlier build left in build/: a copy has no such leftovers)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", ".venv-*", "results")
    for pkg in FOLDERS:
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
    assert tops == set(TOP_LEVEL), tops
    assert set(dist_info(wheel, "top_level.txt").split()) == set(TOP_LEVEL)
    assert not tops & set(SHARED)
    names = set(wheel.namelist())
    assert {"fleet/models.toml", "fleet/bench/corpus.txt", "fleet/daemon/__init__.py", "fleet/runtimes/process.py",
            "fleet/runtimes/adapters/sentence_transformer.py",
            "fleet/daemon/controllers/embed.py", "fleet/local_queue/queue.py", "fleet/bench/sim/device.py"} <= names
    assert not [n for n in names if "/tests/" in n or n.endswith((".pyc", ".whl"))]
    assert re.search(r"^fleetctl = fleetctl\.app:main$", dist_info(wheel, "entry_points.txt"), re.M)


@pytest.mark.slow
def test_the_installed_wheel_imports_the_server_inside_fleet(wheel: zipfile.ZipFile, tmp_path: Path) -> None:
    """Installed from the wheel (its files, no checkout beside them), the server's modules
    import as fleet.*, from the install, and no top-level `daemon` or `bench` appears."""
    site = tmp_path / "site"
    wheel.extractall(site)
    probe = ("import importlib.util, fleet, fleet.daemon.app, fleet.runtimes.process, fleet.bench.runner, "
             "fleet.local_queue, fleet.bench.corpus as c\n"
             "print(list(fleet.__path__), fleet.daemon.app.__file__, fleet.local_queue.__file__, "
             "c.CORPUS_PATH.is_file(), importlib.util.find_spec('daemon'), importlib.util.find_spec('bench'))")
    done = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {probe}"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    paths, app, queue, corpus, daemon, bench = done.stdout.rsplit("\n", 2)[-2].split(" ", 5)
    assert paths == f"[{str(site / 'fleet')!r}]" and app.startswith(str(site / "fleet" / "daemon"))
    assert queue.startswith(str(site / "fleet" / "local_queue")) and corpus == "True"
    assert (daemon, bench) == ("None", "None")


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, timeout=60)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    me = Path(__file__).resolve()
    return [p for name in listed.stdout.splitlines() if name.endswith(TEXT)
            and (p := ROOT / name).is_file() and p.resolve() != me]


def test_install_commands_name_the_distribution_and_the_shared_names_are_said() -> None:
    old = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in tracked_text_files()
           for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
           if (OLD_NAME if p.name.endswith(PAGES) else OLD_INSTALL).search(line)]
    assert not old, "install commands naming the old distribution (it is fleet-serve):\n" + "\n".join(old)
    readme = ROOT.joinpath("README.md").read_text()
    assert all(f"`fleet.{name}`" in readme for name in SHARED)


def test_nothing_in_the_repository_cites_a_file_outside_it() -> None:
    """The project's docs, code and scripts speak in its own words: no path that leaves
    the checkout (`../<folder>/...`) is named as a source to read."""
    outside = re.compile(r"(?<![\w.])\.\./(?!\.)[\w-]+/[\w./-]+\.(?:md|py|toml|txt)\b")
    cited = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in tracked_text_files()
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if outside.search(line)]
    assert not cited, "files outside the repository cited:\n" + "\n".join(cited)
