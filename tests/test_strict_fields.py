"""Requests are understood or refused (DESIGN.md; issue 22, deliverable 1), on
every route of one real daemon: all-MiniLM-L6-v2 and tiny random models of every
other task (a reranker, a classifier, a tagger and a SPLADE model built with
`save_pretrained`; a Llama from tests.gen_models), pulled with `fleetctl pull`.

* Native routes, OpenAI's and Cohere's refuse a misspelled field with 400,
  naming it and the closest known field; every field of each route's request
  Struct is misspelled in turn (the Structs are read here, so fields added
  later are covered too), in JSON and in MessagePack. OpenAI's routes word it
  as OpenAI does ("Unrecognized request argument supplied: X", `param` X).
* A wrong type names the field and the expected type in plain words.
* Ollama and TEI ignore unknown fields, as those servers do, and name them in
  `X-Fleet-Ignored-Fields`, as they name fields fleet accepts and does not apply.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest

from fleet.daemon.controllers import ollama_wire as ow
from fleet.daemon.controllers import tei
from fleet.daemon.controllers.admin import AdminOptions
from fleet.protocol import (
    ChatCompletionRequest, ClassifyRequest, CompletionRequest, EmbedRequest, EmbedRequestJson, ExtractRequest,
    GenerateRequest, OpenAIEmbeddingsRequest, RerankRequest,
)
from tests.conftest import DEFAULT_MODEL, DaemonProc, default_model_dir, start_daemon
from tests.gen_models import build_llama, pull

pytestmark = pytest.mark.slow

MSGPACK = "application/msgpack"
HEADER = "x-fleet-ignored-fields"
RERANK, CLASSIFY, NER, SPLADE, LLM, SPARE = (
    "tiny-rerank", "tiny-classify", "tiny-ner", "tiny-splade", "tiny-llama", "tiny-spare")
DOCS = ["Cats sleep most of the day.", "The market closed higher.", "Kittens play."]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    import torch
    from transformers import (
        AutoTokenizer, BertConfig, BertForMaskedLM, BertForSequenceClassification, BertForTokenClassification,
    )

    root = tmp_path_factory.mktemp("strict-models")
    home = root / "home"
    tok = AutoTokenizer.from_pretrained(default_model_dir())

    def bert(cls: type, name: str, **kw: Any) -> Path:
        torch.manual_seed(0)
        cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=128, **kw)
        folder = root / name
        cls(cfg).eval().save_pretrained(folder)
        tok.save_pretrained(folder)
        return folder

    labels = {"id2label": {0: "negative", 1: "positive"}, "label2id": {"negative": 0, "positive": 1}}
    tags = ["O", "B-PER", "I-PER"]
    pull(home, bert(BertForSequenceClassification, "reranker", num_labels=1), RERANK)
    pull(home, bert(BertForSequenceClassification, "classifier", num_labels=2, **labels), CLASSIFY)
    pull(home, bert(BertForSequenceClassification, "spare", num_labels=2, **labels), SPARE)
    pull(home, bert(BertForTokenClassification, "tagger", num_labels=3, id2label=dict(enumerate(tags)),
                    label2id={t: i for i, t in enumerate(tags)}), NER)
    pull(home, bert(BertForMaskedLM, "splade"), SPLADE, "--task", "embed", "--runtime", "splade")
    pull(home, build_llama(root / "llama"), LLM)
    # Two embedding models: TEI routes that name none get the configured default.
    d = start_daemon(home, extra_env={"FLEET_CPU_THREADS": "1", "FLEET_DEFAULT_MODELS": f"embed={DEFAULT_MODEL}",
                                      "FLEET_PRELOAD": ",".join([DEFAULT_MODEL, RERANK, CLASSIFY, NER, LLM])})
    yield d
    d.stop()


def send(d: DaemonProc, path: str, body: Any, *, msgpack: bool = False, method: str = "POST") -> httpx.Response:
    """As the operator sends it (with the admin key): fields are checked on every route, its admin ones too."""
    content = msgspec.msgpack.encode(body) if msgpack else json.dumps(body).encode()
    return httpx.request(method, d.url + path, content=content, timeout=120,
                         headers={"Content-Type": MSGPACK if msgpack else "application/json", **d.admin})


def answer(resp: httpx.Response) -> Any:
    if resp.headers.get("content-type", "").startswith(MSGPACK):
        return msgspec.msgpack.decode(resp.content)
    return resp.json()


def ok(resp: httpx.Response) -> Any:
    assert resp.status_code == 200, resp.content[:500]
    return answer(resp)


def refused(resp: httpx.Response) -> dict:
    assert resp.status_code == 400, resp.content[:500]
    err = answer(resp)["error"]
    assert err["code"] == "bad_request", err
    return err


def ignored(resp: httpx.Response) -> list[str]:
    """The fields the reply says were not applied."""
    assert resp.status_code == 200, resp.content[:500]
    value = resp.headers.get(HEADER)
    return value.split(",") if value else []


def misspelled(field: str) -> str:
    """A typo of `field`: its last letter left out."""
    return field[:-1]


def field_names(struct: type) -> list[str]:
    return [f.encode_name for f in msgspec.structs.fields(struct)]


def typos(struct: type) -> list[tuple[str, str]]:
    """(typo, field) for every field of `struct` whose typo is no other field's name."""
    names = field_names(struct)
    return [(misspelled(f), f) for f in names if len(f) > 2 and misspelled(f) not in names]


