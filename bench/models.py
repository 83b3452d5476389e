"""Models a bench builds from a config (random weights, real architectures and tokenizers)
and the FLEET_HOME it pulls them into: shared by the GPU acceptance run (bench.gpu_check) and bench.host_path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any


#: What a BERT built here has unless its caller says otherwise.
BERT_DEFAULTS = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
                 "max_position_embeddings": 512, "initializer_range": 0.3}
#: all-MiniLM-L6-v2's tokenizer and sentence-transformers files, copied as they are into
#: an embedder built here (its vocabulary is the model's: the token counts are MiniLM's).
MINILM_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                "sentence_bert_config.json", "config_sentence_transformers.json")


def build_bert(folder: Path, cls: Any, seed: int, vocab_size: int, **cfg: Any) -> Path:
    """Random weights of the transformers BERT class `cls` (BERT_DEFAULTS, then `cfg`),
    saved to `folder` (config.json, model.safetensors)."""
    import torch
    from transformers import BertConfig

    torch.manual_seed(seed)
    cls(BertConfig(vocab_size=vocab_size, **{**BERT_DEFAULTS, **cfg})).eval().save_pretrained(folder)
    return folder


def build_st_embedder(folder: Path, minilm: Path, seed: int = 0, **cfg: Any) -> Path:
    """A random BertModel in sentence-transformers' folder layout: modules.json with
    Transformer -> Pooling (mean) -> Normalize, config.json, safetensors weights, and
    all-MiniLM-L6-v2's tokenizer files (MINILM_FILES) copied from `minilm`."""
    from transformers import BertModel

    build_bert(folder, BertModel, seed, json.loads((minilm / "config.json").read_text())["vocab_size"], **cfg)
    for name in MINILM_FILES:
        if (minilm / name).is_file():
            shutil.copyfile(minilm / name, folder / name)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}], indent=1))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": int(cfg.get("hidden_size", BERT_DEFAULTS["hidden_size"])),
        "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False}, indent=1))
    (folder / "2_Normalize").mkdir(exist_ok=True)
    return folder


def make_home(home: Path, folders: dict[str, Path], served: dict[str, tuple[str, str, str, str]], dtype: str,
              *, catalog: tuple[str, ...] = (), dtypes: dict[str, str] | None = None) -> Path:
    """FLEET_HOME with `served` (name -> TASK_MODELS-shaped entry) pulled from `folders`,
    and `catalog` names (from models.toml, e.g. all-minilm-l6-v2) pulled as shipped.
    `dtypes`: a model's own dtype where it is not `dtype`."""
    home.mkdir(parents=True, exist_ok=True)
    own = dtypes or {}
    (home / "models.toml").write_text("".join(
        f'[models."{name}"]\nsource = "path:{folders[key].resolve()}"\ntask = "{task}"\nruntime = "{runtime}"\n'
        f'{extra}max_seq_len = 256\n[models."{name}".profile]\ndtype = "{own.get(name, dtype)}"\n\n'
        for name, (key, task, runtime, extra) in served.items()))
    env = {**os.environ, "FLEET_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    for name in [*served, *catalog]:
        done = subprocess.run([sys.executable, "-m", "fleetctl", "pull", name], env=env, capture_output=True,
                              text=True, timeout=600, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"fleetctl pull {name} failed: {done.stderr.strip()}")
    return home


LLAMA_CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, this is fleet serving small models",
                "invoices must be paid within thirty days of receipt",
                "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9 . , ! ?"]


def build_llama(folder: Path, **shape: Any) -> Path:
    """A 2-layer Llama with a byte-level BPE trained here; a large init range
    makes greedy choices far from ties (they must not flip between dtypes).
    `shape`: other LlamaConfig sizes (hidden_size, num_hidden_layers, ...)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(LLAMA_CORPUS * 4, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(**{"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                         "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "initializer_range": 0.3,
                         "tie_word_embeddings": False, **shape})
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def build_lora(base: Path, folder: Path, *, seed: int) -> Path:
    """A LoRA adapter of `base` on q and v, random rather than zero-initialised: it
    must change the text, or a mixed batch could not tell adapters apart."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                        init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), config).save_pretrained(folder)
    return folder
