"""Results documents, tables and plots from step records (no servers needed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from fleet.bench import corpus, report
from fleet.bench.knee import CLOSED, OPEN
from fleet.bench.loadgen import Merged
from fleet.bench.runner import Plan, StepRecord, TargetRun, TargetSpec, compare_ratios, to_step_result


def record(offered: float, ok: int, lat_ms: float, mode: str = OPEN, errors: int = 0) -> StepRecord:
    lat = np.full(ok, lat_ms, dtype=np.float32)
    m = Merged(sent=ok + errors, ok=ok, errors=errors, error_codes={-1: errors} if errors else {},
               error_sample="no reply" if errors else "", latencies_ms=lat,
               server_queue_ms=np.full(ok, 2.0, dtype=np.float32), server_inference_ms=np.full(ok, 8.0, dtype=np.float32),
               tokens_ok=ok * 100,
               server_tokens=ok * 100, elapsed_s=10.0, lag_p99_ms=1.0, cpu_s=0.1, started_unix=0.0)
    return StepRecord(result=to_step_result(m, offered, mode), lag_p99_ms=1.0, gen_cpu_pct=1.0,
                      generator_bound=False, tokens=ok * 100, server_tokens=ok * 100, error_codes=m.error_codes,
                      error_sample=m.error_sample, server_queue_p50_ms=2.0 if ok else None,
                      server_inference_p50_ms=8.0 if ok else None, started_unix=0.0, ended_unix=10.0,
                      box={"cpu_pct": {"a:server": 150.0}, "rss_bytes": {"a:server": 1 << 29}})


def runs() -> list[TargetRun]:
    a = TargetRun(TargetSpec("a", "fleet", "http://127.0.0.1:1"), None, OPEN, None, None)
    a.steps = [record(1, 10, 100), record(2, 20, 110), record(4, 25, 900), record(8, 0, 0, errors=80)]
    st = TargetRun(TargetSpec("st-fp32", "st", dtype="fp32"), None, CLOSED, None, None)
    st.steps = [record(1, 5, 200, CLOSED), record(1, 7, 150, CLOSED), record(1, 6, 170, CLOSED)]
    return [a, st]


def test_result_doc_round_trips_through_json_with_a_step_without_replies(tmp_path):
    rs, plan = runs(), Plan(model="m")
    lengths = [20] * len(corpus.load())
    doc = report.result_doc(rs, plan, report.corpus_doc(corpus.CORPUS_PATH, lengths), argv=["fleetctl", "bench"])
    path = report.write_json(doc, tmp_path / "r.json")
    back = json.loads(path.read_text())
    a, st = back["targets"]
    assert a["knee"]["offered"] == 2 and a["saturated"]
    assert a["steps"][-1]["p50_ms"] is None and a["steps"][-1]["error_codes"] == {"-1": 80}
    assert st["knee"]["throughput_rps"] == pytest.approx(0.6)  # the median of 0.5, 0.7, 0.6 req/s
    assert back["ratios_tokens_per_s"]["a"]["st-fp32"] == pytest.approx(200 / 60, rel=1e-3)
    assert back["command"] == ["fleetctl", "bench"] and back["corpus"]["tokens_per_text"]["p50"] == 20
    assert "load_avg_1_5_15" in back["machine"] and back["plan"]["criteria"]["p95_factor"] == 3.0
    assert report.default_out(back).parent == report.RESULTS_DIR


def test_a_bench_document_is_saved_where_asked_or_under_its_stamp(tmp_path, monkeypatch):
    doc = report.document("timeline", "fleet.bench.timeline", ["--requests", "5"]) | {"stages": []}
    assert json.loads(report.save(doc, tmp_path / "x.json", "timeline").read_text()) == doc
    monkeypatch.setattr(report, "RESULTS_DIR", tmp_path / "results")
    path = report.save(doc, None, "timeline")
    assert path.parent == tmp_path / "results" and path.name.endswith("Z-timeline.json")
    assert path.name.startswith(doc["created_utc"][:4]) and ":" not in path.name


def test_tables_show_knee_reasons_and_ratios():
    rs, plan = runs(), Plan(model="m")
    console = Console(width=200, record=True)
    report.print_summary(console, rs, plan)
    text = console.export_text()
    assert "knee ok" in text and "behind: 62% of offered" in text and "errors 100.0%" in text
    assert "2.0 / 8.0" in text  # the server's own queue / inference split
    ratio = compare_ratios(rs, plan.criteria)["a"]["st-fp32"]
    assert f"{ratio:.2f}x" in text


def test_skipped_targets_are_a_table_of_their_own_and_keys_of_the_json(tmp_path):
    """A target that could not run here is said, with why, in the table and the document."""
    rs, plan = runs(), Plan(model="m")
    skipped = {"tei": "text-embeddings-router (TEI) is not installed: run bench/setup_tei.sh",
               "ov-best": "openvino is not installed (pip install 'fleet-serve[openvino]')"}
    console = Console(width=400, record=True)
    report.print_summary(console, rs, plan, skipped)
    text = console.export_text()
    assert "skipped (not run here)" in text
    rows = [[c.strip() for c in line.strip("│ ").split("│")] for line in text.splitlines() if "is not installed" in line]
    assert rows == [[name, why] for name, why in skipped.items()]
    doc = report.result_doc(rs, plan, report.corpus_doc(corpus.CORPUS_PATH, [20] * len(corpus.load())), skipped=skipped)
    back = json.loads(report.write_json(doc, tmp_path / "r.json").read_text())
    assert back["skipped"] == skipped and [t["name"] for t in back["targets"]] == ["a", "st-fp32"]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs the bench extra: pip install -e '.[bench]'")
    rs, plan = runs(), Plan(model="m")
    doc = report.result_doc(rs, plan, report.corpus_doc(corpus.CORPUS_PATH, [20] * len(corpus.load())))
    png = report.plot(doc, tmp_path / "k.png")
    data = Path(png).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