# ---- native routes, and Cohere's: refused, naming the closest field ------------------------------------

def image(msgpack: bool) -> Any:
    return b"\x89PNG" if msgpack else "iVBORw0KGgo="


#: route -> (request Struct of JSON bodies, of MessagePack bodies, a body the route answers 200).
NATIVE = {
    "/v1/embed": (EmbedRequestJson, EmbedRequest, {"model": DEFAULT_MODEL, "inputs": ["hello"]}),
    "/v1/rerank": (RerankRequest, RerankRequest, {"model": RERANK, "query": "cats", "documents": DOCS}),
    "/v2/rerank": (RerankRequest, RerankRequest, {"model": RERANK, "query": "cats", "documents": DOCS}),
    "/v1/classify": (ClassifyRequest, ClassifyRequest, {"model": CLASSIFY, "inputs": ["hello"]}),
    "/v1/extract": (ExtractRequest, ExtractRequest, {"model": NER, "inputs": ["Angela met Emmanuel"]}),
    "/v1/generate": (GenerateRequest, GenerateRequest,
                     {"model": LLM, "prompt": "hello", "max_tokens": 2, "temperature": 0}),
    f"/v1/models/{CLASSIFY}/load": (AdminOptions, AdminOptions, {}),
}
#: Admin routes whose body is refused before they act (a good body would pin or unload).
ADMIN = [("POST", f"/v1/models/{CLASSIFY}/pin"), ("DELETE", f"/v1/models/{CLASSIFY}/pin"),
         ("POST", f"/v1/models/{CLASSIFY}/unload")]


@pytest.mark.parametrize("msgpack", [False, True], ids=["json", "msgpack"])
@pytest.mark.parametrize("path", list(NATIVE))
def test_every_field_misspelled_is_refused_with_the_closest_one(served: DaemonProc, path: str, msgpack: bool):
    json_struct, msgpack_struct, body = NATIVE[path]
    ok(send(served, path, body, msgpack=msgpack))  # the body itself is understood
    cases = typos(msgpack_struct if msgpack else json_struct)
    assert cases, path
    for typo, field in cases:
        err = refused(send(served, path, {**body, typo: 1}, msgpack=msgpack))
        assert err["message"] == f"unknown field `{typo}`; did you mean `{field}`?", (path, typo)


@pytest.mark.parametrize("msgpack", [False, True], ids=["json", "msgpack"])
@pytest.mark.parametrize("method,path", ADMIN)
def test_admin_bodies_are_refused_before_anything_happens(served: DaemonProc, method: str, path: str,
                                                          msgpack: bool):
    err = refused(send(served, path, {"devcie": "cpu"}, msgpack=msgpack, method=method))
    assert err["message"] == "unknown field `devcie`; did you mean `device`?"
    # Nothing happened: the preloaded model is still resident and pinned.
    workers = ok(httpx.get(served.url + "/v1/ps", timeout=30))["workers"]
    assert any(w["models"].get(CLASSIFY, {}).get("pinned") for w in workers), workers
    if path.endswith("/unload") or method == "DELETE":  # they act on every copy: `device` is refused
        assert "device" in refused(send(served, path, {"device": "cpu"}, msgpack=msgpack, method=method))["message"]


