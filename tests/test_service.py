"""`fleetctl service`: the unit it writes, checked by systemd's own tools, and the install cycle."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fleetctl.commands.service import (
    REFERENCE_FLEETCTL,
    render_sysusers,
    render_unit,
    this_fleetctl,
)

ROOT = Path(__file__).resolve().parents[1]
FLEETCTL = str(Path(sys.executable).parent / "fleetctl")
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze not installed (apt-get install -y systemd)")


def fleetctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FLEETCTL, *args], capture_output=True, text=True, timeout=120)


def directives(unit: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in unit.splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def verify(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ANALYZE, "verify", str(path)], capture_output=True, text=True, timeout=120)


def test_print_shows_this_environments_unit_and_writes_nothing(tmp_path):
    proc = fleetctl("service", "install", "--print", "--prefix", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    unit = directives(proc.stdout)
    assert unit["ExecStart"] == [f"{FLEETCTL} serve"]
    assert unit["Type"] == ["notify"] and unit["Restart"] == ["on-failure"]
    assert "would write" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_install_status_uninstall_cycle_in_a_prefix(tmp_path):
    proc = fleetctl("service", "install", "--prefix", str(tmp_path), "--port", "7801")
    assert proc.returncode == 0, proc.stderr
    unit_path = tmp_path / "etc/systemd/system/fleetd.service"
    sysusers = tmp_path / "etc/sysusers.d/fleet.conf"
    assert directives(unit_path.read_text())["Environment"][-1] == "FLEET_PORT=7801"
    assert sysusers.read_text() == render_sysusers()
    # Not the live system: it says what to run instead of running it.
    assert "to finish, run" in proc.stderr
    assert "systemctl enable --now fleetd.service" in proc.stderr

    status = json.loads(fleetctl("service", "status", "--prefix", str(tmp_path), "--json").stdout)
    assert status["installed"] is True and status["this_environment"] is True
    assert status["unit"] == str(unit_path)
    assert status["active"] is None  # no systemctl to ask

    # A unit from another environment is told apart.
    unit_path.write_text(unit_path.read_text().replace(FLEETCTL, "/opt/other/bin/fleetctl"))
    status = json.loads(fleetctl("service", "status", "--prefix", str(tmp_path), "--json").stdout)
    assert status["installed"] is True and status["this_environment"] is False

    proc = fleetctl("service", "uninstall", "--prefix", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert not unit_path.exists() and not sysusers.exists()
    status = json.loads(fleetctl("service", "status", "--prefix", str(tmp_path), "--json").stdout)
    assert status["installed"] is False
    assert "not installed" in fleetctl("service", "uninstall", "--prefix", str(tmp_path)).stderr


def test_unit_dir_moves_only_the_unit(tmp_path):
    units = tmp_path / "units"
    assert fleetctl("service", "install", "--prefix", str(tmp_path), "--unit-dir", str(units)).returncode == 0
    assert (units / "fleetd.service").is_file()
    assert (tmp_path / "etc/sysusers.d/fleet.conf").is_file()
    assert not (tmp_path / "etc/systemd").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--user", "Root!"], "invalid user name"),
        (["--port", "70000"], "invalid port"),
        (["--host", "a b"], "invalid host"),
    ],
)
def test_bad_options_are_refused_and_write_nothing(tmp_path, args, message):
    proc = fleetctl("service", "install", "--prefix", str(tmp_path), *args)
    assert proc.returncode == 1
    assert message in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_exposed_host_without_key_is_flagged(tmp_path):
    proc = fleetctl("service", "install", "--prefix", str(tmp_path), "--host", "0.0.0.0")
    assert proc.returncode == 0
    assert "needs an API key" in proc.stderr
    key = tmp_path / "api_key"
    key.write_text("x" * 32)
    proc = fleetctl("service", "install", "--prefix", str(tmp_path), "--host", "0.0.0.0", "--api-key-file", str(key))
    assert "needs an API key" not in proc.stderr
    unit = directives((tmp_path / "etc/systemd/system/fleetd.service").read_text())
    assert unit["LoadCredential"] == [f"api_key:{key}"]
    assert "FLEET_API_KEY_FILE=%d/api_key" in unit["Environment"]


@needs_analyze
def test_unit_passes_systemd_analyze_verify(tmp_path):
    key = tmp_path / "key"
    key.write_text("k" * 32)
    unit = tmp_path / "fleetd.service"
    unit.write_text(render_unit(FLEETCTL, environment={"FLEET_HOST": "0.0.0.0"}, api_key_file=str(key),
                                nvidia_modprobe="/usr/bin/nvidia-modprobe"))
    proc = verify(unit)
    assert proc.returncode == 0, proc.stderr
    # verify reports unknown keys and bad values as warnings with rc 0.
    assert [line for line in proc.stderr.splitlines() if "fleetd.service" in line] == []


@needs_analyze
def test_odd_venv_paths_are_quoted_so_systemd_finds_the_binary(tmp_path):
    odd = tmp_path / "my venvs" / "100% fleet" / "bin"
    odd.mkdir(parents=True)
    (odd / "fleetctl").symlink_to(FLEETCTL)
    unit = tmp_path / "fleetd.service"
    unit.write_text(render_unit(str(odd / "fleetctl")))
    proc = verify(unit)
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stderr.splitlines() if "fleetd.service" in line] == []
    # And verify really checks ExecStart: a missing binary fails.
    unit.write_text(render_unit(str(tmp_path / "missing" / "fleetctl")))
    assert verify(unit).returncode != 0


@needs_analyze
def test_sandbox_exposure_is_low(tmp_path):
    unit = tmp_path / "fleetd.service"
    unit.write_text(render_unit(FLEETCTL))
    proc = subprocess.run([ANALYZE, "security", "--offline=true", str(unit)],
                          capture_output=True, text=True, timeout=120)
    match = re.search(r"Overall exposure level for fleetd.service: ([\d.]+) (\w+)", proc.stdout + proc.stderr)
    assert match, proc.stdout + proc.stderr
    assert float(match.group(1)) <= 2.5 and match.group(2) in ("SAFE", "OK")


def test_sandbox_keeps_shared_memory_gpus_and_state_reachable():
    unit = directives(render_unit(FLEETCTL))
    # /dev/shm (queue segments, named semaphores) must stay the host's and writable.
    assert "PrivateDevices" not in unit and "PrivateIPC" not in unit
    assert not any("/dev" in v for k in ("InaccessiblePaths", "ReadOnlyPaths", "TemporaryFileSystem")
                   for v in unit.get(k, []))
    assert unit["ProtectSystem"] == ["strict"] and unit["PrivateTmp"] == ["yes"] and unit["RemoveIPC"] == ["yes"]
    assert unit["DevicePolicy"] == ["closed"] and unit["DeviceAllow"] == ["char-nvidia* rw"]
    assert unit["StateDirectory"] == ["fleet"] and unit["RuntimeDirectory"] == ["fleet"]
    assert "FLEET_HOME=/var/lib/fleet" in unit["Environment"]
    assert unit["NoNewPrivileges"] == ["yes"] and unit["ProtectHome"] == ["yes"]
    assert unit["User"] == ["fleet"] and unit["WatchdogSec"] == ["30s"]


def test_venv_under_home_stays_visible():
    unit = directives(render_unit("/home/ana/venv/bin/fleetctl"))
    assert unit["ProtectHome"] == ["read-only"]


def test_checked_in_files_are_the_renderers_output():
    assert (ROOT / "systemd/fleetd.service").read_text() == render_unit(
        REFERENCE_FLEETCTL, nvidia_modprobe="/usr/bin/nvidia-modprobe")
    assert (ROOT / "systemd/fleet.sysusers.conf").read_text() == render_sysusers()


def test_this_fleetctl_is_this_venvs_script():
    assert str(this_fleetctl()) == FLEETCTL
    assert os.access(FLEETCTL, os.X_OK)
