"""bench.host_path end to end (`python -m fleet.bench host-path`, in this process): it
starts its own daemon (the tiny embedder built from a config, pulled into a temporary
FLEET_HOME), loads it, reads the daemon's processes and threads through /proc, and
writes its JSON. Small settings: 4 clients for 2 s."""

from __future__ import annotations

import json
from pathlib import Path

from fleet.bench import cli


def test_the_bench_measures_the_daemons_host_path_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "host-path.json"
    rc = cli.run(["host-path", "--clients", "4", "--duration", "2", "--timeline", "1", "--out", str(out)])
    doc = json.loads(out.read_text())
    load, cpu, tok, tl = doc["load"], doc["cpu"], doc["tokenizer"], doc["timeline"]

    # Every request answered 200, tokens counted and the server agrees on them.
    assert rc == 0
    assert load["errors"] == 0 and load["ok"] == load["sent"] > 0
    assert load["tokens"] > 0 and load["server_tokens"] == load["tokens"]
    assert load["tokens_per_s"] > 0

    # The API process and at least one worker were read, each with its threads.
    procs = {p["role"]: p for p in cpu["processes"]}
    workers = [p for role, p in procs.items() if role.startswith("worker")]
    assert "api" in procs and workers
    for p in (procs["api"], *workers):
        assert p["threads"] and any(t["main"] for t in p["threads"])
    # The worker ran the model: it burned CPU in the window, more than nothing per token.
    assert sum(w["cpu_s"] for w in workers) > 0 and cpu["daemon_us_per_token"] > 0
    busiest = cpu["busiest_thread"]
    assert busiest["cpu_s"] > 0 and busiest["name"].startswith(busiest["role"]) and f"tid {busiest['tid']}" in busiest["name"]
    assert busiest["us_per_token"] <= cpu["daemon_us_per_token"]

    # The tokenizer's own cost, and the ratio printed against it.
    assert tok["encode_batch"]["us_per_token"] > 0 and tok["tokens"] > 0
    own = tok.get("encode_batch_fast", tok["encode_batch"])["us_per_token"]
    assert abs(doc["ratio"] - cpu["daemon_us_per_token"] / own) < 1e-9
    assert set(doc["goals"]) == {"ratio", "busiest_thread_us_per_token"}

    # Every stage of the timeline has stamps from the requests that asked for them.
    assert tl["errors"] == 0 and tl["requests"] > 0 and tl["batches"] > 0
    assert {s["to"] for s in tl["stages"]} >= {"claimed", "lingered", "decoded", "tokenized", "forward", "host",
                                               "ran", "collected", "encoded"}
    for stage in tl["stages"]:
        assert stage["n"] > 0 and stage["p50_ms"] >= 0 and stage["p50_us_per_token"] >= 0, stage
    [claim] = [s for s in tl["stages"] if s["to"] == "claimed" and s["per"] == "request"]
    assert 0 <= claim["joined_while_lingering"] <= claim["n"]
    assert doc["machine"]["cpus_logical"] >= 1 and doc["kind"] == "host-path"


def test_a_stand_in_forward_serves_through_the_product_path(tmp_path: Path) -> None:
    # `--forward`: the daemon is `fleetctl serve` with its workers' forward replaced by a
    # GIL-free wait (bench.stand_in), an accelerator's cost to the host thread. Every
    # request is still answered through the real API, queue and worker; /v1/ps names
    # the stand-in.
    out = tmp_path / "host-path.json"
    rc = cli.run(["host-path", "--clients", "4", "--duration", "2", "--timeline", "0.5", "--forward", "100,0.5",
                         "--out", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 0 and doc["forward"] == "100,0.5"
    assert doc["load"]["errors"] == 0 and doc["load"]["ok"] == doc["load"]["sent"] > 0
    [served] = doc["served"].values()
    assert served["forward"] == {"traced": False, "stand_in": {"fixed_us": 100.0, "per_token_us": 0.5}}