# ---- query parameters: each route takes those it declares, and refuses the rest -------------------------

BLOB = b"a blob the query sweep would upload"
DIGEST = "sha256:" + hashlib.sha256(BLOB).hexdigest()
_TEMPLATE = re.compile(r"\{(\w+)(?::\w+)?\}")


def app_handlers() -> list[tuple[str, str, Any]]:
    """(method, Litestar path, handler) of every route handler of the app a daemon serves,
    HEAD and Litestar's own OPTIONS answers too: a route added later is swept as well."""
    from litestar.routes import HTTPRoute

    from fleet.daemon.app import create_app
    from fleet.daemon.core import Daemon
    from fleet.config import Settings

    app = create_app(Daemon(Settings(home="/nonexistent-fleet-home")))
    return sorted(((method, route.path, handler) for route in app.routes if isinstance(route, HTTPRoute)
                   for method, (handler, _) in route.route_handler_map.items()), key=lambda r: r[:2])


def declared() -> dict[tuple[str, str], frozenset[str]]:
    """(method, path) -> the query parameters the daemon's own table says the route takes."""
    from fleet.daemon.app import create_app
    from fleet.daemon.core import Daemon
    from fleet.daemon.query import declared_query
    from fleet.config import Settings

    app = create_app(Daemon(Settings(home="/nonexistent-fleet-home")))
    table = declared_query(app)
    return {(method, route.path): table[handler].names for route in app.routes
            for method, (handler, _) in getattr(route, "route_handler_map", {}).items()}


def box_state(d: DaemonProc) -> dict[str, Any]:
    """What a request could change: stored models, pins and residency, files, batches, blobs."""
    workers = ok(httpx.get(d.url + "/v1/ps", timeout=30))["workers"]
    return {
        "tags": sorted(m["name"] for m in ok(httpx.get(d.url + "/api/tags", timeout=30))["models"]),
        "resident": sorted((name, bool(m.get("pinned"))) for w in workers for name, m in w["models"].items()),
        "files": sorted(f["id"] for f in ok(httpx.get(d.url + "/v1/files", timeout=30))["data"]),
        "batches": sorted(b["id"] for b in ok(httpx.get(d.url + "/v1/batches?limit=100", timeout=30))["data"]),
        "blob": httpx.head(f"{d.url}/api/blobs/{DIGEST}", headers=d.admin, timeout=30).status_code,
    }


def query_error(resp: httpx.Response, method: str, path: str, name: str) -> None:
    """`resp` is the 400 refusing query parameter `name`, in the route's error shape."""
    assert resp.status_code == 400, (method, path, resp.text[:300])
    if method == "HEAD":
        return
    if path == "/v1/systemone":  # System One's shape: {"detail": {"error_type", "message"}}
        detail = resp.json()["detail"]
        assert detail["error_type"] == "bad_request" and f"`{name}`" in detail["message"], (method, path, detail)
        return
    err = resp.json()["error"]
    if path.startswith("/api/"):  # Ollama's shape: {"error": "..."}
        assert f"`{name}`" in err, (method, path, err)
    elif isinstance(err, str):  # TEI's and TGI's shape: {"error": "...", "error_type": code}
        assert resp.json()["error_type"] == "bad_request" and name in err, (method, path, err)
    else:
        assert err["code"] == "bad_request" and name in err["message"], (method, path, err)
        assert err.get("param", name) == name, (method, path, err)


