"""`fleetctl service install | uninstall | status`: run the daemon under systemd.

The unit is rendered for this machine: ExecStart is this Python environment's
`fleetctl serve`, so a unit written from one venv keeps serving that venv.
`systemd/fleetd.service` in the repository is the same renderer's output for a
venv in /opt/fleet (tests keep the two in step).

Files written (under `--prefix`, default `/`):
  etc/systemd/system/fleetd.service   the unit (`--unit-dir` moves it)
  etc/sysusers.d/fleet.conf           the dedicated `fleet` user
systemctl / systemd-sysusers run only when systemd is running and the prefix is
`/`; otherwise the commands to run are printed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import typer
from rich.console import Console

from fleet.config import DEFAULT_PORT
from fleet.errors import BadRequest, FleetError

UNIT_NAME = "fleetd.service"
SYSUSERS_NAME = "fleet.conf"
STATE_DIR = "/var/lib/fleet"
ENV_FILE = "/etc/fleet/fleetd.env"
#: The venv the checked-in `systemd/fleetd.service` is rendered for.
REFERENCE_FLEETCTL = "/opt/fleet/venv/bin/fleetctl"
#: Directories systemd loads system units from; a unit written elsewhere is not systemctl's business.
SYSTEM_UNIT_DIRS = ("/etc/systemd/system", "/run/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system")
_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,30}$")
_HOME_ROOTS = ("/home", "/root", "/run/user")

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

UNIT_TEMPLATE = """\
# fleetd: the fleet model server. Written by `fleetctl service install`;
# run it again after moving or recreating the Python environment.
[Unit]
Description=fleet model server (fleetctl serve)
After=network-online.target nvidia-persistenced.service
Wants=network-online.target
StartLimitIntervalSec=300
StartLimitBurst=5

[Service]
# READY=1 comes only once the API socket is serving and pinned models are
# loaded (daemon/notify.py); loading can take minutes on a cold box.
Type=notify
NotifyAccess=main
{exec_start_pre}ExecStart={exec_start}
# SIGHUP reloads models.toml and config.toml without dropping requests.
ExecReload=/bin/kill -HUP $MAINPID
Restart=on-failure
RestartSec=2s
TimeoutStartSec=600
# The daemon feeds the watchdog every WatchdogSec/2 while its workers are healthy.
WatchdogSec=30s
# SIGTERM reaches the daemon only: it sends STOPPING=1, drains and stops its
# workers itself; anything left after TimeoutStopSec is SIGKILLed.
KillMode=mixed
TimeoutStopSec=60

User={user}
Group={user}
StateDirectory=fleet
StateDirectoryMode=0750
# Lock files and sockets: /run/fleet, also given to the daemon as $RUNTIME_DIRECTORY.
RuntimeDirectory=fleet
RuntimeDirectoryMode=0750
CacheDirectory=fleet
WorkingDirectory={state_dir}
Environment=FLEET_HOME={state_dir}
Environment=XDG_CACHE_HOME=/var/cache/fleet
Environment=PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
{environment}# FLEET_API_KEY=... and other FLEET_* settings go here (mode 0600).
EnvironmentFile=-{env_file}
UMask=0027
LimitNOFILE=65536

# Sandbox. The local queue is POSIX shared memory plus named semaphores, both
# files in /dev/shm: PrivateTmp covers only /tmp and /var/tmp, and
# ProtectSystem=strict leaves /dev writable, so the host /dev/shm stays usable.
# RemoveIPC drops this user's segments when the unit stops, so a crashed
# daemon leaves nothing stale for the next start.
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome={protect_home}
PrivateTmp=yes
PrivateMounts=yes
ProtectProc=invisible
RemoveIPC=yes
# Only pseudo devices (/dev/null, /dev/urandom, ...) and the NVIDIA character
# devices (/dev/nvidia*, /dev/nvidia-uvm, /dev/nvidia-caps/*).
DevicePolicy=closed
DeviceAllow=char-nvidia* rw
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
CapabilityBoundingSet=
AmbientCapabilities=
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallFilter=~@privileged
SystemCallErrorNumber=EPERM
# MemoryDenyWriteExecute stays off: the CUDA driver JIT-compiles kernels into
# writable, executable pages. @resources stays allowed: OpenMP and NUMA-aware
# allocators set CPU affinity and memory policy. PrivateDevices would hide the GPUs.

