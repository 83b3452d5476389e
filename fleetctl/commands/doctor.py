"""`fleetctl doctor`: what to check on a box before filing a bug, each finding with a fix.

GPUs (NVML: name, driver, memory, compute capability, MIG, persistence), torch's
CUDA build against the driver, bf16/fp16 support, /dev/shm against the queue's
size, free disk in FLEET_HOME, the open-files limit, the systemd unit and its
user's access to /dev/nvidia*, and the daemon: reachable, ready, key accepted.

Each check is a function returning `Finding`s; the probes that touch the machine
(NVML, torch, statvfs, HTTP) are arguments with real defaults, so the verdicts are
tested with fakes and the verb is tested for real. torch is imported only here,
only when the verb runs (`fleetctl --help` never imports it).
"""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import typer

OK, INFO, WARN, FAIL = "ok", "info", "warn", "fail"


@dataclass(frozen=True)
class Finding:
    check: str
    level: str  # ok | info | warn | fail
    detail: str
    fix: str = ""


# ---- GPUs -----------------------------------------------------------------------------------

def read_nvml() -> dict[str, Any]:
    """What NVML says: {"error": why} when it cannot say, else driver, CUDA driver version and GPUs."""
    try:
        import pynvml
    except ImportError:
        return {"error": "nvidia-ml-py is not installed (pip install nvidia-ml-py)"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return {"error": str(exc)}
    try:
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        out: dict[str, Any] = {"driver": _text(pynvml.nvmlSystemGetDriverVersion()),
                               "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}", "gpus": []}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            gpu = {"index": i, "name": _text(pynvml.nvmlDeviceGetName(h)),
                   "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                   "capability": "%d.%d" % pynvml.nvmlDeviceGetCudaComputeCapability(h)}
            gpu["mig"] = _optional(lambda h=h: pynvml.nvmlDeviceGetMigMode(h)[0] == pynvml.NVML_DEVICE_MIG_ENABLE)
            gpu["persistence"] = _optional(
                lambda h=h: pynvml.nvmlDeviceGetPersistenceMode(h) == pynvml.NVML_FEATURE_ENABLED)
            out["gpus"].append(gpu)
        return out
    finally:
        pynvml.nvmlShutdown()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _optional(read: Callable[[], bool]) -> bool | None:
    try:
        return read()
    except Exception:  # not supported on this GPU/driver: unknown, not a fault
        return None


def read_torch() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"error": "torch is not installed"}
    out: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda,
                           "available": torch.cuda.is_available(), "bf16": [], "fp16": []}
    if out["available"]:
        for i in range(torch.cuda.device_count()):
            major, _ = torch.cuda.get_device_capability(i)
            out["bf16"].append(bool(torch.cuda.is_bf16_supported()) and major >= 8)
            out["fp16"].append(major >= 6)
    return out


def check_gpus(nvml: dict[str, Any], torch_info: dict[str, Any], cpu_class: str) -> list[Finding]:
    if "error" in nvml or not nvml.get("gpus"):
        why = nvml.get("error", "no GPU listed")
        dtype = "bf16 (native)" if "bf16" in cpu_class or "amx" in cpu_class else "fp32 (no native bf16)"
        return [Finding("gpu", INFO, f"no NVIDIA GPU here ({why}); fleet serves on the CPU "
                                     f"(class {cpu_class}, {dtype})",
                        "nothing to fix for a CPU box; on a GPU box install the NVIDIA driver and check `nvidia-smi`")]
    found = []
    for g in nvml["gpus"]:
        extra = []
        if g.get("mig"):
            extra.append("MIG on")
        if g.get("persistence") is False:
            extra.append("persistence off")
        detail = (f"GPU {g['index']}: {g['name']}, {g['memory_bytes'] / (1 << 30):.1f} GiB, "
                  f"sm {g['capability']}, driver {nvml['driver']} (CUDA {nvml['cuda_driver']})"
                  + (f", {', '.join(extra)}" if extra else ""))
        if g.get("mig"):
            found.append(Finding("gpu", WARN, detail + ": MIG slices are separate devices",
                                 "serve with --device cuda:K per MIG instance, or disable MIG: nvidia-smi -i "
                                 f"{g['index']} -mig 0"))
        elif g.get("persistence") is False:
            found.append(Finding("gpu", WARN, detail + ": the driver unloads between uses (slow first request)",
                                 f"sudo nvidia-smi -i {g['index']} -pm 1 (or enable nvidia-persistenced)"))
        else:
            found.append(Finding("gpu", OK, detail))
    return found + check_torch_cuda(nvml, torch_info)