def test_every_route_refuses_a_query_parameter_it_does_not_declare_and_changes_nothing(served: DaemonProc):
    """Every route handler of the app (walked, not listed), with a body that would act
    where the route acts (pin, load, unload, delete, copy, create, upload, batch): a query
    parameter it does not declare is a 400 naming it, before anything happens."""
    jsonl = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embed",
                        "body": {"model": DEFAULT_MODEL, "inputs": ["x"]}}).encode()
    file_id = ok(httpx.post(served.url + "/v1/files", files={"file": ("q.jsonl", jsonl)}, data={"purpose": "batch"},
                            timeout=30))["id"]
    values = {"name": SPARE, "model_id": DEFAULT_MODEL, "file_id": file_id, "batch_id": "batch_none",
              "digest": DIGEST, "alias": "query-alias", "promotion_id": "promotion_none"}
    # Which model a route would act on: one it would change (load or pin the spare; unpin or unload a pinned one).
    per_route = {("DELETE", "/v1/models/{name:str}/pin"): {"name": CLASSIFY},
                 ("POST", "/v1/models/{name:str}/unload"): {"name": CLASSIFY},
                 ("GET", "/docs/{name:str}"): {"name": "swagger-ui.css"}}
    acting = {
        ("DELETE", "/api/delete"): {"json": {"model": SPARE}},
        ("POST", "/api/copy"): {"json": {"source": SPARE, "destination": "query-copy"}},
        ("POST", "/api/create"): {"json": {"model": "query-created", "from": SPARE, "stream": False}},
        ("POST", "/api/blobs/{digest:str}"): {"content": BLOB},
        ("POST", "/v1/files"): {"files": {"file": ("q.jsonl", jsonl)}, "data": {"purpose": "batch"}},
        ("POST", "/v1/batches"): {"json": {"input_file_id": file_id, "endpoint": "/v1/embed",
                                           "completion_window": "24h"}},
    }
    before = box_state(served)
    assert (f"{SPARE}:latest" in before["tags"] and (CLASSIFY, True) in before["resident"]
            and SPARE not in dict(before["resident"]) and before["blob"] == 404), before
    swept = 0
    for method, template, _ in app_handlers():
        names = {**values, **per_route.get((method, template), {})}
        path = _TEMPLATE.sub(lambda m, names=names: names[m.group(1)], template)
        body = acting.get((method, template), {"json": {}} if method in ("POST", "DELETE") else {})
        # As the operator: the routes that change the daemon refuse anyone else first (daemon.operator).
        resp = httpx.request(method, served.url + path, params={"bogus_param": "1"}, headers=served.admin,
                             timeout=60, **body)
        query_error(resp, method, path, "bogus_param")
        swept += 1
    assert swept >= 60
    assert box_state(served) == before  # nothing happened
    ok(httpx.delete(f"{served.url}/v1/files/{file_id}", timeout=30))


