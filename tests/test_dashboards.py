"""The Grafana dashboard and the Prometheus alert rules in deploy/ name only series that
exist: every metric their expressions reference is a family on a live daemon's /metrics
(the session daemon's), the NATS ones included (defined on every daemon, with samples
only with --nats: `Metrics.set_nats_lag` is checked to give them samples). The files
are well-formed: the rules load as Prometheus rule groups with the alerts the issue
asks for, the dashboard's panels each have a query.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import yaml

from fleet.daemon.metrics import Metrics
from tests.conftest import DaemonProc

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "deploy" / "prometheus" / "fleet-alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "fleet-dashboard.json"
#: Series a scrape of a NATS box gives samples (daemon/cluster.py's heartbeat reads them).
NATS_ONLY = {"fleet_nats_pending_messages", "fleet_nats_unacked_messages", "fleet_nats_oldest_wait_seconds"}

_SERIES = re.compile(r"\b((?:fleet|process)_[a-z_]+)\b")
_SUFFIXES = ("_bucket", "_sum", "_count")


def expressions() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    dash = json.loads(DASHBOARD.read_text())
    exprs += [t["expr"] for panel in dash["panels"] for t in panel["targets"]]
    exprs += [v["query"] for v in dash["templating"]["list"] if v.get("type") == "query"]
    return exprs


def families(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def family_of(series: str, known: set[str]) -> str | None:
    if series in known:
        return series
    for suffix in _SUFFIXES:
        if series.endswith(suffix) and series[:-len(suffix)] in known:
            return series[:-len(suffix)]
    return None


def test_files_are_well_formed() -> None:
    rules = yaml.safe_load(ALERTS.read_text())
    alerts = {rule["alert"]: rule for group in rules["groups"] for rule in group["rules"]}
    assert {"FleetOverloaded", "FleetQueueAge", "FleetEvictionThrash", "FleetWorkerRestarts",
            "FleetNatsLag", "FleetNatsQueueAge"} <= set(alerts)
    assert all(rule["expr"].strip() and rule["labels"]["severity"] and rule["annotations"]["summary"]
               for rule in alerts.values())
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["panels"]
    assert all(panel["targets"] and all(t["expr"] for t in panel["targets"]) for panel in dash["panels"])
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def test_every_referenced_series_exists_on_a_live_daemon(daemon: DaemonProc) -> None:
    text = httpx.get(daemon.url + "/metrics", timeout=30).text
    known = families(text)
    referenced = {s for e in expressions() for s in _SERIES.findall(e)}
    assert referenced >= NATS_ONLY and len(referenced) > 10
    missing = sorted(s for s in referenced if family_of(s, known) is None)
    assert not missing, f"series in deploy/ that /metrics does not have: {missing}"


def test_nats_series_get_samples() -> None:
    m = Metrics(process_metrics=False)
    m.set_nats_lag("m", 7, 2)
    text = m.render()[0].decode()
    assert 'fleet_nats_pending_messages{model="m"} 7.0' in text
    assert 'fleet_nats_unacked_messages{model="m"} 2.0' in text
    assert 'fleet_nats_consumer_lag_messages{model="m"} 9.0' in text
