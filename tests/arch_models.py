"""Tiny random models of every architecture the catalog serves, in their hub folder layout.

Each builder writes what the hub repository of a real model of that family
holds (config.json with its model_type, safetensors weights, the tokenizer
files of the family's tokenizer class and, for embedders, the
sentence-transformers modules: modules.json, 1_Pooling/, Dense/ folders,
Normalize) at 32 hidden units and 2 layers. The tokenizers are trained here,
offline, on a few sentences with the family's algorithm (WordPiece for BERT
likes, a sentencepiece Unigram for XLM-R and DeBERTa-v3, byte-level BPE for
ModernBERT and the Qwen/Llama/Phi decoders, a byte-fallback BPE for Gemma)
and saved through the family's own tokenizer class.

`initializer_range` is large (0.3): scores spread out and greedy choices are
far from ties, so a wrong answer cannot hide inside rounding.

`PARITY` is the table `tests/test_catalog.py` checks every catalog entry
against: (task, runtime, model_type) -> the test that serves a tiny instance
over HTTP and compares it with its reference library in-process.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is fleet serving small models from one box",
    "how do cats behave at home? cats sleep for most of the day",
    "Angela Merkel met Emmanuel Macron in Berlin on Tuesday .",
    "Acme Corp hired John Smith from Paris .",
    "José Núñez moved from São Paulo to Zürich .",
    "¿Los gatos duermen mucho? Das Essen war ausgezeichnet.",
    "The stock market closed higher on Friday. Quarterly revenue grew 12% year over year.",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9 . , ! ? : ; ' \" ( ) -",
]
HIDDEN = 32
LAYERS = 2
HEADS = 2
INTERMEDIATE = 64
POSITIONS = 128
INIT = 0.3
#: ChatML, as the Qwen family's templates render a conversation.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA_CHAT = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
LLAMA3_CHAT = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


# ---- tokenizers, trained offline with each family's algorithm --------------------------

def _trained(model, trainer, *, normalizer=None, pre_tokenizer=None) -> dict:
    """The `model` section of a tokenizer trained on CORPUS (vocabulary, merges)."""
    from tokenizers import Tokenizer

    tok = Tokenizer(model)
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    tok.train_from_iterator(CORPUS * 4, trainer)
    return json.loads(tok.to_str())["model"]


def wordpiece_vocab(specials: list[str], lowercase: bool = True) -> dict[str, int]:
    from tokenizers import models, normalizers, pre_tokenizers, trainers

    model = _trained(models.WordPiece(unk_token="[UNK]"),
                     trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials),
                     normalizer=normalizers.BertNormalizer(lowercase=lowercase),
                     pre_tokenizer=pre_tokenizers.BertPreTokenizer())
    return model["vocab"]


def unigram_vocab(specials: list[str], unk: str) -> list[tuple[str, float]]:
    from tokenizers import models, normalizers, pre_tokenizers, trainers

    model = _trained(models.Unigram(), trainers.UnigramTrainer(vocab_size=300, special_tokens=specials, unk_token=unk),
                     normalizer=normalizers.NFKC(), pre_tokenizer=pre_tokenizers.Metaspace())
    return [(piece, score) for piece, score in model["vocab"]]


def byte_bpe(specials: list[str]) -> tuple[dict[str, int], list[str]]:
    from tokenizers import models, pre_tokenizers, trainers

    model = _trained(models.BPE(), trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
                     pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=False))
    return model["vocab"], [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]


def metaspace_bpe(specials: list[str]) -> tuple[dict[str, int], list[str]]:
    """Gemma's vocabulary: '▁' for spaces, byte-fallback pieces <0x00>..<0xFF>."""
    from tokenizers import models, normalizers, trainers

    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    model = _trained(models.BPE(byte_fallback=True),
                     trainers.BpeTrainer(vocab_size=700, special_tokens=specials + bytes_),
                     normalizer=normalizers.Replace(" ", "▁"))
    return model["vocab"], [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]