def test_declared_query_parameters_are_applied_and_a_typo_names_them(served: DaemonProc):
    """The routes that declare query parameters (the daemon's own table, so a new one must
    be added here) still apply them; a typo of one names it; `model` from a per-model URL or
    `?model=` on a POST is applied, and refused where it cannot be."""
    takes = {route: names for route, names in declared().items() if names}
    assert takes == {("GET", "/v1/files"): {"after", "limit", "order", "purpose"},
                     ("GET", "/v1/batches"): {"after", "limit"}, ("GET", "/info"): {"model"}}, takes
    jsonl = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embed",
                        "body": {"model": DEFAULT_MODEL, "inputs": ["x"]}}).encode()
    ids = [ok(httpx.post(served.url + "/v1/files", files={"file": (f"q{i}.jsonl", jsonl)},
                         data={"purpose": "batch"}, timeout=30))["id"] for i in range(2)]
    newest = ok(httpx.get(served.url + "/v1/files?purpose=batch&limit=1&order=desc", timeout=30))["data"]
    assert [f["id"] for f in newest] == ids[1:]
    page = ok(httpx.get(f"{served.url}/v1/files?purpose=batch&order=asc&after={ids[0]}", timeout=30))["data"]
    assert [f["id"] for f in page] == ids[1:]
    assert ok(httpx.get(served.url + "/v1/batches?limit=1", timeout=30))["object"] == "list"
    assert ok(httpx.get(f"{served.url}/info?model={CLASSIFY}", timeout=30))["model_id"] == CLASSIFY
    for path, typo, known in [("/v1/files?limt=1", "limt", "limit"), ("/v1/batches?afer=x", "afer", "after")]:
        err = refused(httpx.get(served.url + path, timeout=30))
        assert err["message"] == f"Unrecognized request argument supplied: {typo} (did you mean {known}?)"
        assert err["param"] == typo and err["type"] == "invalid_request_error"
    resp = httpx.get(f"{served.url}/info?modle={CLASSIFY}", timeout=30)  # TEI's route: TEI's error shape
    assert resp.status_code == 400 and resp.json()["error_type"] == "bad_request"
    assert resp.json()["error"] == "unknown query parameter `modle`; did you mean `model`?"
    err = refused(httpx.get(served.url + "/healthz?verbose", timeout=30))
    assert err["message"] == "unknown query parameter `verbose`; GET /healthz takes no query parameters"
    # `model` in the URL: applied (two classifiers, no default), the hot route's path too.
    native = ok(send(served, "/v1/classify", {"model": CLASSIFY, "inputs": ["hello"]}))
    assert ok(send(served, f"/v1/classify?model={CLASSIFY}", {"inputs": ["hello"]})) == native
    resp = send(served, f"/models/{CLASSIFY}/v1/classify?model={SPARE}", {"inputs": ["hello"]})
    assert ok(resp) == native and ignored(resp) == ["model"]  # the URL's model, and the other one named
    embedded = ok(send(served, "/v1/embed", {"model": DEFAULT_MODEL, "inputs": ["hello"]}))
    assert ok(send(served, f"/v1/embed?model={DEFAULT_MODEL}", {"inputs": ["hello"]})) == embedded
    err = refused(send(served, f"/v1/embed?model={DEFAULT_MODEL}&bogus=1", {"inputs": ["hello"]}))
    assert err["message"] == "unknown query parameter `bogus`; POST /v1/embed takes no query parameters"
    assert ok(httpx.get(f"{served.url}/models/{CLASSIFY}/info", timeout=30))["model_id"] == CLASSIFY
    listed = ok(httpx.get(f"{served.url}/models/{CLASSIFY}/v1/models", timeout=30))["data"]
    assert [m["id"] for m in listed] == [CLASSIFY]
    # A per-model URL's GET keeps the rest of the query, a parameter with no value too.
    for query in ("verbose", "verbose=1"):
        err = refused(httpx.get(f"{served.url}/models/{CLASSIFY}/v1/models?{query}", timeout=30))
        assert err["message"].startswith("Unrecognized request argument supplied: verbose"), err
    # A body `?model=` cannot be set in (a multipart upload) keeps it: refused, nothing kept.
    files = ok(httpx.get(served.url + "/v1/files", timeout=30))["data"]
    resp = httpx.post(f"{served.url}/v1/files?model={SPLADE}", files={"file": ("q.jsonl", jsonl)},
                      data={"purpose": "batch"}, timeout=30)
    assert refused(resp)["param"] == "model"
    assert ok(httpx.get(served.url + "/v1/files", timeout=30))["data"] == files
    # A per-model URL on the Batches routes (their bodies name no model): refused as such, nothing made.
    batches = ok(httpx.get(served.url + "/v1/batches", timeout=30))["data"]
    err = refused(send(served, f"/models/{CLASSIFY}/v1/batches",
                       {"input_file_id": ids[0], "endpoint": "/v1/embed", "completion_window": "24h"}))
    assert err["param"] == "model" and "takes no model" in err["message"]
    assert ok(httpx.get(served.url + "/v1/batches", timeout=30))["data"] == batches
    for file_id in ids:
        ok(httpx.delete(f"{served.url}/v1/files/{file_id}", timeout=30))


@pytest.mark.parametrize("msgpack", [False, True], ids=["json", "msgpack"])
def test_the_issues_examples(served: DaemonProc, msgpack: bool):
    gen = {"model": LLM, "prompt": "hello", "temperature": 0}
    err = refused(send(served, "/v1/generate", {**gen, "max_token": 3}, msgpack=msgpack))
    assert err["message"] == "unknown field `max_token`; did you mean `max_tokens`?"
    assert ok(send(served, "/v1/generate", {**gen, "max_tokens": 3}, msgpack=msgpack))["usage"]["output_tokens"] <= 3
    err = refused(send(served, "/v1/generate", {"model": LLM, "prompt": "hello", "temprature": 0}, msgpack=msgpack))
    assert err["message"] == "unknown field `temprature`; did you mean `temperature`?"
    embed = {"model": DEFAULT_MODEL, "inputs": ["hello"]}
    err = refused(send(served, "/v1/embed", {**embed, "normalise": False}, msgpack=msgpack))
    assert err["message"] == "unknown field `normalise`; did you mean `normalize`?"
    err = refused(send(served, "/v1/embed", {"model": DEFAULT_MODEL, "inptus": ["hello"]}, msgpack=msgpack))
    assert err["message"] == "unknown field `inptus`; did you mean `inputs`?"
    # Several at once: each is named.
    err = refused(send(served, "/v1/generate", {**gen, "max_token": 3, "temprature": 0, "zzz": 1}, msgpack=msgpack))
    assert err["message"] == ("unknown fields: `max_token` (did you mean `max_tokens`?), `temprature` (did you "
                              "mean `temperature`?), `zzz`")


