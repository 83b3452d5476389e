"""The tokenizer the llama.cpp runtime builds from a GGUF's vocabulary holds exactly the
file's tokens (runtimes.adapters.llamacpp.gguf_tokenizer), so llguidance accepts it for
the model's logits: structured output, tools and logprobs on such a model.

transformers' GPT-2-style builder adds `<|endoftext|>` where a vocabulary lacks it (Llama
3's GGUFs do; so does a tiny Llama fleet converts here), which made the tokenizer one
token wider than the model and every JSON, schema, tool or logprobs request a 400. Runs
without llama.cpp: the F16 conversion is fleet's own, and llguidance reads the tokenizer."""

from __future__ import annotations

from pathlib import Path

from fleet.gguf import read_metadata
from fleet.gguf_convert import convert
from fleet.runtimes.adapters.grammar import Grammars
from fleet.runtimes.adapters.llamacpp import TOKENIZER_ARRAYS, gguf_tokenizer
from tests.gen_models import build_llama


def test_a_vocabulary_without_endoftext_gives_a_tokenizer_of_the_models_width(tmp_path: Path) -> None:
    gguf = convert(build_llama(tmp_path / "llama"), tmp_path / "out", "f16", origin="test")
    _, meta, _, _ = read_metadata(gguf, "llama", TOKENIZER_ARRAYS)
    tokens = meta["tokenizer.ggml.tokens"]
    assert "<|endoftext|>" not in tokens  # the case: a GPT-2-style vocabulary without it
    tok = gguf_tokenizer(meta, "llama")
    assert len(tok) == len(tokens) and "<|endoftext|>" not in tok.get_vocab()
    # Every id still spells what the file says, specials included.
    assert tok.convert_ids_to_tokens(list(range(len(tokens)))) == tokens
    assert tok.decode(tok("the quick brown fox")["input_ids"], skip_special_tokens=True) == "the quick brown fox"
    # llguidance takes it for the model's logits (refused "vocab size too small" before).
    grammars = Grammars(tok, len(tokens), [meta["tokenizer.ggml.eos_token_id"]])
    assert grammars.vocab_size == len(tokens)
