"""`fleetctl doctor`: findings with a fix each; plain and exit 0 on a CPU box (issue 18, deliverable 1).

The verdicts are tested with the machine probes replaced by fakes (NVML, torch,
statvfs, HTTP: a GPU box cannot exist here, and this test says so); the verb
itself runs for real, as a subprocess, on this CPU box and against a real daemon.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx

from fleetctl.commands import doctor as d
from tests.conftest import start_daemon

GPU = {"driver": "580.65", "cuda_driver": "13.0",
       "gpus": [{"index": 0, "name": "NVIDIA H200", "memory_bytes": 141 << 30, "capability": "9.0",
                 "mig": False, "persistence": True}]}
TORCH = {"version": "2.13.0", "cuda": "12.8", "available": True, "bf16": [True], "fp16": [True]}


def levels(findings):
    return [(f.check, f.level) for f in findings]


def test_a_cpu_box_is_said_plainly_not_as_a_fault():
    [f] = d.check_gpus({"error": "NVML Shared Library Not Found"}, {}, "cpu-avx2")
    assert f.level == d.INFO and "no NVIDIA GPU" in f.detail and "CPU" in f.detail and f.fix


def test_gpu_findings_name_the_card_and_the_fastest_dtype():
    found = d.check_gpus(GPU, TORCH, "cpu")
    assert levels(found) == [("gpu", d.OK), ("torch", d.OK)]
    assert "H200" in found[0].detail and "sm 9.0" in found[0].detail and "bf16" in found[1].detail


def test_torch_built_for_a_newer_cuda_than_the_driver_fails_with_the_fix():
    old_driver = {**GPU, "cuda_driver": "12.2"}
    [_, torch] = d.check_gpus(old_driver, TORCH, "cpu")
    assert torch.level == d.FAIL and "12.8" in torch.detail and "12.2" in torch.detail and "driver" in torch.fix
    [_, cpu_build] = d.check_gpus(GPU, {**TORCH, "cuda": None}, "cpu")
    assert cpu_build.level == d.FAIL and "CPU-only" in cpu_build.detail


def test_mig_and_persistence_are_warnings_with_commands():
    mig = {**GPU, "gpus": [{**GPU["gpus"][0], "mig": True}]}
    assert d.check_gpus(mig, TORCH, "cpu")[0].level == d.WARN
    off = {**GPU, "gpus": [{**GPU["gpus"][0], "persistence": False}]}
    warn = d.check_gpus(off, TORCH, "cpu")[0]
    assert warn.level == d.WARN and "nvidia-smi" in warn.fix and "-pm 1" in warn.fix


def test_shm_disk_and_files_limits():
    small = d.check_shm(256 << 20, read=lambda _: (64 << 20, 64 << 20))
    assert small.level == d.FAIL and "shm-size" in small.fix
    assert d.check_shm(256 << 20, read=lambda _: (1 << 30, 1 << 30)).level == d.OK
    assert d.check_disk(d.Path("/nonexistent/home"), read=lambda _: (1 << 30, 1 << 40)).level == d.WARN
    assert d.check_files(1088, limits=(256, 4096)).level == d.WARN
    assert d.check_files(1088, limits=(65536, 65536)).level == d.OK


def test_unit_without_gpu_access_is_named(tmp_path):
    from fleetctl.commands.service import UNIT_NAME

    assert d.check_unit((str(tmp_path),), gpus=0).level == d.INFO  # not installed
    (tmp_path / UNIT_NAME).write_text("[Service]\nUser=fleet\nExecStart=/x\n")
    missing = d.check_unit((str(tmp_path),), gpus=1)
    assert missing.level == d.WARN and "DeviceAllow" in missing.detail
    assert d.check_unit((str(tmp_path),), gpus=0).level == d.OK


def run_doctor(env: dict[str, str]) -> subprocess.CompletedProcess:
    # This process's key never leaks in: only a key the test passes in `env` is used.
    full = {k: v for k, v in os.environ.items() if k != "FLEET_API_KEY"}
    return subprocess.run([sys.executable, "-m", "fleetctl", "doctor", "--json"], capture_output=True, text=True,
                          env={**full, **env}, timeout=120)


def test_doctor_on_this_box_exits_0_and_sees_the_daemon_and_its_key(tmp_path):
    from fleet.bench.daemon import free_port

    nobody = run_doctor({"FLEET_HOME": str(tmp_path / "h0"), "FLEET_URL": f"http://127.0.0.1:{free_port()}"})
    assert nobody.returncode == 0, nobody.stderr
    found = {f["check"]: f for f in json.loads(nobody.stdout)}
    assert {"gpu", "shm", "disk", "files", "service", "daemon"} <= set(found)
    assert found["daemon"]["level"] == "info" and "fleetctl serve" in found["daemon"]["fix"]
    assert all(f["fix"] for f in found.values() if f["level"] != "ok")
    key = "doctor-key-" + "x7Qp2mZr9LkV3nWb"
    daemon = start_daemon(tmp_path / "h1", extra_env={"FLEET_API_KEY": key}, wait_ready=False)
    try:
        for _ in range(600):  # readiness needs the key now
            try:
                if httpx.get(daemon.url + "/readyz", headers={"Authorization": f"Bearer {key}"},
                             timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert daemon.proc.poll() is None, daemon.tail()
            time.sleep(0.3)
        no_key = run_doctor({"FLEET_HOME": str(tmp_path / "h1"), "FLEET_URL": daemon.url})
        refused = {f["check"]: f for f in json.loads(no_key.stdout)}["daemon"]
        assert no_key.returncode == 1 and refused["level"] == "fail" and "FLEET_API_KEY" in refused["fix"]
        good = run_doctor({"FLEET_HOME": str(tmp_path / "h1"), "FLEET_URL": daemon.url, "FLEET_API_KEY": key})
        ok = {f["check"]: f for f in json.loads(good.stdout)}["daemon"]
        assert good.returncode == 0 and ok["level"] == "ok" and "key accepted" in ok["detail"]
    finally:
        daemon.stop()