@pytest.mark.parametrize("msgpack", [False, True], ids=["json", "msgpack"])
@pytest.mark.parametrize("path,body,where,typo,field", [
    ("/v1/embed", {"model": DEFAULT_MODEL, "inputs": ["a", {"imgae": None}]}, "inputs[1]", "imgae", "image"),
    ("/v1/rerank", {"model": RERANK, "query": "q", "documents": [{"txt": "a"}]}, "documents[0]", "txt", "text"),
    ("/v1/generate", {"model": LLM, "messages": [{"role": "user", "contnet": "hi"}]}, "messages[0]", "contnet",
     "content"),
])
def test_a_misspelled_field_inside_an_object_is_named_with_where_it_is(served: DaemonProc, path: str, body: dict,
                                                                      where: str, typo: str, field: str,
                                                                      msgpack: bool):
    if path == "/v1/embed":
        body = {**body, "inputs": ["a", {"imgae": image(msgpack)}]}
    err = refused(send(served, path, body, msgpack=msgpack))
    assert err["message"] == f"unknown field `{typo}` in `{where}`; did you mean `{field}`?"


@pytest.mark.parametrize("msgpack", [False, True], ids=["json", "msgpack"])
@pytest.mark.parametrize("path,extra,message", [
    ("/v1/embed", {"inputs": "hello"}, "`inputs` must be a list, got a string"),
    ("/v1/embed", {"inputs": ["a", 7]}, "`inputs[1]` must be a string or an object, got an integer"),
    ("/v1/embed", {"output": "dens"}, '`output` must be one of "dense", "sparse", "tokens", got \'dens\''),
    ("/v1/rerank", {"top_n": "2"}, "`top_n` must be an integer or null, got a string"),
    ("/v2/rerank", {"documents": "a"}, "`documents` must be a list or null, got a string"),
    ("/v1/classify", {"multi_label": "yes"}, "`multi_label` must be a boolean or null, got a string"),
    ("/v1/extract", {"labels": "PER"}, "`labels` must be a list or null, got a string"),
    ("/v1/generate", {"max_tokens": "3"}, "`max_tokens` must be an integer or null, got a string"),
    ("/v1/generate", {"prompt": None, "messages": [{"content": "hi"}]}, "`messages[0].role` is required"),
    (f"/v1/models/{CLASSIFY}/load", {"device": 0}, "`device` must be a string or null, got an integer"),
])
def test_a_wrong_type_names_the_field_and_the_type_in_plain_words(served: DaemonProc, path: str, extra: dict,
                                                                  message: str, msgpack: bool):
    err = refused(send(served, path, {**NATIVE[path][2], **extra}, msgpack=msgpack))
    assert err["message"] == message


def test_cohere_fields_fleet_does_not_apply_are_named(served: DaemonProc):
    body = NATIVE["/v2/rerank"][2]
    assert ignored(send(served, "/v2/rerank", {**body, "max_tokens_per_doc": 512, "priority": 1})) == [
        "max_tokens_per_doc", "priority"]
    assert ignored(send(served, "/v1/rerank", {**body, "max_chunks_per_doc": 10})) == ["max_chunks_per_doc"]
    assert ignored(send(served, "/v1/rerank", body)) == []


# ---- OpenAI: refused in OpenAI's words; what its SDKs send keeps working -------------------------------