def check_torch_cuda(nvml: dict[str, Any], torch_info: dict[str, Any]) -> list[Finding]:
    if "error" in torch_info:
        return [Finding("torch", FAIL, torch_info["error"], "pip install torch (a CUDA build for this driver)")]
    built = torch_info.get("cuda")
    if not built:
        return [Finding("torch", FAIL, f"torch {torch_info['version']} is a CPU-only build on a box with a GPU",
                        "pip install torch from the CUDA index matching the driver (see pytorch.org)")]
    if _version(built) > _version(nvml["cuda_driver"]):
        return [Finding("torch", FAIL, f"torch is built for CUDA {built}, the driver supports up to "
                                       f"{nvml['cuda_driver']}", "upgrade the NVIDIA driver, or install a torch "
                                                                 f"built for CUDA <= {nvml['cuda_driver']}")]
    if not torch_info["available"]:
        return [Finding("torch", FAIL, f"torch (CUDA {built}) cannot use the GPU", "check CUDA_VISIBLE_DEVICES "
                                                                                   "and access to /dev/nvidia*")]
    dtypes = ", ".join(f"GPU {i}: {'bf16' if b else ('fp16' if f else 'fp32')}"
                       for i, (b, f) in enumerate(zip(torch_info["bf16"], torch_info["fp16"])))
    return [Finding("torch", OK, f"torch {torch_info['version']}, CUDA {built} <= driver {nvml['cuda_driver']}; "
                                 f"fastest dtype {dtypes}")]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


# ---- the box --------------------------------------------------------------------------------

def free_bytes(path: Path) -> tuple[int, int]:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def check_shm(need_bytes: int, read: Callable[[Path], tuple[int, int]] = free_bytes) -> Finding:
    try:
        free, total = read(Path("/dev/shm"))
    except OSError as exc:
        return Finding("shm", FAIL, f"/dev/shm cannot be read: {exc.strerror}", "mount a tmpfs on /dev/shm")
    detail = f"/dev/shm {free / (1 << 20):,.0f} MiB free of {total / (1 << 20):,.0f}; the queue needs " \
             f"{need_bytes / (1 << 20):,.0f} MiB"
    if free < need_bytes:
        return Finding("shm", FAIL, detail, "enlarge it (docker: --shm-size=1g; else mount -o remount,size=1G "
                                            "/dev/shm) or lower queue_slab_bytes")
    return Finding("shm", OK, detail)


def check_disk(home: Path, read: Callable[[Path], tuple[int, int]] = free_bytes, *, low: int = 5 << 30) -> Finding:
    where = home if home.exists() else next((p for p in home.parents if p.exists()), Path("/"))
    free, _ = read(where)
    detail = f"{free / (1 << 30):,.1f} GiB free for FLEET_HOME ({home})"
    if free < low:
        return Finding("disk", WARN, detail + ": models may not fit",
                       "free space, or point FLEET_HOME at a larger disk")
    return Finding("disk", OK, detail)


def check_files(need: int, limits: tuple[int, int] | None = None) -> Finding:
    soft, hard = limits or resource.getrlimit(resource.RLIMIT_NOFILE)
    detail = f"open files: {soft} (hard {hard}); the daemon may hold {need} connections"
    if soft != resource.RLIM_INFINITY and soft < need:
        return Finding("files", WARN, detail, f"ulimit -n {min(hard, need * 2)} before `fleetctl serve` "
                                              "(the systemd unit sets LimitNOFILE)")
    return Finding("files", OK, detail)


