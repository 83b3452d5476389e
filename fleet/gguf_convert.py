"""A safetensors generator to one GGUF file, for `fleetctl pull ... --quantize TYPE`.

The layouts are llama.cpp's own converter's (its convert_hf_to_gguf.py) for the two
architectures fleet converts, Llama and Qwen2: the `gguf` package's tensor-name map
renames each tensor; Llama's q/k projections are permuted from Hugging Face's rotary
layout (halves) to llama.cpp's (interleaved pairs); Qwen2 keeps its q/k/v biases as they
are. Matrices are written as F16 and vectors (norms, biases) as F32, then
`llama_model_quantize` of the installed llama.cpp build makes the TYPE asked for
(F16 is kept as written). The vocabulary is a byte-level BPE ("gpt2" in GGUF) with its
merges, special ids and chat template; its pre-tokenizer is named by its split rule.

Runs numpy over the safetensors (no torch: the daemon's process pulls); the `gguf`
package and llama.cpp are imported only here, when a conversion is asked for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fleet.errors import BadRequest, Unavailable

#: --quantize values: the llama.cpp file type each one asks for (llama_ftype).
QUANT_TYPES = {"f16": 1, "q8_0": 7, "q4_k_m": 15}
#: config.json `model_type` -> GGUF architecture.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
#: A byte-level BPE's split rule -> the pre-tokenizer llama.cpp knows it by.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}
#: GGUF token types (llama.cpp's llama_token_type).
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


def check_quant_type(quantize: str) -> int:
    if quantize not in QUANT_TYPES:
        raise BadRequest(f"--quantize {quantize!r}: expected one of {', '.join(QUANT_TYPES)}")
    return QUANT_TYPES[quantize]


def convert(folder: Path, out_dir: Path, quantize: str, *, origin: str) -> Path:
    """`folder` (a Llama or Qwen2 causal LM in safetensors, with tokenizer.json) as
    `out_dir/<folder name>.<TYPE>.gguf`. Refuses, naming what is wrong, a folder it
    cannot convert: another architecture, no safetensors, a tokenizer that is not a
    byte-level BPE."""
    ftype = check_quant_type(quantize)
    config = _read_json(folder / "config.json", origin)
    arch = ARCHITECTURES.get(config.get("model_type", ""))
    if arch is None:
        raise BadRequest(f"{origin}: --quantize converts {', '.join(ARCHITECTURES)} generators, "
                         f"not model_type {config.get('model_type')!r}",
                         hint="pull a GGUF file of it instead (path:FILE.gguf)")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise BadRequest(f"{origin}: --quantize converts safetensors weights; the folder has none")
    try:
        import gguf
    except ImportError:
        raise Unavailable("--quantize needs the gguf package", hint="pip install 'fleet-serve[llamacpp]'") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    f16 = out_dir / f"{folder.name}.F16.gguf"
    writer = gguf.GGUFWriter(str(f16), arch)
    _write_params(writer, config, arch)
    _write_vocab(writer, gguf, folder, config, origin)
    _write_tensors(writer, gguf, weights, config, arch, origin)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if quantize == "f16":
        return f16
    out = out_dir / f"{folder.name}.{quantize.upper()}.gguf"
    _quantize(f16, out, ftype)
    f16.unlink()
    return out


def _read_json(path: Path, origin: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadRequest(f"{origin}: --quantize needs {path.name}, which the folder lacks") from None
    except ValueError as exc:
        raise BadRequest(f"{origin}: {path.name} is not JSON ({exc})") from None


def _rope_theta(config: dict[str, Any], default: float) -> float:
    # transformers 5 keeps it in rope_parameters; 4.x at the top.
    return float((config.get("rope_parameters") or {}).get("rope_theta") or config.get("rope_theta") or default)


def _write_params(writer: Any, config: dict[str, Any], arch: str) -> None:
    heads = config["num_attention_heads"]
    writer.add_name(config.get("_name_or_path") or arch)
    writer.add_context_length(config.get("max_position_embeddings", 4096))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads", heads))
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    writer.add_rope_freq_base(_rope_theta(config, 10000.0 if arch == "llama" else 1000000.0))
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(QUANT_TYPES["f16"])


def _pre_tokenizer(tok: dict[str, Any], origin: str) -> str:
    pre = tok.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    splits = [p for p in pre.get("pretokenizers", []) if p.get("type") == "Split"]
    if pre.get("type") == "Sequence" and len(splits) == 1:
        name = PRE_TOKENIZERS.get(splits[0].get("pattern", {}).get("Regex", ""))
        if name:
            return name
    raise BadRequest(f"{origin}: --quantize converts byte-level BPE tokenizers that split as GPT-2, Llama 3 or "
                     "Qwen2 do; this one's pre-tokenizer is another", hint="pull a GGUF file of it instead")


def _write_vocab(writer: Any, gguf: Any, folder: Path, config: dict[str, Any], origin: str) -> None:
    """The vocabulary as llama.cpp's converter writes a byte-level BPE: every id up to
    vocab_size (gaps as unused pads), added tokens as control (special) or user-defined."""
    tok = _read_json(folder / "tokenizer.json", origin)
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise BadRequest(f"{origin}: --quantize converts byte-level BPE tokenizers, not {model.get('type')!r}"
                         + (" with byte fallback" if model.get("byte_fallback") else ""))
    by_id = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    size = max(config["vocab_size"], max([*by_id, *added]) + 1)
    tokens, types = [], []
    for i in range(size):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(CONTROL if added[i].get("special") else USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(tok, origin))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=size)
    special.add_to_gguf(writer)
    if "bos" not in special.add_special_token:
        # The tokenizer's own rule: a BOS only where its post-processor adds one.
        single = (tok.get("post_processor") or {}).get("single") or []
        writer.add_add_bos_token(any("SpecialToken" in part for part in single[:1]))
    template = folder / "chat_template.jinja"
    if special.chat_template is None and template.is_file():
        writer.add_chat_template(template.read_text(encoding="utf-8"))


def _permute(w: Any, heads: int) -> Any:
    """Hugging Face's rotary halves to llama.cpp's interleaved pairs (Llama q/k only)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tensors(writer: Any, gguf: Any, files: list[Path], config: dict[str, Any], arch: str,
                   origin: str) -> None:
    import numpy as np
    from safetensors import safe_open

    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), config["num_hidden_layers"])
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    for path in files:
        with safe_open(str(path), framework="numpy") as f:
            for key in f.keys():
                if key.endswith("rotary_emb.inv_freq"):
                    continue  # recomputed from the rope parameters
                new = names.get_name(key, try_suffixes=(".weight", ".bias"))
                if new is None:
                    raise BadRequest(f"{origin}: tensor {key} has no place in a GGUF {arch} model")
                w = f.get_tensor(key).astype(np.float32)
                if arch == "llama" and key.endswith("q_proj.weight"):
                    w = _permute(w, heads)
                elif arch == "llama" and key.endswith("k_proj.weight"):
                    w = _permute(w, kv_heads)
                writer.add_tensor(new, w.astype(np.float16) if w.ndim == 2 else w)