OPENAI = {
    "/v1/embeddings": (OpenAIEmbeddingsRequest, {"model": DEFAULT_MODEL, "input": "hello"}),
    "/v1/completions": (CompletionRequest, {"model": LLM, "prompt": "hello", "max_tokens": 2}),
    "/v1/chat/completions": (ChatCompletionRequest, {"model": LLM, "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2}),
}


@pytest.mark.parametrize("msgpack", [False, True], ids=["json", "msgpack"])
@pytest.mark.parametrize("path", list(OPENAI))
def test_openai_routes_refuse_a_misspelled_field_as_openai_does(served: DaemonProc, path: str, msgpack: bool):
    struct, body = OPENAI[path]
    ok(send(served, path, body, msgpack=msgpack))
    for typo, field in typos(struct):
        err = refused(send(served, path, {**body, typo: 1}, msgpack=msgpack))
        assert err["message"] == f"Unrecognized request argument supplied: {typo} (did you mean {field}?)", typo
        assert err["param"] == typo and err["type"] == "invalid_request_error"


def test_the_openai_sdk_defaults_work_and_extra_body_typos_are_refused(served: DaemonProc):
    import openai

    with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0) as client:
        # The SDK asks for base64 vectors unless told otherwise; `user` is accepted and named.
        raw = client.embeddings.with_raw_response.create(model=DEFAULT_MODEL, input=["a", "b"], user="u-1")
        assert len(raw.parse().data) == 2 and raw.headers[HEADER] == "user"
        assert HEADER not in client.embeddings.with_raw_response.create(model=DEFAULT_MODEL, input="a").headers
        messages = [{"role": "system", "content": "be brief", "name": "rules"}, {"role": "user", "content": "hi"}]
        chunks = client.chat.completions.with_raw_response.create(
            model=LLM, messages=messages, max_tokens=3, temperature=0, stream=True,
            stream_options={"include_usage": True}, user="u-1", metadata={"run": "7"})
        assert chunks.headers[HEADER] == "user,metadata,messages[0].name"
        assert [c for c in chunks.parse()][-1].usage.completion_tokens <= 3
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=LLM, messages=messages, extra_body={"max_token": 3})
        assert bad.value.body["param"] == "max_token"
        assert bad.value.body["message"] == "Unrecognized request argument supplied: max_token (did you mean max_tokens?)"
        with pytest.raises(openai.BadRequestError) as unsupported:
            client.chat.completions.create(model=LLM, messages=messages, reasoning_effort="low")
        assert unsupported.value.body["code"] == "unsupported" and unsupported.value.body["param"] == "reasoning_effort"


