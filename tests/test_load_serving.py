"""Loads and unloads on a serving worker, end to end: a real `fleetctl serve` at its
defaults (one CPU worker), real HTTP on 127.0.0.1, the default embedder resident
and a BERT cross-encoder built from a config (random weights, MiniLM's tokenizer,
8 layers: ~57 MB) pulled into the store and loaded through the real path.

1. A load runs beside serving (runtimes.loading): while the reranker loads
   (seconds: weights, the dtype check, the trace and its probes), the resident
   embedder answers every probe, each in a fraction of the load's time. Before,
   the worker's one step loop ran the load: every embed request waited for all of it.
2. A reload serves what the first load measured (runtimes.kept): the trace is made
   once and kept beside the model, the dtype checked once; before, every load
   traced, probed, timed and checked again.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from bench.models import build_bert
from tests.conftest import DaemonProc, default_model_dir, start_daemon
from tests.gen_models import pull

pytestmark = pytest.mark.slow

RERANKER = "load-reranker"
#: Gap between two embed probes (each waits for its answer before the gap).
PROBE_GAP_S = 0.05
#: The load must take this long for the probes to say anything about it.
MIN_LOAD_S = 1.0


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer, BertForSequenceClassification

    root, home = tmp_path_factory.mktemp("load-models"), tmp_path_factory.mktemp("load-home")
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    folder = build_bert(root / RERANKER, BertForSequenceClassification, 0, tok.vocab_size, hidden_size=256,
                        num_hidden_layers=8, num_attention_heads=4, intermediate_size=1024, num_labels=1)
    tok.save_pretrained(folder)
    pull(home, folder, RERANKER, "--task", "rerank")
    d = start_daemon(home)
    try:
        assert httpx.post(d.url + "/v1/embed", json={"inputs": ["warm"]}, timeout=120).status_code == 200
        yield d
    finally:
        d.stop()


def rerank(d: DaemonProc) -> httpx.Response:
    return httpx.post(d.url + "/v1/rerank", json={"model": RERANKER, "query": "what is fleet?",
                                                  "documents": ["fleet serves small models", "a lazy dog"]},
                      timeout=300)


def test_a_load_runs_beside_the_models_already_serving(served):
    d = served
    probes: list[tuple[float, float, int]] = []  # (sent, seconds to the answer, status)
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=d.url, timeout=300) as c:
            while not stop.is_set():
                sent = time.monotonic()
                status = c.post("/v1/embed", json={"inputs": ["a probe of the resident embedder"]}).status_code
                probes.append((sent, time.monotonic() - sent, status))
                time.sleep(PROBE_GAP_S)

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        time.sleep(0.5)
        started = time.monotonic()
        answer = rerank(d)  # names a stored model not resident: a lazy load, then its batch
        load_s = time.monotonic() - started
    finally:
        stop.set()
        thread.join()
    assert answer.status_code == 200, answer.text
    assert load_s >= MIN_LOAD_S, f"the load took {load_s:.2f} s: too short to say anything"
    assert probes and all(status == 200 for _, _, status in probes), probes
    # Every probe in flight while the reranker loaded was answered in a fraction of the
    # load, and probes kept coming back during it (one waiting for the whole load, before).
    during = [took for sent, took, _ in probes if sent < started + load_s and sent + took > started]
    inside = [took for sent, took, _ in probes if sent >= started and sent + took <= started + load_s]
    assert max(during) < load_s / 3, (load_s, during)
    assert len(inside) >= 5, (load_s, during)


def test_a_reload_serves_what_the_first_load_measured(served):
    d = served
    for op in ("load", "unload", "load"):  # a first load (unless an earlier test made it), then a reload
        done = httpx.post(f"{d.url}/v1/models/{RERANKER}/{op}", headers=d.admin, timeout=300)
        assert done.status_code == 200, done.text
    assert rerank(d).status_code == 200
    log = (Path(d.home) / "daemon.log").read_text()
    assert log.count(f"loaded {RERANKER} on cpu") >= 2
    # Traced, probed and timed once: every later load served the kept graph or verdict.
    assert log.count("making traced-cross-encoder-logits-") == 1
    assert f"traced forward {RERANKER}: " in log and "(kept verdict)" in log
    assert len(list((Path(d.home) / "models" / RERANKER / ".fleet-derived").glob("traced-*/verdict.json"))) == 1
    # The dtype checked at most once (a CPU without a fast dtype checks none).
    assert log.count(f"dtype check {RERANKER} bfloat16:") <= 1