[Install]
WantedBy=multi-user.target
"""

SYSUSERS_TEMPLATE = """\
# The user fleetd runs as (systemd-sysusers). Its home is the state directory.
u {user} - "fleet model server" {state_dir} /usr/sbin/nologin
# /dev/nvidia* may be group-restricted (NVreg_DeviceFileMode=0660, group video).
m {user} video
"""


def unit_quote(word: str) -> str:
    """One word for an Exec/Environment line: `%` and `$` escaped, quoted if it has spaces."""
    word = word.replace("%", "%%").replace("$", "$$")
    if re.search(r'[\s"\'\\;]', word):
        word = '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return word


def under_home(path: str) -> bool:
    return any(path == root or path.startswith(root + "/") for root in _HOME_ROOTS)


def render_unit(
    fleetctl: str,
    *,
    user: str = "fleet",
    environment: dict[str, str] | None = None,
    api_key_file: str | None = None,
    nvidia_modprobe: str | None = None,
) -> str:
    """The unit text. A venv under /home or /root gets ProtectHome=read-only (it must stay visible)."""
    lines = [f"Environment={unit_quote(k + '=' + v)}" for k, v in sorted((environment or {}).items())]
    if api_key_file:
        # Read by systemd (root) and handed over as a credential in %d
        # ($CREDENTIALS_DIRECTORY): the service user needs no access to the original.
        # LoadCredential takes the rest of the line as the path: no quoting, only specifiers escaped.
        lines.append(f"LoadCredential=api_key:{api_key_file.replace('%', '%%')}")
        lines.append("Environment=FLEET_API_KEY_FILE=%d/api_key")
    pre = ""
    if nvidia_modprobe:
        # NoNewPrivileges stops the setuid nvidia-modprobe CUDA would call to create
        # /dev/nvidia-uvm, so it runs first, privileged ("+"), and may fail ("-") on a box without it.
        pre = f"ExecStartPre=-+{unit_quote(nvidia_modprobe)} -u\n"
    return UNIT_TEMPLATE.format(
        exec_start=f"{unit_quote(fleetctl)} serve",
        exec_start_pre=pre,
        user=user,
        state_dir=STATE_DIR,
        environment="".join(line + "\n" for line in lines),
        env_file=ENV_FILE,
        protect_home="read-only" if under_home(fleetctl) else "yes",
    )


def render_sysusers(user: str = "fleet") -> str:
    return SYSUSERS_TEMPLATE.format(user=user, state_dir=STATE_DIR)


def this_fleetctl() -> Path:
    """This environment's `fleetctl` script (not resolved: a venv's bin/ is the stable path)."""
    for candidate in (Path(sys.executable).parent / "fleetctl", Path(sys.prefix) / "bin" / "fleetctl"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate.absolute()
    raise FleetError(
        f"no fleetctl script next to {sys.executable}",
        hint="install fleet into this environment first: pip install '.[server]'",
    )


def unreadable_by_others(path: Path) -> Path | None:
    """The first directory above `path` that other users cannot traverse, if any."""
    for parent in reversed(path.parents):
        try:
            mode = parent.stat().st_mode
        except OSError:
            return parent
        if not mode & stat.S_IXOTH:
            return parent
    return None


def systemd_running() -> bool:
    # sd_booted(): systemd creates this directory when it is PID 1.
    return Path("/run/systemd/system").is_dir()


class Layout:
    def __init__(self, prefix: Path, unit_dir: Path | None) -> None:
        self.prefix = prefix
        self.unit_dir = unit_dir if unit_dir is not None else prefix / "etc/systemd/system"
        self.unit = self.unit_dir / UNIT_NAME
        self.sysusers = prefix / "etc/sysusers.d" / SYSUSERS_NAME

    @property
    def live(self) -> bool:
        """True when systemctl would see these files: systemd runs and they are the system's own."""
        return (
            systemd_running()
            and self.prefix.resolve() == Path("/")
            and str(self.unit_dir.resolve()) in SYSTEM_UNIT_DIRS
        )


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _run_checked(cmd: list[str]) -> None:
    err.print(f"[dim]$ {' '.join(cmd)}[/]")
    proc = _run(cmd)
    if proc.returncode != 0:
        raise FleetError(
            f"`{' '.join(cmd)}` failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()}",
            hint="journalctl -u fleetd -e  shows why the service did not start",
        )