@pytest.mark.parametrize("extra,param", [
    ({"store": True}, "store"),
    ({"verbosity": "low"}, "verbosity"),
    ({"messages": [{"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages[0].function_call"),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0]"),
])
def test_openai_fields_that_ask_for_what_fleet_does_not_do_are_refused(served: DaemonProc, extra: dict, param: str):
    resp = send(served, "/v1/chat/completions", {**OPENAI["/v1/chat/completions"][1], **extra})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "unsupported", resp.text
    assert resp.json()["error"]["param"] == param


# ---- Ollama and TEI: unknown fields ignored as there, and named ----------------------------------------

#: route -> (request Struct, a body the route answers 200, where the route names fields fleet does not apply).
LENIENT = {
    "/api/generate": (ow.GenerateBody, {"model": LLM, "prompt": "hello", "stream": False,
                                        "options": {"num_predict": 2, "temperature": 0}}),
    "/api/chat": (ow.ChatBody, {"model": LLM, "messages": [{"role": "user", "content": "hi"}], "stream": False,
                                "options": {"num_predict": 2, "temperature": 0}}),
    "/api/embed": (ow.EmbedBody, {"model": DEFAULT_MODEL, "input": ["hello"]}),
    "/api/embeddings": (ow.EmbeddingsBody, {"model": DEFAULT_MODEL, "prompt": "hello"}),
    "/api/show": (ow.NameBody, {"model": DEFAULT_MODEL}),
    "/api/pull": (ow.NameBody, {"model": CLASSIFY, "stream": False}),
    "/embed": (tei.TeiEmbedRequest, {"inputs": "hello"}),
    "/embed_sparse": (tei.TeiEmbedRequest, {"inputs": "hello", "model": SPLADE}),
    "/embed_all": (tei.TeiEmbedRequest, {"inputs": "hello"}),
    "/rerank": (tei.TeiRerankRequest, {"model": RERANK, "query": "cats", "texts": DOCS}),
    "/predict": (tei.TeiPredictRequest, {"model": CLASSIFY, "inputs": "hello"}),
    "/tokenize": (tei.TeiTokenizeRequest, {"inputs": "hello"}),
}


@pytest.mark.parametrize("msgpack", [False, True], ids=["json", "msgpack"])
@pytest.mark.parametrize("path", list(LENIENT))
def test_ollama_and_tei_ignore_a_misspelled_field_as_they_do_and_name_it(served: DaemonProc, path: str,
                                                                         msgpack: bool):
    struct, body = LENIENT[path]
    assert ignored(send(served, path, body, msgpack=msgpack)) == []
    cases = typos(struct)
    assert cases, path
    for typo, _ in cases:
        assert ignored(send(served, path, {**body, typo: 1}, msgpack=msgpack)) == [typo], (path, typo)


def test_ollama_names_nested_unknowns_and_fields_it_does_not_apply(served: DaemonProc):
    chat = LENIENT["/api/chat"][1]
    messages = [{"role": "user", "content": "hi", "imagse": []},
                {"role": "assistant", "content": "hello", "thinking": "greet back"}, {"role": "user", "content": "?"}]
    resp = send(served, "/api/chat", {**chat, "messages": messages, "formatt": "json",
                                      "options": {"num_predict": 2, "temperature": 0, "top_k": 3}})
    assert ignored(resp) == ["messages[0].imagse", "formatt", "messages[1].thinking"]
    assert resp.headers["x-fleet-ignored-options"] == "top_k"
    assert ignored(send(served, "/api/show", {"model": DEFAULT_MODEL, "verbose": True})) == ["verbose"]
    assert ignored(send(served, "/api/pull", {"model": CLASSIFY, "stream": False, "insecure": True})) == ["insecure"]


def test_ollama_delete_names_what_it_ignored(served: DaemonProc):
    resp = send(served, "/api/delete", {"model": SPARE, "nmae": SPARE}, method="DELETE")
    assert ignored(resp) == ["nmae"]
    assert httpx.post(served.url + "/api/show", json={"model": SPARE}, timeout=30).status_code == 404


def test_tei_ignores_a_misspelled_parameter_and_names_what_it_does_not_apply(served: DaemonProc):
    resp = send(served, "/embed", {"inputs": "hello", "parameters": {"normalise": False}})
    assert ignored(resp) == ["parameters.normalise"]
    assert abs(float(np.linalg.norm(resp.json()[0])) - 1.0) < 1e-4  # normalised, as TEI would answer
    assert ignored(send(served, "/embed_all", {"inputs": "hello", "normalize": True})) == ["normalize"]
    assert ignored(send(served, "/embed_sparse", {"inputs": "hello", "model": SPLADE,
                                                  "parameters": {"normalize": False}})) == ["parameters.normalize"]
    resp = send(served, "/rerank", {"model": RERANK, "query": "cats", "texts": DOCS, "truncation_direction": "left"})
    assert resp.status_code == 400 and resp.json()["error_type"] == "unsupported"  # TEI's error shape


def test_a_type_error_still_refuses_on_lenient_routes(served: DaemonProc):
    resp = send(served, "/embed", {"inputs": "hello", "normalise": False, "truncate": "yes"})
    assert resp.status_code == 400
    assert resp.json()["error"] == "`truncate` must be a boolean or null, got a string"  # TEI's error shape
    resp = send(served, "/api/embed", {"model": DEFAULT_MODEL, "input": 5, "foo": 1})
    assert resp.status_code == 400 and "`input` must be a string or a list" in resp.json()["error"]


def test_field_names_in_the_header_are_printable_and_bounded(served: DaemonProc):
    body = {"inputs": "hello", "nörmalize\n": 1, **{f"x{i}": i for i in range(20)}}
    names = ignored(send(served, "/embed", body))
    assert names[0] == "n\\xf6rmalize\\n" and len(names) == 17 and names[-1] == "+5 more"