def check_unit(unit_dirs: tuple[str, ...], gpus: int) -> Finding:
    from fleetctl.commands.service import UNIT_NAME

    unit = next((Path(d) / UNIT_NAME for d in unit_dirs if (Path(d) / UNIT_NAME).is_file()), None)
    if unit is None:
        return Finding("service", INFO, f"{UNIT_NAME} is not installed", "sudo fleetctl service install "
                                                                         "(runs the daemon at boot)")
    text = unit.read_text(errors="replace")
    user = next((ln.split("=", 1)[1].strip() for ln in text.splitlines() if ln.startswith("User=")), "root")
    allowed = any(ln.startswith("DeviceAllow=") and "nvidia" in ln for ln in text.splitlines())
    if gpus and not allowed:
        return Finding("service", WARN, f"{unit} does not allow /dev/nvidia* (DeviceAllow)",
                       "sudo fleetctl service install --force (re-renders the unit)")
    if gpus and not _can_open_gpu(user):
        return Finding("service", WARN, f"{unit} runs as {user}, who cannot open /dev/nvidia0",
                       f"sudo usermod -aG video {user} (or the group owning /dev/nvidia0)")
    return Finding("service", OK, f"{unit} installed, runs as {user}")


def _can_open_gpu(user: str) -> bool:
    import grp
    import pwd

    dev = Path("/dev/nvidia0")
    if not dev.exists():
        return False
    st = dev.stat()
    if user == "root" or st.st_mode & 0o006:
        return True
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        return False
    groups = {g.gr_gid for g in grp.getgrall() if user in g.gr_mem} | {pw.pw_gid}
    return pw.pw_uid == st.st_uid or (st.st_gid in groups and bool(st.st_mode & 0o060))


# ---- FLEET_HOME's files ---------------------------------------------------------------------

def check_store(store: Any) -> list[Finding]:
    """Stored models whose manifest cannot be read: listed nowhere and not served; the others serve."""
    from fleet.store import damage_fix

    found = [Finding("store", WARN, f"{why}: it is neither listed nor served ({store.root / name})",
                     damage_fix(name)) for name, why in store.damage()]
    return found or [Finding("store", OK, f"{len(store.names())} model(s) stored, every manifest readable")]


def check_catalog(home: Path) -> Finding:
    """FLEET_HOME/models.toml, the catalog override: `serve`, `pull` and `tune` stop on one that does not load."""
    from fleet.catalog import load_catalog
    from fleet.errors import FleetError

    try:
        catalog = load_catalog(home)
    except FleetError as exc:
        return Finding("catalog", FAIL, exc.message, f"fix {home / 'models.toml'}, or move it away")
    return Finding("catalog", OK, f"{len(catalog.all())} catalog entries ({', '.join(map(str, catalog.files))})")


def check_set_aside(home: Path) -> list[Finding]:
    """Damaged files the daemon set aside and started without: the batch store
    (`batches.damaged-*`: daemon.jobstore) and the pins file (`pins.json.damaged-*`: fleet.pins)."""
    from fleet.daemon.jobstore import DAMAGED_PREFIX
    from fleet.pins import PINS_FILE

    found = []
    for what, prefix, lost in (("the batch store", DAMAGED_PREFIX, "its batches and files are not served"),
                               ("the pins file", f"{PINS_FILE}.damaged-", "its pins are not kept")):
        for aside in sorted(home.glob(prefix + "*")) if home.is_dir() else ():
            found.append(Finding("damaged", WARN, f"{what} was damaged and set aside as {aside}: {lost}",
                                 f"repair it and put it back while the daemon is stopped, or remove {aside}"))
    return found


# ---- the daemon -----------------------------------------------------------------------------

