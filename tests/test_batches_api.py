"""OpenAI's Files and Batches API, through the official `openai` SDK unchanged,
against a real `fleetctl serve` (real worker, real all-MiniLM-L6-v2, a tiny random
Llama in its hub layout): upload, create, retrieve, list (cursor pages), cancel,
file content and delete; answers equal to the same requests sent alone; bad lines
refused at upload by line number; a model or url that cannot run fails the batch
before any work; per-line errors in the error file while the rest runs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import DEFAULT_MODEL, DaemonProc, start_daemon
from tests.gen_models import build_llama, pull

pytestmark = pytest.mark.slow

LLAMA = "tiny-llama"
#: A small body limit and line count, so the limits are cheap to reach.
MAX_BODY = 64 << 10
MAX_LINES = 500
FINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("batches-home")
    pull(home, build_llama(tmp_path_factory.mktemp("batches-models") / LLAMA), LLAMA)
    return home


@pytest.fixture(scope="module")
def fleet(home: Path):
    d = start_daemon(home, extra_env={"FLEET_MAX_BODY_BYTES": str(MAX_BODY), "FLEET_BATCH_MAX_LINES": str(MAX_LINES)})
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(fleet: DaemonProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0)


def jsonl(path: Path, lines: list[dict | str]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def wait_final(client: openai.OpenAI, batch_id: str, timeout_s: float = 120.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        b = client.batches.retrieve(batch_id)
        if b.status in FINAL:
            return b
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} not final after {timeout_s} s: {b}")


def results(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def run_batch(client: openai.OpenAI, tmp_path: Path, endpoint: str, lines: list[dict], **kw):
    f = client.files.create(file=jsonl(tmp_path / "in.jsonl", lines).open("rb"), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h", **kw)
    assert b.status == "validating" and b.input_file_id == f.id and b.request_counts.total == len(lines)
    return wait_final(client, b.id)


def test_embeddings_batch_answers_as_the_route_does(client, tmp_path):
    texts = [f"a batch line about topic {i}" for i in range(40)]
    lines = [line(f"e{i}", "/v1/embeddings", {"model": DEFAULT_MODEL, "input": t, "encoding_format": "float"})
             for i, t in enumerate(texts)]
    lines.insert(7, line("bad", "/v1/embeddings", {"model": DEFAULT_MODEL, "inputs": "typo"}))
    b = run_batch(client, tmp_path, "/v1/embeddings", lines, metadata={"job": "nightly"})
    assert b.status == "completed" and b.errors is None and b.metadata == {"job": "nightly"}
    assert b.model == DEFAULT_MODEL
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (41, 40, 1)
    assert b.in_progress_at and b.finalizing_at and b.completed_at and b.expires_at - b.created_at == 86_400
    out, err = results(client, b.output_file_id), results(client, b.error_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(f"e{i}" for i in range(40))
    assert len({r["id"] for r in out + err}) == 41
    # The route's own answer: each vector equals the same request sent alone.
    alone = client.embeddings.create(model=DEFAULT_MODEL, input=texts[:5], encoding_format="float")
    by_id = {r["custom_id"]: r for r in out}
    for i in range(5):
        r = by_id[f"e{i}"]
        assert r["error"] is None and r["response"]["status_code"] == 200 and r["response"]["request_id"]
        got = np.array(r["response"]["body"]["data"][0]["embedding"])
        assert np.allclose(got, alone.data[i].embedding, atol=1e-3)
    assert b.usage.input_tokens == sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in out) > 0
    # A bad body: OpenAI's 400 for it, in the error file, naming the field; the rest ran.
    [bad] = err
    assert bad["custom_id"] == "bad" and bad["error"] is None and bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["param"] == "inputs"
    # The result files are files of the Files API.
    f = client.files.retrieve(b.output_file_id)
    assert f.purpose == "batch_output" and f.bytes == len(client.files.content(b.output_file_id).content)


def test_chat_batch_answers_each_line_as_sent_alone(client, tmp_path):
    prompts = [f"say something about {w}" for w in ("dogs", "cats", "invoices", "the sea", "paris")]
    lines = [line(f"c{i}", "/v1/chat/completions",
                  {"model": LLAMA, "messages": [{"role": "user", "content": p}], "max_tokens": 8, "temperature": 0,
                   "user": "someone"})
             for i, p in enumerate(prompts)]
    lines.append(line("streamed", "/v1/chat/completions",
                      {"model": LLAMA, "messages": [{"role": "user", "content": "x"}], "stream": True}))
    b = run_batch(client, tmp_path, "/v1/chat/completions", lines)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (5, 1)
    out = {r["custom_id"]: r for r in results(client, b.output_file_id)}
    for i, p in enumerate(prompts):
        alone = client.chat.completions.create(model=LLAMA, messages=[{"role": "user", "content": p}], max_tokens=8,
                                               temperature=0)
        body = out[f"c{i}"]["response"]["body"]
        assert body["choices"][0]["message"]["content"] == alone.choices[0].message.content
        assert body["object"] == "chat.completion"
        # Accepted and not applied: said in the line, as the route's header says it.
        assert out[f"c{i}"]["response"]["headers"] == {"x-fleet-ignored-fields": "user"}
    assert b.usage.output_tokens == sum(r["response"]["body"]["usage"]["completion_tokens"] for r in out.values())
    [streamed] = results(client, b.error_file_id)
    assert streamed["response"]["status_code"] == 400 and streamed["response"]["body"]["error"]["param"] == "stream"


def test_native_endpoint_batch_with_a_bad_line(client, tmp_path):
    lines = [line(f"n{i}", "/v1/embed", {"model": DEFAULT_MODEL, "inputs": [f"text {i}", "two"]}) for i in range(6)]
    lines.append(line("unknown-field", "/v1/embed", {"model": DEFAULT_MODEL, "inputs": ["x"], "normalise": True}))
    b = run_batch(client, tmp_path, "/v1/embed", lines)
    assert (b.request_counts.completed, b.request_counts.failed) == (6, 1)
    out = results(client, b.output_file_id)
    assert all(r["response"]["body"]["shape"] == [2, 384] for r in out)
    [bad] = results(client, b.error_file_id)
    body = bad["response"]["body"]["error"]
    assert bad["response"]["status_code"] == 400 and "normalise" in body["message"] and "normalize" in body["message"]


@pytest.mark.parametrize(
    "lines, words",
    [
        pytest.param([line("a", "/v1/embed", {"inputs": ["x"]}), '{"custom_id": "b", "method": "POST"}'],
                     ["line 2", "url"], id="missing-field"),
        pytest.param([line("a", "/v1/embed", {"inputs": ["x"]}) | {"extra": 1}], ["line 1", "extra"],
                     id="unknown-field"),
        pytest.param(["", "not json"], ["line 2", "JSON"], id="not-json-after-a-blank-line"),
        pytest.param([line("a", "/v1/embed", {"inputs": ["x"]}) | {"method": "GET"}], ["line 1", "POST"],
                     id="method"),
        pytest.param([line("a", "/v1/moderations", {"input": "x"})], ["line 1", "/v1/moderations"], id="url"),
        pytest.param([line("a", "/v1/embed", {"inputs": ["x"]}), line("b", "/v1/embed", {"inputs": ["y"]}),
                      line("a", "/v1/embed", {"inputs": ["z"]})], ["line 3", "'a'", "line 1"], id="duplicate-custom-id"),
        pytest.param([line("", "/v1/embed", {"inputs": ["x"]})], ["line 1", "custom_id"], id="empty-custom-id"),
        pytest.param([line("a", "/v1/embed", ["x"])], ["line 1", "object"], id="body-not-an-object"),
        pytest.param([""], ["no request lines"], id="empty-file"),
    ],
)
def test_a_bad_line_is_refused_at_upload_by_its_number(client, tmp_path, lines, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=jsonl(tmp_path / "bad.jsonl", lines).open("rb"), purpose="batch")
    message = err.value.body["message"]
    assert all(w in message for w in words), message
    assert all(f.filename != "bad.jsonl" for f in client.files.list())


def test_limits_on_a_line_and_on_lines(client, tmp_path):
    big = line("big", "/v1/embed", {"inputs": ["x" * (MAX_BODY + 10)]})
    with pytest.raises(openai.APIStatusError) as err:
        client.files.create(file=jsonl(tmp_path / "big.jsonl", [line("a", "/v1/embed", {"inputs": ["x"]}), big])
                            .open("rb"), purpose="batch")
    assert err.value.status_code == 413 and "line 2" in err.value.body["message"]
    many = [line(f"m{i}", "/v1/embed", {"inputs": ["x"]}) for i in range(MAX_LINES + 1)]
    with pytest.raises(openai.APIStatusError) as err:
        client.files.create(file=jsonl(tmp_path / "many.jsonl", many).open("rb"), purpose="batch")
    assert err.value.status_code == 413 and f"line {MAX_LINES + 1}" in err.value.body["message"]


@pytest.mark.parametrize(
    "endpoint, lines, code, param, at_line",
    [
        pytest.param("/v1/embeddings", [line("a", "/v1/embeddings", {"model": DEFAULT_MODEL, "input": "x"}),
                                        line("b", "/v1/embeddings", {"model": "no-such-model", "input": "y"})],
                     "model_not_found", "body.model", 2, id="unknown-model"),
        pytest.param("/v1/rerank", [line("a", "/v1/rerank", {"model": DEFAULT_MODEL, "query": "q",
                                                             "documents": ["d"]})],
                     "invalid_model", "body.model", 1, id="model-of-another-task"),
        pytest.param("/v1/embeddings", [line("a", "/v1/embeddings", {"model": DEFAULT_MODEL, "input": "x"}),
                                        line("b", "/v1/embed", {"model": DEFAULT_MODEL, "inputs": ["y"]})],
                     "invalid_url", "url", 2, id="url-not-the-endpoint"),
    ],
)
def test_a_line_that_cannot_run_fails_the_batch_before_any_work(client, tmp_path, endpoint, lines, code, param,
                                                                at_line):
    b = run_batch(client, tmp_path, endpoint, lines)
    assert b.status == "failed" and b.failed_at and b.in_progress_at is None
    [error] = b.errors.data
    assert (error.code, error.param, error.line) == (code, param, at_line) and f"line {at_line}" in error.message
    assert b.output_file_id is None and b.error_file_id is None and b.request_counts.completed == 0


def test_create_refuses_what_it_cannot_take(client, tmp_path):
    f = client.files.create(file=jsonl(tmp_path / "ok.jsonl", [line("a", "/v1/embed", {"inputs": ["x"]})]).open("rb"),
                            purpose="batch")
    cases = [
        ({"endpoint": "/v1/moderations"}, "endpoint"),
        ({"completion_window": "forever"}, "completion_window"),
        ({"input_file_id": "file-000000000000000000000000"}, "input_file_id"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"extra_body": {"priority": "high"}}, "priority"),
    ]
    for change, param in cases:
        args = {"input_file_id": f.id, "endpoint": "/v1/embed", "completion_window": "24h", **change}
        with pytest.raises(openai.BadRequestError) as err:
            client.batches.create(**args)
        assert err.value.body["param"] == param, err.value.body


def test_lists_page_by_cursor(client, tmp_path):
    ids = []
    for i in range(3):
        f = client.files.create(file=jsonl(tmp_path / f"p{i}.jsonl", [line("a", "/v1/embed", {"inputs": ["x"]})])
                                .open("rb"), purpose="batch")
        ids.append(client.batches.create(input_file_id=f.id, endpoint="/v1/embed", completion_window="1h").id)
    page = client.batches.list(limit=2)  # newest first
    assert page.has_more and [b.id for b in page.data] == [ids[2], ids[1]]
    assert client.batches.list(limit=1, after=ids[1]).data[0].id == ids[0]
    every = [b.id for b in client.batches.list(limit=2)]  # the SDK follows the cursor over every page
    assert every[:3] == ids[::-1] and len(every) == len(set(every))
    newest_first = [x.id for x in client.files.list(purpose="batch", limit=1)]
    oldest_first = [x.id for x in client.files.list(purpose="batch", order="asc", limit=2)]
    assert oldest_first == newest_first[::-1] and len(oldest_first) >= 3
    raw = httpx.get(str(client.base_url) + "batches", params={"limit": 1}).json()
    assert set(raw) == {"object", "data", "first_id", "last_id", "has_more"} and raw["first_id"] == ids[-1]


def test_files_retrieve_delete_and_content(client, tmp_path):
    path = jsonl(tmp_path / "del.jsonl", [line("a", "/v1/embed", {"inputs": ["x"]})])
    f = client.files.create(file=path.open("rb"), purpose="batch", expires_after={"anchor": "created_at",
                                                                                  "seconds": 3600})
    assert f.expires_at == f.created_at + 3600 and f.filename == "del.jsonl" and f.bytes == path.stat().st_size
    assert client.files.content(f.id).content == path.read_bytes()
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(f.id)
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=path.open("rb"), purpose="fine-tune")


def test_cancel_keeps_what_is_done_and_answers_the_rest(client, tmp_path):
    lines = [line(f"g{i}", "/v1/chat/completions",
                  {"model": LLAMA, "messages": [{"role": "user", "content": f"go {i}"}], "max_tokens": 48})
             for i in range(MAX_LINES)]
    f = client.files.create(file=jsonl(tmp_path / "long.jsonl", lines).open("rb"), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    while client.batches.retrieve(b.id).request_counts.completed < 10:
        time.sleep(0.1)
    with pytest.raises(openai.BadRequestError):
        client.files.delete(f.id)  # the input of a batch still running
    t0 = time.monotonic()
    cancelled = client.batches.cancel(b.id)
    assert cancelled.status == "cancelling" and cancelled.cancelling_at
    # Issue 23 item 3: no new line starts after the cancel answer, and the lines in flight
    # are withdrawn at once (their answers dropped; one whose answer came in the same
    # instant may still be kept): the count stops growing within a second.
    seen = []
    while time.monotonic() - t0 < 1.0:
        now = client.batches.retrieve(b.id)
        if now.status != "cancelled":
            assert now.status == "cancelling", now.status
        seen.append(now.request_counts.completed)
        time.sleep(0.05)
    b = wait_final(client, b.id, timeout_s=30)
    took = time.monotonic() - t0
    assert b.status == "cancelled" and b.cancelled_at >= b.cancelling_at
    out_raw = client.files.content(b.output_file_id).content
    assert out_raw.endswith(b"\n")  # whole lines only
    out, err = results(client, b.output_file_id), results(client, b.error_file_id)
    done = b.request_counts.completed
    assert len(out) == done and 10 <= done < MAX_LINES
    assert seen[-1] == done >= cancelled.request_counts.completed, (cancelled.request_counts, seen)
    answered = [r for r in out + err if r["response"] is not None]
    assert len(answered) == done + b.request_counts.failed
    assert sorted(r["custom_id"] for r in out + err) == sorted(f"g{i}" for i in range(MAX_LINES))
    assert {r["error"]["code"] for r in err if r["response"] is None} == {"batch_cancelled"}
    print(f"cancel: {done} lines done ({cancelled.request_counts.completed} at the cancel answer, then "
          f"{sorted(set(seen))}), {len(err)} answered batch_cancelled, final after {took:.2f} s")
    assert took < 5.0
    done_batch = run_batch(client, tmp_path, "/v1/embed", [line("a", "/v1/embed", {"inputs": ["x"]})])
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(done_batch.id)  # completed: nothing to cancel


def test_a_field_the_files_and_batches_routes_do_not_take_is_refused(fleet, client, tmp_path):
    """Understood or refused: the upload's form takes OpenAI's fields (`file`, `purpose`,
    `expires_after[anchor]`, `expires_after[seconds]`, each once); cancel takes no body;
    the lists take their own query parameters. Anything else is a 400 naming it."""
    body = json.dumps(line("a", "/v1/embed", {"inputs": ["x"]})).encode()
    before = {f.id for f in client.files.list()}

    def upload(data: dict) -> httpx.Response:
        return httpx.post(fleet.url + "/v1/files", files={"file": ("f.jsonl", body)}, data=data, timeout=30)

    for data, param in [({"purpose": "batch", "purpos": "batch"}, "purpos"),
                        ({"purpose": "batch", "expires_after[second]": "3600"}, "expires_after[second]"),
                        ({"purpose": "batch", "expires_after": "3600"}, "expires_after"),
                        ({"purpose": ["batch", "batch"]}, "purpose")]:
        resp = upload(data)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err
        assert param in err["message"]
    err = upload({"purpose": "batch", "purpos": "batch"}).json()["error"]
    assert err["message"] == "Unrecognized request argument supplied: purpos (did you mean purpose?)"
    assert {f.id for f in client.files.list()} == before  # nothing was kept
    # What OpenAI documents is applied.
    ok = upload({"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "7200"})
    assert ok.status_code == 200 and ok.json()["expires_at"] - ok.json()["created_at"] == 7200
    # Cancel: no body, `{}`, or a field refused before anything happens.
    b = run_batch(client, tmp_path, "/v1/embed", [line("a", "/v1/embed", {"inputs": ["x"]})])
    resp = httpx.post(f"{fleet.url}/v1/batches/{b.id}/cancel", json={"reason": "x"}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "reason", resp.text
    resp = httpx.post(f"{fleet.url}/v1/batches/{b.id}/cancel", json={}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "batch_id"  # completed: the body was fine
    for path, param in [("/v1/batches?limt=1", "limt"), ("/v1/files?purpose=batch&ordr=asc", "ordr")]:
        resp = httpx.get(fleet.url + path, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_an_output_line_survives_any_line_splitter(client, tmp_path):
    """A model's text or a custom_id may hold U+2028, U+2029 or U+0085, which JSON leaves
    raw and `str.splitlines` (and httpx's `iter_lines`) still splits at: fleet escapes
    them, so reading the file line by line gives one whole answer per line."""
    ids = ["a\u2028b", "c\u2029d", "e\x85f", "plain"]
    b = run_batch(client, tmp_path, "/v1/embed", [line(i, "/v1/embed", {"inputs": ["x"]}) for i in ids])
    assert b.status == "completed" and b.request_counts.completed == len(ids)
    text = client.files.content(b.output_file_id).text
    assert not any(c in text for c in "\u2028\u2029\x85")
    assert sorted(r["custom_id"] for r in results(client, b.output_file_id)) == sorted(ids)


def test_uploads_are_guarded_as_every_body_is(fleet):
    form = {"files": {"file": ("x.jsonl", json.dumps(line("a", "/v1/embed", {"inputs": ["x"]})).encode())},
            "data": {"purpose": "batch"}}
    assert httpx.post(fleet.url + "/v1/embed", **form).status_code == 415  # multipart only where a file goes
    assert httpx.post(fleet.url + "/v1/files", headers={"Origin": "https://evil.example"}, **form).status_code == 403
    assert httpx.post(fleet.url + "/v1/files", **form).status_code == 200


def test_the_window_closing_expires_the_batch_and_keeps_what_is_done(client, tmp_path):
    lines = [line(f"x{i}", "/v1/chat/completions",
                  {"model": LLAMA, "messages": [{"role": "user", "content": f"slow {i}"}], "max_tokens": 48})
             for i in range(MAX_LINES)]
    f = client.files.create(file=jsonl(tmp_path / "slow.jsonl", lines).open("rb"), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="2s")
    assert b.expires_at - b.created_at == 2
    b = wait_final(client, b.id, timeout_s=30)
    assert b.status == "expired" and b.expired_at and b.completed_at is None
    out, err = results(client, b.output_file_id), results(client, b.error_file_id)
    assert 0 < len(out) == b.request_counts.completed < MAX_LINES
    assert sorted(r["custom_id"] for r in out + err) == sorted(f"x{i}" for i in range(MAX_LINES))
    expired = [r for r in err if r["error"] is not None]
    assert {r["error"]["code"] for r in expired} == {"batch_expired"}
    assert all(r["response"] is None for r in expired)
    assert len(expired) == MAX_LINES - b.request_counts.completed - b.request_counts.failed


def fleetctl(d: DaemonProc, *args: str):
    """`fleetctl ARGS` against `d` (a subprocess.CompletedProcess of text)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "FLEET_URL": d.url, "COLUMNS": "120"}
    return subprocess.run([sys.executable, "-m", "fleetctl", *args], env=env, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


def test_fleetctl_batch_submit_wait_ls_show_get_cancel_and_ps(fleet, client, tmp_path):
    lines = [line(f"c{i}", "/v1/embeddings", {"model": DEFAULT_MODEL, "input": f"cli {i}"}) for i in range(20)]
    lines.append(line("bad", "/v1/embeddings", {"model": DEFAULT_MODEL, "input": "x", "dimensions": 0}))
    done = fleetctl(fleet, "batch", "submit", str(jsonl(tmp_path / "cli.jsonl", lines)), "--wait")
    assert done.returncode == 0, done.stderr
    batch_id = done.stdout.strip()
    assert batch_id.startswith("batch_") and "20 of 21 lines answered 200, 1 with errors" in done.stderr
    assert "21/21" in done.stderr and "tokens/s" in done.stderr  # the progress bar's last state
    listed = json.loads(fleetctl(fleet, "batch", "ls", "--json").stdout)
    assert listed[0]["id"] == batch_id
    shown = fleetctl(fleet, "batch", "show", batch_id)
    assert shown.returncode == 0 and "completed" in shown.stdout and "output file file-" in shown.stdout
    got = fleetctl(fleet, "batch", "get", batch_id, "-o", str(tmp_path / "out.jsonl"), "--errors",
                   str(tmp_path / "err.jsonl"))
    assert got.returncode == 0, got.stderr
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 20
    [err] = [json.loads(x) for x in (tmp_path / "err.jsonl").read_text().splitlines()]
    assert err["custom_id"] == "bad" and err["response"]["body"]["error"]["param"] == "dimensions"
    # A batch running: `fleetctl ps` lists it; `fleetctl batch cancel` stops it.
    # Long enough to be running still after three more fleetctl calls on a warm, idle box.
    slow = [line(f"s{i}", "/v1/chat/completions",
                 {"model": LLAMA, "messages": [{"role": "user", "content": f"{i}"}], "max_tokens": 200})
            for i in range(MAX_LINES)]
    running = fleetctl(fleet, "batch", "submit", str(jsonl(tmp_path / "slow.jsonl", slow)))
    slow_id = running.stdout.strip()
    ps = json.loads(fleetctl(fleet, "ps", "--json").stdout)
    assert [b["id"] for b in ps["batches"]] == [slow_id]
    assert slow_id in fleetctl(fleet, "ps").stdout
    assert fleetctl(fleet, "batch", "get", slow_id, "-o", str(tmp_path / "x.jsonl")).returncode == 1  # not final
    cancelled = fleetctl(fleet, "batch", "cancel", slow_id)
    assert cancelled.stdout.split() == [slow_id, "cancelling"], cancelled.stderr
    assert wait_final(client, slow_id).status == "cancelled"
    assert fleetctl(fleet, "batch", "submit", str(tmp_path / "missing.jsonl")).returncode == 2