def bert_tokenizer(cls_name: str = "BertTokenizer"):
    import transformers

    vocab = wordpiece_vocab(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    return getattr(transformers, cls_name)(vocab=vocab, model_max_length=POSITIONS)


def mpnet_tokenizer():
    import transformers

    vocab = wordpiece_vocab(["<s>", "<pad>", "</s>", "[UNK]", "<mask>"])
    return transformers.MPNetTokenizer(vocab=vocab, model_max_length=POSITIONS)


def xlmr_tokenizer():
    import transformers

    vocab = unigram_vocab(["<s>", "<pad>", "</s>", "<unk>", "<mask>"], "<unk>")
    return transformers.XLMRobertaTokenizer(vocab=vocab, model_max_length=POSITIONS)


def deberta_v3_tokenizer():
    import transformers

    vocab = unigram_vocab(["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"], "[UNK]")
    return transformers.DebertaV2Tokenizer(vocab=vocab, model_max_length=POSITIONS)


def roberta_tokenizer():
    import transformers

    vocab, merges = byte_bpe(["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    return transformers.RobertaTokenizer(vocab=vocab, merges=merges, model_max_length=POSITIONS)


def modernbert_tokenizer():
    """ModernBERT ships a PreTrainedTokenizerFast: byte-level BPE, [CLS] x [SEP] (y [SEP])."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    vocab, merges = byte_bpe(specials)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    cls, sep = vocab["[CLS]"], vocab["[SEP]"]
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                   pad_token="[PAD]", mask_token="[MASK]", model_max_length=POSITIONS)


def qwen_tokenizer(padding_side: str = "right"):
    import transformers

    vocab, merges = byte_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                      model_max_length=POSITIONS * 2, padding_side=padding_side)
    tok.chat_template = CHATML
    return tok


def gemma_tokenizer():
    import transformers

    vocab, merges = metaspace_bpe(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"])
    tok = transformers.GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=POSITIONS * 2)
    tok.chat_template = GEMMA_CHAT
    return tok


def llama3_tokenizer():
    """Llama 3 / SmolLM3 / Phi-4: a PreTrainedTokenizerFast over a byte-level BPE, BOS prepended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|finetune_right_pad_id|>"]
    vocab, merges = byte_bpe(specials)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|>:0 $A:0", pair="<|begin_of_text|>:0 $A:0 <|begin_of_text|>:1 $B:1",
        special_tokens=[("<|begin_of_text|>", vocab["<|begin_of_text|>"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                   pad_token="<|finetune_right_pad_id|>", model_max_length=POSITIONS * 2)
    fast.chat_template = LLAMA3_CHAT
    return fast


def llama2_tokenizer():
    """SmolLM2: GPT2Tokenizer (byte-level BPE) with <|im_start|> chat turns."""
    import transformers

    vocab, merges = byte_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok = transformers.GPT2Tokenizer(vocab=vocab, merges=merges, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                     unk_token="<|endoftext|>", pad_token="<|im_end|>", model_max_length=POSITIONS * 2)
    tok.chat_template = CHATML
    return tok


# ---- models -------------------------------------------------------------------------------

def _encoder_kw(tok) -> dict:
    return dict(vocab_size=len(tok), hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                intermediate_size=INTERMEDIATE, initializer_range=INIT, pad_token_id=tok.pad_token_id)


def _labels(names: list[str]) -> dict:
    return dict(num_labels=len(names), id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)})


def _save(model, tok, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def encoder(model_type: str, head: str, folder: Path, *, labels: list[str] | None = None, **extra) -> Path:
    """A tiny encoder of `model_type` with `head` ("" = the bare model, "seq" = sequence
    classification, "token" = token classification)."""
    import torch
    import transformers

    spec = ENCODERS[model_type]
    tok = spec["tokenizer"]()
    cfg_kw = {**_encoder_kw(tok), **spec.get("config", {}), **extra}
    if labels:
        cfg_kw.update(_labels(labels))
    if model_type == "modernbert":  # its config names the special tokens (defaults are the real vocabulary's)
        cfg_kw.update(cls_token_id=tok.cls_token_id, sep_token_id=tok.sep_token_id, bos_token_id=tok.cls_token_id,
                      eos_token_id=tok.sep_token_id)
    config = getattr(transformers, spec["config_class"])(**cfg_kw)
    cls = spec["prefix"] + {"": "Model", "seq": "ForSequenceClassification", "token": "ForTokenClassification"}[head]
    torch.manual_seed(0)
    return _save(getattr(transformers, cls)(config), tok, folder)


ENCODERS: dict[str, dict] = {
    "bert": {"tokenizer": bert_tokenizer, "config_class": "BertConfig", "prefix": "Bert",
             "config": {"max_position_embeddings": POSITIONS}},
    "distilbert": {"tokenizer": lambda: bert_tokenizer("DistilBertTokenizer"), "config_class": "DistilBertConfig",
                   "prefix": "DistilBert", "config": {"max_position_embeddings": POSITIONS, "hidden_dim": INTERMEDIATE}},
    "mpnet": {"tokenizer": mpnet_tokenizer, "config_class": "MPNetConfig", "prefix": "MPNet",
              "config": {"max_position_embeddings": POSITIONS + 2}},
    "roberta": {"tokenizer": roberta_tokenizer, "config_class": "RobertaConfig", "prefix": "Roberta",
                "config": {"max_position_embeddings": POSITIONS + 2}},
    "xlm-roberta": {"tokenizer": xlmr_tokenizer, "config_class": "XLMRobertaConfig", "prefix": "XLMRoberta",
                    "config": {"max_position_embeddings": POSITIONS + 2}},
    "deberta-v2": {"tokenizer": deberta_v3_tokenizer, "config_class": "DebertaV2Config", "prefix": "DebertaV2",
                   # DeBERTa-v3's relative attention: shared key, position buckets, c2p + p2c.
                   "config": {"max_position_embeddings": POSITIONS, "relative_attention": True,
                              "position_buckets": 16, "norm_rel_ebd": "layer_norm", "share_att_key": True,
                              "pos_att_type": ["p2c", "c2p"], "position_biased_input": False,
                              "max_relative_positions": -1, "type_vocab_size": 0}},
    "modernbert": {"tokenizer": modernbert_tokenizer, "config_class": "ModernBertConfig", "prefix": "ModernBert",
                   # Global attention every 2nd layer, local (sliding 16) between: both kinds run.
                   "config": {"max_position_embeddings": POSITIONS, "global_attn_every_n_layers": 2,
                              "local_attention": 16}},
}


def sentence_transformer(model_type: str, pooling: str, folder: Path, *, dense: tuple[int, ...] = (),
                         backbone: Callable[[Path], Path] | None = None, normalize: bool = True) -> Path:
    """An embedder as sentence-transformers saves it: the backbone in the root,
    modules.json, 1_Pooling (`pooling`: mean | cls | lasttoken), optional Dense
    layers (2_Dense, 3_Dense, ...) and a final Normalize (unless `normalize` is False)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    raw = (backbone or (lambda f: encoder(model_type, "", f)))(folder.with_name(folder.name + "-backbone"))
    body = models.Transformer(str(raw))
    modules = [body, models.Pooling(HIDDEN, pooling_mode=pooling)]
    width = HIDDEN
    import torch

    torch.manual_seed(1)
    for out in dense:
        modules.append(models.Dense(width, out, bias=False, activation_function=torch.nn.Identity()))
        width = out
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


def qwen3_backbone(folder: Path) -> Path:
    """Qwen3-Embedding's backbone: a Qwen3 decoder, left padding (its README's tokenizer)."""
    import torch
    from transformers import Qwen3Config, Qwen3Model

    tok = qwen_tokenizer(padding_side="left")
    torch.manual_seed(0)
    cfg = Qwen3Config(**_decoder_kw(tok))
    return _save(Qwen3Model(cfg), tok, folder)


def gemma3_bidirectional_backbone(folder: Path) -> Path:
    """EmbeddingGemma's backbone: Gemma 3 text with bidirectional attention."""
    import torch
    from transformers import Gemma3TextConfig, Gemma3TextModel

    tok = gemma_tokenizer()
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(**_decoder_kw(tok), head_dim=16, sliding_window=8, use_bidirectional_attention=True)
    return _save(Gemma3TextModel(cfg), tok, folder)


def _decoder_kw(tok) -> dict:
    return dict(vocab_size=len(tok), hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=INTERMEDIATE, max_position_embeddings=POSITIONS * 2,
                initializer_range=INIT, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id)


def causal_lm(model_type: str, folder: Path) -> Path:
    """A tiny causal LM of `model_type` with its family's tokenizer and chat template."""
    import torch
    import transformers

    spec = DECODERS[model_type]
    tok = spec["tokenizer"]()
    config = getattr(transformers, spec["config_class"])(**{**_decoder_kw(tok), **spec.get("config", {})})
    torch.manual_seed(0)
    return _save(getattr(transformers, spec["model_class"])(config), tok, folder)


DECODERS: dict[str, dict] = {
    "qwen3": {"tokenizer": qwen_tokenizer, "config_class": "Qwen3Config", "model_class": "Qwen3ForCausalLM",
              "config": {"head_dim": 16, "tie_word_embeddings": True}},
    "qwen2": {"tokenizer": qwen_tokenizer, "config_class": "Qwen2Config", "model_class": "Qwen2ForCausalLM",
              "config": {"tie_word_embeddings": True}},
    # Sliding-window layers (window 8) alternate with global ones: prompts run past the window.
    "gemma3_text": {"tokenizer": gemma_tokenizer, "config_class": "Gemma3TextConfig",
                    "model_class": "Gemma3ForCausalLM",
                    "config": {"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention",
                                                                                  "full_attention"]}},
    "llama": {"tokenizer": llama3_tokenizer, "config_class": "LlamaConfig", "model_class": "LlamaForCausalLM",
              "config": {"tie_word_embeddings": True,
                         "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 64}}},
    # SmolLM3: no rotary embedding (NoPE) in every 4th layer; 4 layers so one has none.
    # SmolLM2: a Llama with a GPT2Tokenizer and <|im_start|> turns.
    "llama-smollm2": {"tokenizer": llama2_tokenizer, "config_class": "LlamaConfig", "model_class": "LlamaForCausalLM",
                      "config": {"tie_word_embeddings": True}},
    "smollm3": {"tokenizer": llama3_tokenizer, "config_class": "SmolLM3Config", "model_class": "SmolLM3ForCausalLM",
                "config": {"num_hidden_layers": 4, "no_rope_layer_interval": 4}},
    "phi3": {"tokenizer": llama3_tokenizer, "config_class": "Phi3Config", "model_class": "Phi3ForCausalLM",
             "config": {"tie_word_embeddings": True}},
}


# ---- the cases the parity tests serve ------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One tiny model: what the catalog would say of it (task, runtime, model_type) and its builder."""

    task: str
    runtime: str
    model_type: str
    build: Callable[[Path], Path]


LABELS = ["negative", "neutral", "positive"]
NER = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC"]
EMOTIONS = ["joy", "anger", "fear", "surprise"]

#: Store name -> case; `tests/test_parity_encoders.py` serves them all from one daemon.
ENCODER_CASES: dict[str, Case] = {
    # embed: one per (model_type, pooling, modules) the catalog's embedders use.
    "st-bert-cls": Case("embed", "sentence-transformers", "bert",
                        lambda f: sentence_transformer("bert", "cls", f)),
    "st-bert-mean": Case("embed", "sentence-transformers", "bert",
                         lambda f: sentence_transformer("bert", "mean", f)),
    # No Normalize module (the pooled vector is the model's output: `normalize: false` returns it).
    "st-bert-mean-unnormalized": Case("embed", "sentence-transformers", "bert",
                                      lambda f: sentence_transformer("bert", "mean", f, normalize=False)),
    "st-mpnet-mean": Case("embed", "sentence-transformers", "mpnet",
                          lambda f: sentence_transformer("mpnet", "mean", f)),
    "st-xlm-roberta-mean": Case("embed", "sentence-transformers", "xlm-roberta",
                                lambda f: sentence_transformer("xlm-roberta", "mean", f)),
    "st-xlm-roberta-cls": Case("embed", "sentence-transformers", "xlm-roberta",
                               lambda f: sentence_transformer("xlm-roberta", "cls", f)),
    "st-modernbert-cls": Case("embed", "sentence-transformers", "modernbert",
                              lambda f: sentence_transformer("modernbert", "cls", f)),
    "st-qwen3-lasttoken": Case("embed", "sentence-transformers", "qwen3",
                               lambda f: sentence_transformer("qwen3", "lasttoken", f, backbone=qwen3_backbone)),
    "st-gemma3-mean-dense": Case("embed", "sentence-transformers", "gemma3_text",
                                 lambda f: sentence_transformer("gemma3_text", "mean", f, dense=(64, HIDDEN),
                                                                backbone=gemma3_bidirectional_backbone)),
    # rerank: cross-encoders (one relevance logit).
    "ce-bert": Case("rerank", "transformers", "bert", lambda f: encoder("bert", "seq", f, num_labels=1)),
    "ce-xlm-roberta": Case("rerank", "transformers", "xlm-roberta",
                           lambda f: encoder("xlm-roberta", "seq", f, num_labels=1)),
    "ce-modernbert": Case("rerank", "transformers", "modernbert",
                          lambda f: encoder("modernbert", "seq", f, num_labels=1)),
    # classify: single-label softmax, and RoBERTa multi-label (go_emotions' layout).
    "cls-distilbert": Case("classify", "transformers", "distilbert",
                           lambda f: encoder("distilbert", "seq", f, labels=LABELS)),
    "cls-roberta-multilabel": Case("classify", "transformers", "roberta",
                                   lambda f: encoder("roberta", "seq", f, labels=EMOTIONS,
                                                     problem_type="multi_label_classification")),
    "cls-deberta-v3": Case("classify", "transformers", "deberta-v2",
                           lambda f: encoder("deberta-v2", "seq", f, labels=["SAFE", "INJECTION"])),
    "cls-modernbert": Case("classify", "transformers", "modernbert",
                           lambda f: encoder("modernbert", "seq", f, labels=LABELS)),
    # extract: BIO taggers.
    "ner-bert": Case("extract", "transformers", "bert", lambda f: encoder("bert", "token", f, labels=NER)),
    "ner-xlm-roberta": Case("extract", "transformers", "xlm-roberta",
                            lambda f: encoder("xlm-roberta", "token", f, labels=NER)),
    "ner-distilbert": Case("extract", "transformers", "distilbert",
                           lambda f: encoder("distilbert", "token", f, labels=NER)),
}


def build_cases(cases: dict[str, Case], root: Path) -> dict[str, Path]:
    return {name: case.build(root / name) for name, case in cases.items()}


#: Store name -> case; `tests/test_parity_generators.py` serves them all from one daemon.
GENERATOR_CASES: dict[str, Case] = {
    "gen-qwen3": Case("generate", "transformers", "qwen3", lambda f: causal_lm("qwen3", f)),
    "gen-qwen2": Case("generate", "transformers", "qwen2", lambda f: causal_lm("qwen2", f)),
    "gen-gemma3-text": Case("generate", "transformers", "gemma3_text", lambda f: causal_lm("gemma3_text", f)),
    "gen-llama3": Case("generate", "transformers", "llama", lambda f: causal_lm("llama", f)),
    "gen-smollm2": Case("generate", "transformers", "llama", lambda f: causal_lm("llama-smollm2", f)),
    "gen-smollm3": Case("generate", "transformers", "smollm3", lambda f: causal_lm("smollm3", f)),
    "gen-phi3": Case("generate", "transformers", "phi3", lambda f: causal_lm("phi3", f)),
}

#: Store name -> case: the catalog's decision models (causal LMs pulled as task `decide`);
#: `tests/test_parity_generators.py` serves them beside the generators.
DECIDE_CASES: dict[str, Case] = {
    "dec-qwen3": Case("decide", "transformers", "qwen3", lambda f: causal_lm("qwen3", f)),
    "dec-qwen2": Case("decide", "transformers", "qwen2", lambda f: causal_lm("qwen2", f)),
    "dec-smollm2": Case("decide", "transformers", "llama", lambda f: causal_lm("llama-smollm2", f)),
}


# ---- the table every catalog entry is checked against (tests/test_catalog.py) ---------------

_TESTS = {
    "embed": "tests/test_parity_encoders.py::test_embedder_matches_sentence_transformers",
    "rerank": "tests/test_parity_encoders.py::test_cross_encoder_matches_sentence_transformers",
    "classify": "tests/test_parity_encoders.py::test_classifier_matches_transformers",
    "extract": "tests/test_parity_encoders.py::test_tagger_matches_the_pipeline",
    "generate": "tests/test_parity_generators.py::test_greedy_generation_matches_transformers",
    "decide": "tests/test_parity_generators.py::test_decisions_match_a_plain_forward",
}


def _parity() -> dict[tuple[str, str, str], list[str]]:
    table: dict[tuple[str, str, str], list[str]] = {}
    for name, case in {**ENCODER_CASES, **GENERATOR_CASES, **DECIDE_CASES}.items():
        table.setdefault((case.task, case.runtime, case.model_type), []).append(f"{_TESTS[case.task]}[{name}]")
    return table


#: (task, runtime, model_type) -> the tests that serve a tiny instance of it over HTTP
#: and compare it with its reference library. Families with a runtime of their own
#: are proven in their own files and named here.
PARITY: dict[tuple[str, str, str], list[str]] = {
    **_parity(),
    ("embed", "bge-m3", "xlm-roberta"): [
        "tests/test_bge_m3.py::test_dense_is_flagembeddings_cls_vector",
        "tests/test_bge_m3.py::test_sparse_is_flagembeddings_lexical_weights",
        "tests/test_bge_m3.py::test_tokens_are_flagembeddings_colbert_vectors",
    ],
    ("embed", "clip", "siglip"): [
        "tests/test_siglip.py::test_texts_and_images_equal_transformers[siglip]",
        "tests/test_siglip.py::test_texts_and_images_equal_transformers[siglip2-fixres]",
    ],
    ("embed", "clip", "siglip2"): ["tests/test_siglip.py::test_texts_and_images_equal_transformers[siglip2-naflex]"],
    ("rerank", "llm-rerank", "qwen3"): [
        "tests/test_llm_rerank.py::test_qwen3_scores_equal_the_readme",
        "tests/test_llm_rerank.py::test_qwen3_scores_equal_sentence_transformers_logit_score",
    ],
    ("rerank", "llm-rerank", "qwen2"): [
        "tests/test_llm_rerank.py::test_mxbai_scores_equal_the_library",
        "tests/test_llm_rerank.py::test_mxbai_over_http_takes_its_catalog_entrys_format_and_instruction",
    ],
    # GLiNER entries name their backbone's model_type (gliner_config.json's encoder).
    ("extract", "gliner", "deberta-v2"): ["tests/test_gliner.py::test_answers_equal_the_gliner_package[gliner-deberta]"],
}