#: Exit code of the quantize child when llama.cpp is not importable.
_NO_LLAMA_CPP = 3


def _quantize(src: Path, out: Path, ftype: int) -> None:
    """llama.cpp's `llama_model_quantize` in a child process: the native library (and its
    threads, and a crash of it) stays out of the pulling process, which may be the daemon's."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "fleet.gguf_convert", str(src), str(out), str(ftype)],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode == _NO_LLAMA_CPP:
        raise Unavailable("--quantize needs llama.cpp (the fleet-serve[llamacpp] extra)",
                          hint="./scripts/setup_llamacpp.sh, or pull with --quantize f16")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise BadRequest(f"llama.cpp could not quantize the converted model: {last}")


def main() -> None:
    """`python -m fleet.gguf_convert SRC OUT FTYPE`: the quantize child (`_quantize`)."""
    import sys

    src, out, ftype = sys.argv[1], sys.argv[2], int(sys.argv[3])
    try:
        import llama_cpp
    except ImportError:
        sys.exit(_NO_LLAMA_CPP)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    rc = llama_cpp.llama_model_quantize(src.encode(), out.encode(), llama_cpp.byref(params))
    if rc != 0:
        sys.exit(f"llama_model_quantize returned {rc}")


if __name__ == "__main__":
    main()
