"""The house rules: imports run one way, and the API process never maps libtorch.

Every `import` of every project module is read (module level, inside functions,
under `if TYPE_CHECKING`) and checked against the allowed directions of
DESIGN.md / docs/architecture.md:

    fleetctl, bench  ->  daemon, runtimes  ->  local_queue, fleet

A second check forbids import circles among all of them, those under
TYPE_CHECKING too: they never run, but two modules that name each other's types
are one module to read (share a protocol, or move the shared type down).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fleet", "fleetctl", "daemon", "local_queue", "runtimes", "bench")
#: The server's folders, imported as fleet.daemon, fleet.runtimes, ... (pyproject's package-dir).
INSIDE_FLEET = ("daemon", "local_queue", "runtimes", "bench")
#: Loads local_queue/ of any tree by path, to compare two trees in one process.
TOP_LEVEL_IMPORTERS = {"bench/queue_bench.py"}


def canonical(name: str) -> str:
    """A module's layer name: fleet.daemon.core is the folder daemon/'s daemon.core."""
    parts = name.split(".")
    return ".".join(parts[1:]) if len(parts) > 1 and parts[0] == "fleet" and parts[1] in INSIDE_FLEET else name

#: package -> packages it may import (itself always allowed).
ALLOWED = {
    "fleet": set(),
    "local_queue": set(),
    "runtimes": {"fleet", "local_queue"},
    "daemon": {"fleet", "local_queue"},
    "bench": {"fleet", "local_queue", "daemon", "runtimes"},
    "fleetctl": {"fleet", "local_queue", "daemon", "runtimes"},
}
#: Only the CLI verbs may import the bench (it is a tool of theirs, not a layer).
BENCH_IMPORTERS = "fleetctl.commands"


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if any(p.startswith(".") for p in parts):
                continue  # not the project's: e.g. bench/.venv-infinity, a peer's virtualenv
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


MODULES = project_modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


MODULE, LAZY, TYPING = "module", "lazy", "typing"


def imports_of(module: str, path: Path) -> list[tuple[str, int, str]]:
    """(imported project module, line, kind) for each import in the file; kind is
    MODULE (runs on import), LAZY (inside a function) or TYPING (never runs)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: list[tuple[str, int, str]] = []

    def resolve(base: str, names: list[str]) -> list[str]:
        # `from pkg import sub` names a module when pkg/sub.py exists, else an attribute of pkg.
        out = []
        for name in names:
            candidate = f"{base}.{name}" if base else name
            out.append(candidate if candidate in MODULES else base)
        return out

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, TYPING if kind == TYPING else LAZY)
                continue
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.body:
                    visit(ast.Module(body=[sub], type_ignores=[]), TYPING)
                for sub in child.orelse:
                    visit(ast.Module(body=[sub], type_ignores=[]), kind)
                continue
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    anchor = module.split(".")
                    anchor = anchor if is_package else anchor[:-1]
                    anchor = anchor[: len(anchor) - (child.level - 1)]
                    base = ".".join(anchor + ([child.module] if child.module else []))
                else:
                    base = canonical(child.module or "")
                targets = resolve(base, [a.name for a in child.names])
            else:
                visit(child, kind)
                continue
            for target in dict.fromkeys(canonical(t) for t in targets):
                if target.split(".")[0] in PACKAGES:
                    found.append((target, child.lineno, kind))

    visit(tree, MODULE)
    return found


def test_imports_run_one_way():
    wrong = []
    for module, path in MODULES.items():
        package = module.split(".")[0]
        for target, line, _ in imports_of(module, path):
            other = target.split(".")[0]
            if other == package:
                continue
            if other == "bench" and not module.startswith(BENCH_IMPORTERS):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} (only {BENCH_IMPORTERS} may import bench)")
            elif other != "bench" and other not in ALLOWED[package]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({package} may import "
                             f"{sorted(ALLOWED[package]) or 'no other project package'})")
    assert not wrong, "imports against the house rules:\n" + "\n".join(wrong)


#: The daemon's modules that build the app from its controllers; no other daemon-level
#: module imports a controller (the controllers are the top of the API process).
APP_BUILDERS = {"daemon.app", "daemon.server"}


def test_daemon_modules_do_not_reach_up_into_controllers():
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {target}"
             for module, path in MODULES.items()
             if module.startswith("daemon.") and not module.startswith("daemon.controllers")
             and module not in APP_BUILDERS
             for target, line, _ in imports_of(module, path) if target.startswith("daemon.controllers")]
    assert not wrong, "daemon-level modules importing controllers (the arrow runs down only):\n" + "\n".join(wrong)


