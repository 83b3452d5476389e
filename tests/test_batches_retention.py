"""Retention of batch files (issue 23, item 6), against a real `fleetctl serve` with
the real all-MiniLM-L6-v2: an input file and a batch's results are deleted once
older than `batch_retention_days`; a file whose own `expires_after` is later stays.

The setting is 3 s here (FLEET_BATCH_RETENTION_DAYS = 3/86400) so the test waits
seconds, not days. The default (30 days) takes the same path: every file gets
`expires_at` = its creation + the retention (or its `expires_after`), and the
sweep (`Batches.retention_loop`) deletes what is past it every
min(600 s, retention): the only difference a short setting makes is that the
sweep comes every 3 s instead of every 600 s.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import DEFAULT_MODEL, start_daemon

pytestmark = pytest.mark.slow

RETENTION_S = 3


def jsonl(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/embed",
                                        "body": {"model": DEFAULT_MODEL, "inputs": [f"text {i}"]}}) + "\n"
                            for i in range(n)))
    return path


def test_files_and_results_past_retention_are_deleted_and_the_rest_stays(tmp_path):
    home = tmp_path / "home"
    d = start_daemon(home, extra_env={"FLEET_BATCH_RETENTION_DAYS": repr(RETENTION_S / 86_400)})
    try:
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0)
        kept = client.files.create(file=jsonl(tmp_path / "kept.jsonl", 2).open("rb"), purpose="batch",
                                   expires_after={"anchor": "created_at", "seconds": 3600})
        short = client.files.create(file=jsonl(tmp_path / "short.jsonl", 4).open("rb"), purpose="batch")
        assert short.expires_at - short.created_at == RETENTION_S
        assert kept.expires_at - kept.created_at == 3600
        b = client.batches.create(input_file_id=short.id, endpoint="/v1/embed", completion_window="1h")
        end = time.monotonic() + 60
        while (b := client.batches.retrieve(b.id)).status != "completed":
            assert time.monotonic() < end and b.status in ("validating", "in_progress", "finalizing"), b
            time.sleep(0.1)
        assert b.request_counts.completed == 4
        out = client.files.retrieve(b.output_file_id)
        assert out.expires_at - out.created_at == RETENTION_S
        assert len(client.files.content(out.id).text.splitlines()) == 4
        # Past expiry plus one sweep period (and slack for a loaded box): both are gone.
        gone = {short.id, out.id}
        deadline = time.monotonic() + 4 * RETENTION_S + 10
        while gone & {f.id for f in client.files.list()}:
            assert time.monotonic() < deadline, "expired files were not deleted"
            time.sleep(0.2)
        assert time.time() >= out.expires_at
        for file_id in gone:
            with pytest.raises(openai.NotFoundError):
                client.files.retrieve(file_id)
            with pytest.raises(openai.NotFoundError):
                client.files.content(file_id)
        on_disk = {p.name for p in (home / "batches" / "files").iterdir()}
        assert not gone & on_disk and kept.id in on_disk
        # What has not expired stays, whole; the batch itself stays, naming its (deleted) output.
        assert client.files.retrieve(kept.id).id == kept.id
        assert client.files.content(kept.id).content == (tmp_path / "kept.jsonl").read_bytes()
        assert client.batches.retrieve(b.id).output_file_id == out.id
        assert httpx.get(f"{d.url}/v1/files/{out.id}/content", timeout=30).status_code == 404
    finally:
        d.stop()