def check_daemon(url: str, key: str | None, get: Callable[..., Any] | None = None) -> list[Finding]:
    import httpx

    get = get or httpx.get
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        health = get(url + "/healthz", timeout=3)
    except httpx.TransportError as exc:
        return [Finding("daemon", INFO, f"no daemon answers at {url} ({type(exc).__name__})",
                        "start it with `fleetctl serve`, or point FLEET_URL at it")]
    if health.status_code != 200:
        return [Finding("daemon", FAIL, f"{url}/healthz answered {health.status_code}", "read the daemon's log "
                                                                                        "(journalctl -u fleetd)")]
    ready = get(url + "/readyz", headers=headers, timeout=3)
    if ready.status_code == 401:
        why = "no key was sent" if not key else "the key was refused"
        return [Finding("daemon", FAIL, f"{url} wants an API key: {why}",
                        "set FLEET_API_KEY (or FLEET_API_KEY_FILE) to the daemon's key")]
    body = _json(ready)
    # Pins (preloads, persisted pins) the daemon cannot serve: readiness names them, ready or not.
    unservable = [Finding("pins", WARN, f"{name} is pinned but cannot be served: {why}",
                          f"fleetctl unpin {name} (or take it out of preload), or make room for it")
                  for name, why in sorted(body.get("unservable", {}).items())]
    if ready.status_code != 200:
        status = body.get("status", ready.status_code)
        return [Finding("daemon", WARN, f"{url} is up but not ready: {status}", "fleetctl ps (what is loading)"),
                *unservable]
    return [Finding("daemon", OK, f"{url} is up and ready" + (" (key accepted)" if key else "")), *unservable]


def _json(response: Any) -> dict:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


# ---- the verb -------------------------------------------------------------------------------

def run_checks() -> list[Finding]:
    from fleet.config import client_url, load_settings
    from fleetctl.commands.service import SYSTEM_UNIT_DIRS
    from fleet.runtimes.device import device_class

    from fleet.config import Settings, default_home
    from fleet.errors import FleetError
    from fleet.store import Store

    config: list[Finding] = []
    try:
        settings = load_settings()
    except FleetError as exc:  # the checks below run on the defaults
        config.append(Finding("config", FAIL, exc.message, exc.hint or "fix config.toml, or move it away"))
        settings = Settings(home=default_home())
    nvml = read_nvml()
    gpus = len(nvml.get("gpus", []))
    findings = check_gpus(nvml, read_torch() if gpus else {}, device_class("cpu"))
    # The queue: its slab plus a small header per slot (local_queue's layout).
    findings.append(check_shm(settings.queue_slab_bytes + settings.queue_slots * 64))
    findings.append(check_disk(settings.home_path))
    findings.append(check_files(settings.max_connections + 64))
    findings.append(check_unit(SYSTEM_UNIT_DIRS, gpus))
    findings += config + [check_catalog(settings.home_path)] + check_store(Store(settings.store_path))
    findings += check_set_aside(settings.home_path)
    findings += check_daemon(client_url(), os.environ.get("FLEET_API_KEY") or _key_file())
    return findings


def _key_file() -> str | None:
    path = os.environ.get("FLEET_API_KEY_FILE")
    if not path:
        return None
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def register(app: typer.Typer) -> None:
    @app.command()
    def doctor(as_json: bool = typer.Option(False, "--json", help="Print the findings as JSON.")) -> None:
        """Check this box for fleet (GPUs, CUDA, memory, disk, limits, service, daemon), with a fix for each."""
        findings = run_checks()
        if as_json:
            print(json.dumps([asdict(f) for f in findings], indent=2))
        else:
            _print(findings)
        raise typer.Exit(1 if any(f.level == FAIL for f in findings) else 0)


def _print(findings: list[Finding]) -> None:
    from rich.console import Console
    from rich.markup import escape

    out = Console(highlight=False, soft_wrap=True)
    style = {OK: "green", INFO: "cyan", WARN: "yellow", FAIL: "bold red"}
    for f in findings:
        out.print(f"[{style[f.level]}]{f.level:>4}[/] {f.check:<8} {escape(f.detail)}")
        if f.fix and f.level != OK:
            out.print(f"              [dim]fix: {escape(f.fix)}[/]")
