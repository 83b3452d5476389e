"""Pulling LoRA adapters: fleet takes what it serves, on a base that can take it,
and refuses the rest at pull with a message that says why (fleet.lora).

Real peft adapters of tiny real models (tests.lora_models), pulled with the
real `pull_model` into a temp store; one refusal through the CLI too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.errors import BadRequest
from fleet.pull import pull_model
from fleet.store import Store
from tests.lora_models import bert_config, build_bases, build_lora, load_base, tokenizer


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import BertForMaskedLM

    root = tmp_path_factory.mktemp("lora-pull-bases")
    out = build_bases(root)
    # A SPLADE model is a masked LM: a bare encoder pulled as one is refused (its head would be random).
    tok = tokenizer()
    BertForMaskedLM(bert_config(tok)).save_pretrained(root / "masked-lm")
    tok.save_pretrained(root / "masked-lm")
    return out | {"masked-lm": root / "masked-lm"}


@pytest.fixture(scope="module")
def loras(tmp_path_factory: pytest.TempPathFactory, bases: dict[str, Path]) -> dict[str, Path]:
    """Adapters fleet serves, and adapters it must refuse."""
    from peft import LoraConfig, get_peft_model
    from transformers import BertModel

    root = tmp_path_factory.mktemp("lora-pull-loras")
    seq = "AutoModelForSequenceClassification"
    out = {
        "emb": build_lora(load_base(bases["bert"], "AutoModel"), root / "emb", seed=1, task_type="FEATURE_EXTRACTION"),
        "cls": build_lora(load_base(bases["classifier"], seq), root / "cls", seed=2, task_type="SEQ_CLS"),
        "ner": build_lora(load_base(bases["tagger"], "AutoModelForTokenClassification"), root / "ner", seed=3,
                          task_type="TOKEN_CLS"),
    }
    wide = bert_config(tokenizer()).to_dict() | {"hidden_size": 48}
    out["wide"] = build_lora(BertModel(type(bert_config(tokenizer()))(**wide)), root / "wide", seed=4,
                             task_type="FEATURE_EXTRACTION")
    for name, config in {
        "dora": LoraConfig(r=4, target_modules=["query"], use_dora=True),
        "bias": LoraConfig(r=4, target_modules=["query"], bias="lora_only"),
        "embedding": LoraConfig(r=4, target_modules=["word_embeddings"]),
    }.items():
        get_peft_model(load_base(bases["bert"], "AutoModel"), config).save_pretrained(root / name)
        out[name] = root / name
    # An adapter that says it is for another model type.
    out["roberta"] = build_lora(load_base(bases["bert"], "AutoModel"), root / "roberta", seed=5,
                                task_type="FEATURE_EXTRACTION")
    (out["roberta"] / "config.json").write_text(json.dumps({"model_type": "roberta"}))
    # Layers the base does not have (a decoder's projections).
    out["decoder"] = build_lora(load_base(bases["bert"], "AutoModel"), root / "decoder", seed=6,
                                task_type="FEATURE_EXTRACTION")
    weights = out["decoder"] / "adapter_model.safetensors"
    from safetensors.torch import load_file, save_file

    save_file({k.replace("attention.self.query", "self_attn.q_proj"): v for k, v in load_file(weights).items()},
              str(weights))
    return out


@pytest.fixture()
def store(tmp_path: Path, bases: dict[str, Path]) -> Store:
    store = Store(tmp_path / "models")
    for name, key, task, runtime in (("tiny-emb", "embedder", None, None), ("tiny-cls", "classifier", None, None),
                                     ("tiny-rr", "reranker", None, None), ("tiny-ner", "tagger", None, None),
                                     ("tiny-splade", "masked-lm", "embed", "splade")):
        pull_model(store, f"path:{bases[key]}", name=name, task=task, runtime=runtime)
    return store


@pytest.mark.parametrize("lora, base, task", [
    ("emb", "tiny-emb", "embed"),
    ("cls", "tiny-cls", "classify"),
    ("ner", "tiny-ner", "extract"),
    # An adapter of the encoder alone fits every model on that encoder: it takes the base's task.
    ("emb", "tiny-rr", "rerank"),
])
def test_an_adapter_serves_its_base_task(store: Store, loras: dict[str, Path], lora: str, base: str,
                                         task: str) -> None:
    m = pull_model(store, f"path:{loras[lora]}", name=f"{lora}-on-{base}", base=base).manifest
    assert (m.task, m.runtime, m.base) == (task, "peft", base)


@pytest.mark.parametrize("lora, base, message", [
    ("emb", "no-such-base", "LoRA adapter of 'no-such-base', which is not stored"),
    ("cls", "tiny-ner", "is a SEQ_CLS adapter (for classify or rerank models); 'tiny-ner' is a extract model"),
    ("ner", "tiny-cls", "is a TOKEN_CLS adapter (for extract models); 'tiny-cls' is a classify model"),
    ("wide", "tiny-emb", "maps 48 -> 48 features at 'encoder.layer.0.attention.output.dense'; 'tiny-emb' has 32 -> 32"),
    ("roberta", "tiny-emb", "is for roberta models; 'tiny-emb' is a bert model"),
    ("decoder", "tiny-emb", "targets the layer 'encoder.layer.0.self_attn.q_proj', which 'tiny-emb' does not have"),
    # A token classifier has no pooler: an encoder adapter that trained one does not fit it.
    ("emb", "tiny-ner", "targets the layer 'pooler.dense', which 'tiny-ner' does not have"),
    ("dora", "tiny-emb", "DoRA adapters are not served"),
    ("bias", "tiny-emb", "LoRA biases are not served"),
    ("embedding", "tiny-emb", "puts LoRA on the embedding layer 'embeddings.word_embeddings'"),
    ("emb", "tiny-splade", "'tiny-splade' (embed, runtime splade) does not take LoRA adapters"),
])
def test_what_fleet_would_not_serve_is_refused_at_pull(store: Store, loras: dict[str, Path], lora: str, base: str,
                                                       message: str) -> None:
    with pytest.raises(BadRequest) as err:
        pull_model(store, f"path:{loras[lora]}", name="refused", base=base)
    assert message in err.value.message
    assert not store.exists("refused")


def test_an_adapter_of_an_adapter_and_a_wrong_task_flag_are_refused(store: Store, loras: dict[str, Path]) -> None:
    pull_model(store, f"path:{loras['emb']}", name="emb-a", base="tiny-emb")
    with pytest.raises(BadRequest, match="'emb-a' is itself a LoRA adapter"):
        pull_model(store, f"path:{loras['emb']}", name="emb-b", base="emb-a")
    with pytest.raises(BadRequest, match="serves its base's task: 'tiny-emb' is a embed model, not classify"):
        pull_model(store, f"path:{loras['emb']}", name="emb-c", base="tiny-emb", task="classify")


def test_the_cli_says_why_in_one_line(tmp_path: Path, bases: dict[str, Path], loras: dict[str, Path]) -> None:
    env = {**os.environ, "FLEET_HOME": str(tmp_path / "home")}

    def fleetctl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fleetctl", *args], env=env, capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)

    refused = fleetctl("pull", f"path:{loras['cls']}", "--name", "enc-lora", "--base", "tiny-cls")
    assert refused.returncode == 1
    assert "is a LoRA adapter of 'tiny-cls', which is not stored" in refused.stderr
    assert "fleetctl pull tiny-cls" in refused.stderr
    assert fleetctl("pull", f"path:{bases['classifier']}", "--name", "tiny-cls").returncode == 0
    pulled = fleetctl("pull", f"path:{loras['cls']}", "--name", "enc-lora", "--base", "tiny-cls", "--json")
    assert pulled.returncode == 0, pulled.stderr
    assert json.loads(pulled.stdout)["manifest"]["task"] == "classify"
