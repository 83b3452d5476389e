"""Tiny random embedders in their hub folder layouts, built offline (for the
prompt, dimension and output-dtype tests).

- `build_qwen3_embedder`: laid out like Qwen/Qwen3-Embedding-0.6B: a `Qwen3Model`
  (safetensors), a byte-level BPE tokenizer that appends its EOS to every text
  and pads on the left, sentence-transformers modules Transformer ->
  Pooling(lasttoken) -> Normalize, and the instruction prompts in
  `config_sentence_transformers.json` (`query`: Qwen3-Embedding's own, `document`: "").
- `build_instructor_embedder`: a tiny BERT with the all-MiniLM tokenizer and
  mean pooling that leaves the prompt's tokens out (`include_prompt: false`, as
  INSTRUCTOR models pool), saved by sentence-transformers itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.gen_models import build_tokenizer

#: Qwen3-Embedding's query prompt, as its config_sentence_transformers.json has it.
QWEN3_QUERY = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
#: The prompts the tiny INSTRUCTOR-like model ships with.
INSTRUCTOR_PROMPTS = {"query": "Represent the question for retrieving supporting documents: ",
                      "document": "Represent the document for retrieval: "}


def build_qwen3_embedder(folder: Path, *, seed: int = 0, hidden: int = 64) -> Path:
    import torch
    from tokenizers import processors
    from transformers import Qwen3Config, Qwen3Model

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    # As Qwen3-Embedding's tokenizer: the EOS closes every text (the token the pooling reads).
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", tok.convert_tokens_to_ids("</s>"))])
    tok.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "padding_side": "left"}))
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      bos_token_id=0, eos_token_id=1, pad_token_id=2, initializer_range=0.3)
    Qwen3Model(cfg).eval().save_pretrained(folder)
    write_json(folder / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ])
    write_json(folder / "sentence_bert_config.json", {"max_seq_length": 128, "do_lower_case": False})
    write_json(folder / "1_Pooling" / "config.json", {
        "word_embedding_dimension": hidden, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True})
    (folder / "2_Normalize").mkdir(exist_ok=True)
    write_json(folder / "config_sentence_transformers.json", {
        "prompts": {"query": QWEN3_QUERY, "document": ""}, "default_prompt_name": None,
        "similarity_fn_name": "cosine"})
    return folder


def build_instructor_embedder(folder: Path, tokenizer_dir: Path, *, seed: int = 0, hidden: int = 32) -> Path:
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import AutoTokenizer, BertConfig, BertModel

    bert = folder.parent / f"{folder.name}-bert"
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=2 * hidden, max_position_embeddings=128, initializer_range=0.3),
              add_pooling_layer=False).eval().save_pretrained(bert)
    tok.save_pretrained(bert)
    model = SentenceTransformer(modules=[Transformer(str(bert), max_seq_length=128),
                                         Pooling(hidden, "mean", include_prompt=False), Normalize()],
                                prompts=INSTRUCTOR_PROMPTS, device="cpu")
    model.save(str(folder))
    return folder


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