def _write(path: Path, text: str) -> None:
    from fleet.files import replace_file

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, text.encode(), what=str(path))  # a full disk: one line, no half-written unit
    except PermissionError:
        raise FleetError(
            f"cannot write {path}: permission denied",
            hint=f"run it as root: sudo {this_fleetctl()} service install",
        ) from None


def _validate(user: str, host: str | None, port: int | None) -> dict[str, str]:
    if not _NAME.match(user):
        raise BadRequest(f"invalid user name {user!r}: lower-case letters, digits, '_' and '-', at most 31")
    env: dict[str, str] = {}
    if host is not None:
        if not host or any(c.isspace() for c in host) or "=" in host:
            raise BadRequest(f"invalid host {host!r}")
        env["FLEET_HOST"] = host
    if port is not None:
        if not 0 < port < 65536:
            raise BadRequest(f"invalid port {port}: 1..65535")
        env["FLEET_PORT"] = str(port)
    return env


def _read_exec_start(unit: Path) -> str | None:
    for line in unit.read_text().splitlines():
        if line.startswith("ExecStart="):
            return line.removeprefix("ExecStart=")
    return None


def register(app: typer.Typer) -> None:
    service = typer.Typer(help="Run the daemon as a systemd service on this box.", no_args_is_help=True)
    app.add_typer(service, name="service")

    prefix_opt = typer.Option(Path("/"), "--prefix", help="Root to install under (tests, image builds).")
    unit_dir_opt = typer.Option(None, "--unit-dir", help="Directory for fleetd.service (default PREFIX/etc/systemd/system).")

    @service.command()
    def install(
        prefix: Path = prefix_opt,
        unit_dir: Path = unit_dir_opt,
        user: str = typer.Option("fleet", help="User the service runs as (created by systemd-sysusers)."),
        host: str = typer.Option(None, help="Bind address for the service (default 127.0.0.1)."),
        port: int = typer.Option(None, help=f"Port for the service (default {DEFAULT_PORT})."),
        api_key_file: Path = typer.Option(None, "--api-key-file", help="File holding FLEET_API_KEY, passed as a systemd credential."),
        start: bool = typer.Option(True, "--start/--no-start", help="Start it now (else only enable)."),
        show: bool = typer.Option(False, "--print", "--dry-run", help="Print the unit; write and run nothing."),
    ) -> None:
        """Write fleetd.service for this Python environment and enable it."""
        from fleet.daemon.auth import is_loopback

        env = _validate(user, host, port)
        fleetctl = this_fleetctl()
        key_file = str(api_key_file.absolute()) if api_key_file else None
        unit = render_unit(str(fleetctl), user=user, environment=env, api_key_file=key_file,
                           nvidia_modprobe=shutil.which("nvidia-modprobe"))
        layout = Layout(prefix, unit_dir)
        if show:
            sys.stdout.write(unit)
            err.print(f"[dim]would write {layout.unit} and {layout.sysusers}[/]")
            return

        if host is not None and not is_loopback(host) and key_file is None:
            err.print(f"[yellow]note[/]: binding {host} needs an API key: put FLEET_API_KEY=... in {ENV_FILE} "
                      "or pass --api-key-file, else the daemon refuses to start")
        if under_home(str(fleetctl)):
            err.print(f"[yellow]note[/]: {fleetctl} is under a home directory; the unit uses ProtectHome=read-only. "
                      "A venv in /opt/fleet is the usual place.")
        blocked = unreadable_by_others(fleetctl)
        if blocked is not None:
            err.print(f"[yellow]warning[/]: {blocked} is not traversable by other users; user {user} "
                      f"cannot run {fleetctl}. Install fleet in a venv outside it (e.g. /opt/fleet/venv).")

        _write(layout.unit, unit)
        _write(layout.sysusers, render_sysusers(user))
        out.print(f"wrote {layout.unit}")
        out.print(f"wrote {layout.sysusers}")
        steps = [
            ["systemd-sysusers", str(layout.sysusers)],
            ["systemctl", "daemon-reload"],
            ["systemctl", "enable", *(["--now"] if start else []), UNIT_NAME],
        ]
        if not layout.live:
            why = "systemd is not running here" if not systemd_running() else f"{layout.unit_dir} is not a system unit directory"
            err.print(f"{why}; to finish, run on the target system:")
            for cmd in steps:
                err.print("  " + " ".join(cmd), markup=False)
            return
        for cmd in steps:
            _run_checked(cmd)
        err.print(f"fleetd {'started' if start else 'enabled'}; logs: journalctl -u fleetd -f")

    @service.command()
    def uninstall(prefix: Path = prefix_opt, unit_dir: Path = unit_dir_opt) -> None:
        """Stop and disable fleetd and remove its files (the state in /var/lib/fleet stays)."""
        layout = Layout(prefix, unit_dir)
        if not layout.unit.exists() and not layout.sysusers.exists():
            err.print(f"fleetd is not installed ({layout.unit} does not exist)")
            return
        live = layout.live
        if live:
            _run_checked(["systemctl", "disable", "--now", UNIT_NAME])
        for path in (layout.unit, layout.sysusers):
            try:
                path.unlink(missing_ok=True)
            except PermissionError:
                raise FleetError(f"cannot remove {path}: permission denied", hint="run it as root (sudo)") from None
            out.print(f"removed {path}")
        if live:
            _run_checked(["systemctl", "daemon-reload"])
        else:
            err.print("systemd is not running here; on the target system run: "
                      f"systemctl disable --now {UNIT_NAME} && systemctl daemon-reload", markup=False)
        err.print(f"[dim]kept {STATE_DIR} (models, pins, config) and the user; remove them by hand if wanted[/]")

    @service.command()
    def status(
        prefix: Path = prefix_opt,
        unit_dir: Path = unit_dir_opt,
        as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        """Is fleetd installed, does it run this environment's fleetctl, is it active?"""
        layout = Layout(prefix, unit_dir)
        installed = layout.unit.is_file()
        exec_start = _read_exec_start(layout.unit) if installed else None
        try:
            here = f"{unit_quote(str(this_fleetctl()))} serve"
        except FleetError:
            here = None
        info: dict[str, object] = {
            "unit": str(layout.unit),
            "installed": installed,
            "exec_start": exec_start,
            "this_environment": installed and exec_start == here,
            "systemd": systemd_running(),
            "active": None,
            "enabled": None,
        }
        if layout.live:
            info["active"] = _run(["systemctl", "is-active", UNIT_NAME]).stdout.strip() or None
            info["enabled"] = _run(["systemctl", "is-enabled", UNIT_NAME]).stdout.strip() or None
        if as_json:
            sys.stdout.write(json.dumps(info) + "\n")
            return
        for key, value in info.items():
            out.print(f"{key:<17} {'-' if value is None else value}", markup=False)
        if installed and not info["this_environment"]:
            err.print("[yellow]note[/]: the unit runs another environment's fleetctl; "
                      "`fleetctl service install` rewrites it for this one")
        elif not installed:
            err.print("[dim]hint: fleetctl service install[/]")