def test_no_import_circles():
    graph = {m: sorted({t for t, _, _ in imports_of(m, p) if t != m and t in MODULES})
             for m, p in MODULES.items()}
    circles, state = [], {}

    def walk(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                circles.append(" -> ".join(stack[stack.index(nxt):] + [node, nxt]) if nxt in stack
                               else f"{node} -> {nxt}")
            elif nxt not in state:
                walk(nxt, stack + [node])
        state[node] = "done"

    for m in sorted(graph):
        if m not in state:
            walk(m, [])
    assert not circles, "import circles (TYPE_CHECKING imports count):\n" + "\n".join(circles)


def test_the_layer_check_sees_imports_inside_functions(tmp_path):
    """The walker must see a lazy import as well as a top-level one (else the rules hold by luck)."""
    path = tmp_path / "probe.py"
    path.write_text("import fleet.errors\n\ndef f():\n    from fleet.runtimes.process import run\n"
                    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fleet.daemon.core import Core\n")
    got = imports_of("fleet.probe", path)
    assert ("fleet.errors", 1, MODULE) in got
    assert ("runtimes.process", 4, LAZY) in got
    assert ("daemon.core", 7, TYPING) in got


def test_server_packages_are_imported_inside_fleet():
    """`import daemon` would load a second copy of a module beside fleet.daemon's (two
    registries, two classes of one name), and installed it would be another package."""
    wrong = []
    for path in MODULES.values():
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module
                     else [])
            for name in names:
                if name.split(".")[0] in INSIDE_FLEET and rel not in TOP_LEVEL_IMPORTERS:
                    wrong.append(f"{rel}:{node.lineno} imports {name} (write fleet.{name})")
    tests = sorted((ROOT / "tests").rglob("*.py"))
    me = Path(__file__).resolve()
    for path in tests:
        rel = str(path.relative_to(ROOT))
        # Code a test hands to a subprocess (`python -c "from daemon..."`) is text here.
        if path.resolve() != me:
            wrong += [f"{rel}: runs `{m.group(0)}` (write fleet.{m.group(2)})"
                      for m in re.finditer(r"\b(from|import) (daemon|runtimes|local_queue|bench)\b(?![-/])",
                                           path.read_text())]
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module \
                    and node.module.split(".")[0] in INSIDE_FLEET:
                wrong.append(f"{rel}:{node.lineno} imports {node.module} (write fleet.{node.module})")
    assert tests and not wrong, "\n".join(wrong)


@pytest.mark.slow
def test_the_api_process_maps_no_libtorch(daemon):
    """A running daemon's API process (not its workers) has no libtorch mapped."""
    httpx.post(f"{daemon.url}/v1/embed", json={"model": "all-minilm-l6-v2", "inputs": ["warm"]},
               timeout=60).raise_for_status()
    maps = Path(f"/proc/{daemon.proc.pid}/maps").read_text()
    assert "libtorch" not in maps, "the API process mapped libtorch"
    # ... while its worker does: the check would see it if the API process did.
    workers = httpx.get(f"{daemon.url}/v1/ps", timeout=10).json()["workers"]
    pids = [w["pid"] for w in workers if w.get("pid")]
    assert pids and any("libtorch" in Path(f"/proc/{pid}/maps").read_text() for pid in pids)


def test_the_worker_machinery_imports_no_adapter():
    """runtimes/adapters/ holds the models' code: one module per runtime and what only
    they use. The worker's machinery beside it (step loop, residency, memory, claiming,
    placement, ...) imports none of it, not even inside a function: the registry names
    each adapter by its dotted path and the worker imports the one a model needs when
    it loads it."""
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {target}"
             for module, path in MODULES.items()
             if module.startswith("runtimes.") and not module.startswith("runtimes.adapters")
             for target, line, _ in imports_of(module, path) if target.startswith("runtimes.adapters")]
    assert not wrong, ("runtimes machinery importing adapters (name an adapter in the registry; move a helper "
                       "the worker needs out of runtimes/adapters/):\n" + "\n".join(wrong))


def test_the_registry_names_classes_of_the_adapters_package():
    """Every "module:Class" of runtimes/registry.py names a module of runtimes/adapters/
    that defines that class (read from the files: importing them would import torch)."""
    tree = ast.parse((ROOT / "runtimes" / "registry.py").read_text())
    targets = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
               and re.fullmatch(r"fleet\.[\w.]+:\w+", n.value)]
    assert len(targets) >= 10, targets
    wrong = []
    for target in targets:
        module, _, cls = target.partition(":")
        path = MODULES.get(canonical(module))
        classes = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)} if path else set()
        if not module.startswith("fleet.runtimes.adapters.") or cls not in classes:
            wrong.append(target)
    assert not wrong, f"registry entries outside runtimes/adapters/ or naming no class there: {wrong}"
