"""A generator's memory estimate is one step of its batcher, not its context window (issue 36).

The estimate used to size a generator like an encoder whose attention scores
span the whole context: a 1 MB Qwen2 with 32 768 positions "needed" 57 380 MiB of
activations, and no catalog generator could load on a 24 GB box. It is now what
one step of the continuous batcher holds (runtimes.footprint.decoder_step): the
tokens it admits (rows x context, cut to the profile's max_batch_tokens) and their
activations under SDPA (no seq x seq matrix). The key/value cache is reserved as
sequences are admitted, and a sequence waits for room (runtimes.adapters.generate;
tests/test_generate_openai.py's tight budget): a load needs no cache room.

Each catalog generator is sized from its real config.json (tests/data/
catalog_generators.json) and a safetensors header of its real tensor shapes (the
estimate reads headers only; no data is written), at its catalog profile, the way
a worker sizes it (`footprint_from_headers`).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import msgspec
import pytest

from fleet.catalog import load_catalog
from fleet.runtimes.base import ModelSpec, Profile
from fleet.runtimes.footprint import Footprint, decoder_shape, decoder_step, kv_token_bytes
from fleet.runtimes.memory import TOO_LARGE, plan_load
from fleet.runtimes.hosting import footprint_from_headers

CONFIGS = {k: v for k, v in json.loads((Path(__file__).parent / "data" / "catalog_generators.json").read_text()).items()
           if not k.startswith("_")}
#: The CPU budget of the 24 GB box of issue 36 (cpu_budget_fraction 0.5 of its available RAM).
BOX_BUDGET = int(10958.8 * (1 << 20))
MiB = 1 << 20


def tensor_shapes(cfg: dict) -> dict[str, list[int]]:
    """The tensors of a decoder of this config (embeddings, every layer, the final norm,
    an untied head), named as Llama-style checkpoints name them."""
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": [cfg["vocab_size"], h], "model.norm.weight": [h]}
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes |= {p + "self_attn.q_proj.weight": [q, h], p + "self_attn.k_proj.weight": [kv, h],
                   p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, q],
                   p + "mlp.gate_proj.weight": [i, h], p + "mlp.up_proj.weight": [i, h],
                   p + "mlp.down_proj.weight": [h, i], p + "input_layernorm.weight": [h],
                   p + "post_attention_layernorm.weight": [h]}
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = [cfg["vocab_size"], h]
    return shapes


def header_only_folder(folder: Path, cfg: dict) -> Path:
    """config.json and a model.safetensors whose header lists the model's bf16 tensors
    (offsets as a real file has them) and holds no data: what the estimate reads."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    header, at = {}, 0
    for name, shape in tensor_shapes(cfg).items():
        n = 2
        for d in shape:
            n *= d
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return folder


def spec_of(name: str, folder: Path, home: Path) -> ModelSpec:
    """What a worker resolves for the catalog entry `name` with its files in `folder`."""
    entry = load_catalog(home).find(name)
    assert entry is not None, name
    return ModelSpec(name=name, path=folder, task=entry.task, runtime=entry.runtime,
                     profile=Profile.from_mapping(msgspec.structs.asdict(entry.profile)),
                     max_seq_len=entry.max_seq_len)


def step_tokens(spec: ModelSpec, cfg: dict) -> int:
    """Tokens one step of the batcher admits: rows x context, cut to the batch token budget."""
    context = min(x for x in (spec.max_seq_len, cfg["max_position_embeddings"]) if x)
    return min(spec.profile.max_batch_items * context, spec.profile.max_batch_tokens)


def test_the_data_names_every_catalog_generator(tmp_path: Path):
    catalog = load_catalog(tmp_path)
    generators = {e.name for e in catalog.all() if e.task == "generate" and e.runtime == "transformers"}
    assert generators <= set(CONFIGS), sorted(generators - set(CONFIGS))
    for name, cfg in CONFIGS.items():
        assert catalog.find(name).model_type == cfg["model_type"], name


