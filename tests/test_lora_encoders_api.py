"""LoRA adapters on encoders end to end: tiny bases and peft LoRAs
(tests.lora_models) pulled with `fleetctl pull --base`, served by a real
daemon over real HTTP, each answer compared with the merged adapter model run
through its reference library in-process.

Requests for the base and for two adapters of each base are sent at once:
they queue in the base's lane and run on one copy of it, each row with its
own adapter (`adapter` field, or the adapter's own name as `model`, natively
and through the OpenAI and TEI routes). An `adapter` the model does not have
is a 400 naming it and the model's adapters; `/v1/ps` lists the attached
adapters on their base and counts their bytes.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

from tests.conftest import DaemonProc, start_daemon
from tests.lora_models import CLASSIFY_LABELS, TOPIC_LABELS, References, build_bases, build_loras

pytestmark = pytest.mark.slow

TEXTS = ["I love this product.", "Terrible service, never again.", "The package arrived on Tuesday.", "ok",
         "Angela Merkel met Emmanuel Macron in Berlin."]
QUERY = "how do cats behave at home"
DOCS = ["Cats sleep for most of the day.", "The stock market closed higher.", "a",
        "Domestic cats groom themselves and mark territory."]
#: Store name -> (base folder key, task, runtime); every base runs in float32.
BASES = {
    "tiny-emb": ("embedder", "embed", "sentence-transformers"),
    "tiny-rr": ("reranker", "rerank", "transformers"),
    "tiny-ce": ("cross-encoder", "rerank", "sentence-transformers"),
    "tiny-cls": ("classifier", "classify", "transformers"),
    "tiny-ner": ("tagger", "extract", "transformers"),
    "tiny-plain": ("bert", "embed", "sentence-transformers"),  # an embedder with no adapters
}
#: Adapter store name -> its base.
ADAPTERS = {"emb-a": "tiny-emb", "emb-b": "tiny-emb", "rr-head": "tiny-rr", "rr-body": "tiny-rr",
            "ce-head": "tiny-ce", "ce-body": "tiny-ce", "cls-head": "tiny-cls", "cls-topics": "tiny-cls",
            "ner-own": "tiny-ner", "ner-body": "tiny-ner"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora-enc-models")
    bases = build_bases(root)
    return bases, build_loras(root / "loras", bases)


@pytest.fixture(scope="module")
def ref(models) -> References:
    return References(*models)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, models):
    bases, loras = models
    home = tmp_path_factory.mktemp("lora-enc-home")
    lines = []
    # engine torch: what an adapter adds to the base's bytes is asserted below; where
    # OpenVINO is installed and measured faster, the first adapter would also drop its
    # graph (engines.back_to_torch, tests/test_engines.py) and the base's bytes with it.
    for name, (key, task, runtime) in BASES.items():
        lines += [f'[models."{name}"]', f'source = "path:{bases[key].resolve()}"', f'task = "{task}"',
                  f'runtime = "{runtime}"', f'[models."{name}".profile]', 'dtype = "float32"', 'engine = "torch"',
                  ""]
    (home / "models.toml").write_text("\n".join(lines))
    env = {**os.environ, "FLEET_HOME": str(home), "HF_HUB_OFFLINE": "1"}

    def fleetctl(*args: str) -> None:
        done = subprocess.run([sys.executable, "-m", "fleetctl", *args], env=env, capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr

    for name in BASES:
        fleetctl("pull", name)
    for name, base in ADAPTERS.items():
        fleetctl("pull", f"path:{loras[name]}", "--name", name, "--base", base)
    d = start_daemon(home, extra_env={"FLEET_PRELOAD": "", "FLEET_CPU_THREADS": "1"}, args=["--workers", "1"])
    yield d
    d.stop()


def post(d: DaemonProc, path: str, body: dict, *, msgpack: bool = False) -> httpx.Response:
    if msgpack:
        return httpx.post(d.url + path, content=msgspec.msgpack.encode(body),
                          headers={"Content-Type": "application/msgpack"}, timeout=120)
    return httpx.post(d.url + path, json=body, timeout=120)


def ok(resp: httpx.Response) -> dict:
    assert resp.status_code == 200, resp.text[:500]
    if resp.headers["content-type"].startswith("application/msgpack"):
        return msgspec.msgpack.decode(resp.content)
    return resp.json()


def lora(body: dict) -> str | None:
    return body.get("adapter") or (body["model"] if body["model"] in ADAPTERS else None)


def check(path: str, body: dict, reply: dict, ref: References) -> float:
    """The largest difference of one reply to its reference (asserting the parts that must be equal)."""
    if path == "/v1/embed":
        got = np.frombuffer(reply["embeddings"], "<f4").reshape(reply["shape"]) if isinstance(
            reply["embeddings"], bytes) else np.array(reply["embeddings"])
        return float(np.abs(got - ref.embed(lora(body), body["inputs"])).max())
    if path == "/v1/rerank":
        scores = {r["index"]: r["score"] for r in reply["results"]}
        got = np.array([scores[i] for i in range(len(body["documents"]))])
        pairs = [(body["query"], d) for d in body["documents"]]
        if body["model"] == "tiny-ce" or ADAPTERS.get(body["model"]) == "tiny-ce":
            want = ref.cross_encoder(lora(body), pairs)
        else:
            want = 1 / (1 + np.exp(-ref.rerank_logits(lora(body), pairs)))
        return float(np.abs(got - want).max())
    if path == "/v1/classify":
        labels, want = ref.classify(lora(body), body["inputs"])
        worst = 0.0
        for row, p in zip(reply["results"], want):
            assert sorted(x["label"] for x in row) == sorted(labels)
            got = {x["label"]: x["score"] for x in row}
            worst = max(worst, float(np.abs(np.array([got[lab] for lab in labels]) - p).max()))
        return worst
    want = ref.extract(lora(body), body["inputs"])
    got = [[(e["entity"], e["start"], e["end"], e["score"]) for e in row] for row in reply["results"]]
    assert [[x[:3] for x in row] for row in got] == [[x[:3] for x in row] for row in want]
    return max([abs(a[3] - b[3]) for g, w in zip(got, want) for a, b in zip(g, w)], default=0.0)


def jobs() -> list[tuple[str, dict]]:
    """For each base: the base, each adapter by `adapter`, each adapter as `model`."""
    out = []
    for path, base, key, extra in (("/v1/embed", "tiny-emb", "inputs", {}), ("/v1/classify", "tiny-cls", "inputs", {}),
                                   ("/v1/extract", "tiny-ner", "inputs", {}),
                                   ("/v1/rerank", "tiny-rr", "documents", {"query": QUERY}),
                                   ("/v1/rerank", "tiny-ce", "documents", {"query": QUERY})):
        values = TEXTS if key == "inputs" else DOCS
        names = [n for n, b in ADAPTERS.items() if b == base]
        out.append((path, {"model": base, key: values, **extra}))
        out += [(path, {"model": base, "adapter": n, key: values[::-1], **extra}) for n in names]
        out += [(path, {"model": n, key: values[1:], **extra}) for n in names]
    return out


def held_bytes(d: DaemonProc) -> dict[str, int]:
    ps = httpx.get(d.url + "/v1/ps", timeout=10).json()
    return {name: m["bytes"] for w in ps["workers"] for name, m in w["models"].items()}


def adapter_bytes(folder: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
        return sum(t.numel() * t.element_size() for t in map(f.get_tensor, f.keys()))


def test_mixed_requests_equal_each_merged_adapter(fleet: DaemonProc, ref: References, models) -> None:
    # Each base alone first, to measure what its adapters add.
    for path, body in jobs():
        if lora(body) is None:
            ok(post(fleet, path, body))
    alone = held_bytes(fleet)
    todo = jobs()
    with cf.ThreadPoolExecutor(len(todo)) as pool:
        replies = list(pool.map(lambda j: post(fleet, j[0], j[1], msgpack=j[0] == "/v1/embed"), todo))
    worst: dict[str, float] = {}
    for (path, body), resp in zip(todo, replies):
        task = path + (f" {body['model']}" if path == "/v1/rerank" else "")
        worst[task] = max(worst.get(task, 0.0), check(path, body, ok(resp), ref))
        assert ok(resp)["model"] == body["model"]
    assert worst["/v1/embed"] < 1e-5 and worst["/v1/classify"] < 5e-6 and worst["/v1/extract"] < 5e-6, worst
    assert max(v for k, v in worst.items() if k.startswith("/v1/rerank")) < 5e-6, worst
    # One copy of each base, its adapters attached to it, each adding its own weights
    # (LoRA and head) and nothing more.
    ps = httpx.get(fleet.url + "/v1/ps", timeout=10).json()
    resident = {name: m for w in ps["workers"] for name, m in w["models"].items()}
    assert not set(ADAPTERS) & set(resident)
    now = held_bytes(fleet)
    for base in set(ADAPTERS.values()):
        own = sorted(n for n, b in ADAPTERS.items() if b == base)
        assert sorted(resident[base]["loras"]) == own
        assert now[base] - alone[base] == sum(adapter_bytes(models[1][n]) for n in own), base
    cards = {m["id"]: m for m in httpx.get(fleet.url + "/v1/models", timeout=10).json()["data"]}
    assert all(cards[n]["loaded"] for n in ADAPTERS)


def test_the_issue_scenario_classify_with_the_adapter_is_its_answer(fleet: DaemonProc, ref: References) -> None:
    body = {"model": "tiny-cls", "adapter": "cls-topics", "inputs": TEXTS}
    reply = ok(post(fleet, "/v1/classify", body))
    assert {x["label"] for x in reply["results"][0]} == set(TOPIC_LABELS)
    assert check("/v1/classify", body, reply, ref) < 5e-6
    base = ok(post(fleet, "/v1/classify", {"model": "tiny-cls", "inputs": TEXTS}))
    assert {x["label"] for x in base["results"][0]} == set(CLASSIFY_LABELS)


def test_openai_embeddings_with_the_adapter_as_the_model(fleet: DaemonProc, ref: References) -> None:
    import openai

    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="unused")
    out = client.embeddings.create(model="emb-a", input=TEXTS)
    got = np.array([d.embedding for d in out.data])
    assert out.model == "emb-a"
    assert np.abs(got - ref.embed("emb-a", TEXTS)).max() < 1e-5
    assert np.abs(got - ref.embed(None, TEXTS)).max() > 0.05
    # Token ids are read with the base's tokenizer (the adapter ships none).
    ids = ref.tok(TEXTS[0])["input_ids"]
    by_ids = ok(post(fleet, "/v1/embeddings", {"model": "emb-b", "input": ids}))
    assert np.abs(np.array(by_ids["data"][0]["embedding"]) - ref.embed("emb-b", TEXTS[:1])[0]).max() < 1e-5


def test_tei_routes_take_the_adapter_as_the_model(fleet: DaemonProc, ref: References) -> None:
    ranked = ok(post(fleet, "/rerank", {"model": "rr-head", "query": QUERY, "texts": DOCS}))
    scores = np.array([r["score"] for r in sorted(ranked, key=lambda r: r["index"])])
    want = 1 / (1 + np.exp(-ref.rerank_logits("rr-head", [(QUERY, d) for d in DOCS])))
    assert np.abs(scores - want).max() < 5e-6
    predicted = ok(post(fleet, "/predict", {"model": "cls-topics", "inputs": TEXTS[0]}))
    labels, probs = ref.classify("cls-topics", TEXTS[:1])
    assert {p["label"]: p["score"] for p in predicted} == pytest.approx(dict(zip(labels, probs[0].tolist())),
                                                                         abs=5e-6)


@pytest.mark.parametrize("path, body, listed", [
    ("/v1/classify", {"model": "tiny-cls", "adapter": "enc-lora", "inputs": ["x"]}, "cls-head, cls-topics"),
    ("/v1/embed", {"model": "tiny-emb", "adapter": "cls-head", "inputs": ["x"]}, "emb-a, emb-b"),
    ("/v1/rerank", {"model": "tiny-ce", "adapter": "rr-head", "query": "q", "documents": ["d"]}, "ce-body, ce-head"),
    ("/v1/embed", {"model": "tiny-plain", "adapter": "emb-a", "inputs": ["x"]}, "none"),
    ("/v1/extract", {"model": "tiny-ner", "adapter": "tiny-cls", "inputs": ["x"]}, "ner-body, ner-own"),
])
def test_an_adapter_the_model_does_not_have_is_a_400_naming_it(fleet: DaemonProc, path: str, body: dict,
                                                              listed: str) -> None:
    resp = post(fleet, path, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "bad_request"
    assert f"{body['model']!r} has no LoRA adapter {body['adapter']!r}; its adapters: {listed}" in error["message"]


def test_an_adapter_named_on_an_adapter_is_refused(fleet: DaemonProc) -> None:
    resp = post(fleet, "/v1/embed", {"model": "emb-a", "adapter": "emb-b", "inputs": ["x"]})
    assert resp.status_code == 400 and "'emb-a' is itself a LoRA adapter (of 'tiny-emb')" in resp.json()["error"][
        "message"]