@pytest.mark.parametrize("name", sorted(n for n in CONFIGS if not n.startswith("qwen3-reranker")))
def test_each_catalog_generator_is_sized_as_one_step_and_fits_a_24_gb_box(tmp_path: Path, name: str):
    cfg = CONFIGS[name]
    spec = spec_of(name, header_only_folder(tmp_path / name, cfg), tmp_path)
    fp = footprint_from_headers(spec)
    tokens = step_tokens(spec, cfg)
    weights = sum(2 * _count(s) for s in tensor_shapes(cfg).values())  # bf16, the profile's dtype
    assert fp.weights_bytes == weights
    # No cache room at load: sequences reserve theirs as they are admitted.
    assert fp.total_bytes == fp.weights_bytes + fp.activation_bytes
    # Activations: more than one hidden and one intermediate tensor a token, less than a
    # few dozen of them plus a padded prefill's boolean mask and the last position's logits;
    # less than one layer's scores over the context window (what the old estimate counted).
    per_token = (cfg["hidden_size"] + cfg["intermediate_size"]) * 2
    rows = spec.profile.max_batch_items
    assert tokens * per_token < fp.activation_bytes
    assert fp.activation_bytes <= tokens * (12 * per_token + tokens // 2) + rows * cfg["vocab_size"] * 8
    assert fp.activation_bytes < tokens * cfg["num_attention_heads"] * cfg["max_position_embeddings"] * 2
    assert fp.total_bytes <= BOX_BUDGET, f"{name}: {fp.total_bytes / MiB:.0f} MiB"


def test_an_llm_reranker_is_sized_as_its_micro_batch_without_a_cache(tmp_path: Path):
    name = "qwen3-reranker-0.6b"
    cfg = CONFIGS[name]
    spec = spec_of(name, header_only_folder(tmp_path / name, cfg), tmp_path)
    fp = footprint_from_headers(spec)
    tokens = spec.profile.max_batch_tokens  # micro-batches of 64 inputs of up to 40 960 tokens, cut to the budget
    per_token = (cfg["hidden_size"] + cfg["intermediate_size"]) * 4  # dtype auto: fp32 on the CPU
    assert tokens * per_token < fp.activation_bytes <= tokens * (12 * per_token + tokens // 2) + 64 * cfg["vocab_size"] * 8
    assert fp.total_bytes <= BOX_BUDGET


def tiny_qwen2(folder: Path, positions: int) -> Path:
    """A ~1 MB Qwen2 (32 hidden units, 2 layers) whose config allows `positions` tokens."""
    import torch
    import transformers

    from tests.arch_models import _decoder_kw, _save, qwen_tokenizer

    tok = qwen_tokenizer()
    cfg = transformers.Qwen2Config(**{**_decoder_kw(tok), "max_position_embeddings": positions,
                                      "tie_word_embeddings": True})
    torch.manual_seed(0)
    return _save(transformers.Qwen2ForCausalLM(cfg), tok, folder)


@pytest.mark.parametrize(("rows", "max_seq_len", "budget", "tokens"), [
    (16, None, 16384, 16384),     # 16 rows of 32 768 positions: the batch token budget bounds the step
    (2, 1024, 16384, 2048),       # 2 rows of 1 024 tokens each: rows x tokens bounds it
    (4, None, 100, 100),          # a small budget
    (1, 500, 16384, 500),         # one row: its context
])
def test_a_step_is_the_rows_and_tokens_the_batcher_admits(tmp_path: Path, rows, max_seq_len, budget, tokens):
    folder = tiny_qwen2(tmp_path / "q", 32768)
    spec = ModelSpec(name="q", path=folder, task="generate", runtime="transformers", max_seq_len=max_seq_len,
                     profile=Profile(max_batch_items=rows, max_batch_tokens=budget, dtype="float32"))
    step = decoder_step(decoder_shape(folder), rows=rows, max_batch_tokens=budget, max_seq_len=max_seq_len,
                        dtype_bytes=4)
    assert step[0] == tokens
    assert footprint_from_headers(spec).activation_bytes == step[1]


def test_the_config_sizes_a_cache_token_as_the_batcher_measures_it(tmp_path: Path):
    """The estimate's bytes a token equal what runtimes.adapters.generate measures in its real
    cache at warm-up, and the reserve of admitted rows is rows x widest x that."""
    from fleet.protocol import GenerateRequest
    from fleet.runtimes.adapters.generate import CausalLM

    folder = tiny_qwen2(tmp_path / "q", 32768)
    spec = ModelSpec(name="q", path=folder, task="generate", runtime="transformers",
                     profile=Profile(max_batch_items=4, dtype="float32"))
    lm = CausalLM(spec, "cpu")
    lm.load()
    try:
        assert lm.kv_token_bytes == kv_token_bytes(decoder_shape(folder), 4)
        for n, words in enumerate((3, 9, 5)):
            lm.admit(n, GenerateRequest(model="q", prompt="hello " * words, max_tokens=7, temperature=0.0))
        widest = max(s.final_len for s in lm.rows + lm.pending)
        assert lm.reserved_bytes() == 3 * widest * lm.kv_token_bytes
    finally:
        lm.unload()


def test_the_issue_36_folder_fits_and_a_refusal_names_every_term(tmp_path: Path):
    """The 1 MB Qwen2 of 32 768 positions, pulled from a folder (the default profile):
    tens of MiB, not 57 380; a budget too small for it is refused with each term named,
    and they add up to what it says it needs."""
    from fleet.catalog import Profile as CatalogProfile

    folder = tiny_qwen2(tmp_path / "q", 32768)
    default = Profile.from_mapping(msgspec.structs.asdict(CatalogProfile()))
    fp = footprint_from_headers(ModelSpec(name="q", path=folder, task="generate", runtime="transformers",
                                          profile=default))
    assert fp.total_bytes < 256 * MiB
    plan = plan_load("q", fp, [], worker=0, device="cpu", budget_bytes=fp.total_bytes - 1,
                     free_now_bytes=1 << 40)
    assert plan.verdict == TOO_LARGE
    for part in (fp.total_bytes, fp.weights_bytes, fp.activation_bytes):
        assert f"{part / MiB:.1f} MiB" in plan.reason
    assert "max_batch_tokens" in plan.reason
    assert Footprint(fp.weights_bytes, fp.activation_bytes).total_bytes == fp.total_bytes


def _count(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_the_issue_36_model_pulled_from_a_folder_loads_and_answers(tmp_path: Path):
    """End to end at the shipped defaults (the CPU budget is half the available RAM):
    the 1 MB Qwen2 of 32 768 positions loads and generates, where it was refused 507
    ("needs 57381.0 MiB")."""
    import httpx

    from fleet.pull import pull_model
    from fleet.store import Store
    from tests.conftest import start_daemon

    home = tmp_path / "home"
    pull_model(Store(home / "models"), f"path:{tiny_qwen2(tmp_path / 'q', 32768)}", name="tiny-qwen2")
    d = start_daemon(home, extra_env={"FLEET_PRELOAD": ""}, args=["--workers", "1"])
    try:
        r = httpx.post(d.url + "/v1/generate", json={"model": "tiny-qwen2", "prompt": "hello world",
                                                      "max_tokens": 4, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["output_tokens"] >= 1
    finally:
        d.stop()
