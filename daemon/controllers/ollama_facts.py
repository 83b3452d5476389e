"""What `/api/tags`, `/api/show` and `/api/ps` say about a stored model.

Read from the store's files without loading anything: `config.json` (family,
context, widths), `tokenizer_config.json` (chat template) and the safetensors
headers (parameter count and dtype: 8 bytes of length, then JSON, per file); a
GGUF model's from its manifest (its header's facts, read at pull).
A stored model's files change only with its manifest's `created_at`, so the
facts are cached under (name, created_at); a re-pull reads them again.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.gguf import GgufFacts
from fleet.store import MANIFEST, Manifest, Store
from fleet.tools import capabilities as fleet_capabilities

from fleet.daemon.controllers.ollama_wire import Details

#: fleet task -> Ollama capabilities (what Ollama-speaking apps filter models by).
CAPABILITIES = {"generate": ["completion"], "embed": ["embedding"]}
#: A safetensors header longer than this is not read (a sane header is a few hundred KiB at most).
MAX_HEADER_BYTES = 64 << 20


@dataclass(frozen=True)
class Facts:
    digest: str
    family: str
    parameters: int
    quantization: str
    context_length: int | None
    info: dict[str, Any] = field(default_factory=dict)
    template: str = ""


_cache: dict[tuple[str, str], Facts] = {}


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def chat_template(folder: Path) -> str:
    """The model's chat template: `chat_template.jinja` (transformers >= 4.43 saves it
    there), else the `chat_template` key of tokenizer_config.json; "" when it has none."""
    try:
        return (folder / "chat_template.jinja").read_text()
    except (OSError, UnicodeDecodeError):
        pass
    template = read_json(folder / "tokenizer_config.json").get("chat_template")
    return template if isinstance(template, str) else ""


def safetensors_header(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > MAX_HEADER_BYTES:
                return {}
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error):
        return {}
    return header if isinstance(header, dict) else {}


def count_parameters(folder: Path, manifest: Manifest) -> tuple[int, str]:
    """(parameters, the dtype most of them are stored in) from the safetensors headers."""
    by_dtype: dict[str, int] = {}
    for f in manifest.files:
        if not f.path.endswith(".safetensors"):
            continue
        for key, t in safetensors_header(folder / f.path).items():
            if key == "__metadata__" or not isinstance(t, dict):
                continue
            n = 1
            for d in t.get("shape", ()):
                n *= int(d)
            by_dtype[str(t.get("dtype", "?"))] = by_dtype.get(str(t.get("dtype", "?")), 0) + n
    if not by_dtype:
        return 0, ""
    return sum(by_dtype.values()), max(by_dtype, key=by_dtype.__getitem__)


def parameter_size(n: int) -> str:
    """Ollama's spelling: 22.7M, 1.1B."""
    if n <= 0:
        return ""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def facts(store: Store, manifest: Manifest) -> Facts:
    key = (manifest.name, manifest.created_at)
    hit = _cache.get(key)
    if hit is not None:
        return hit
    folder = store.path(manifest.name)
    try:
        digest = hashlib.sha256((folder / MANIFEST).read_bytes()).hexdigest()
    except OSError:
        digest = ""
    if manifest.gguf is not None:
        found = gguf_facts(manifest, manifest.gguf, digest)
        _cache[key] = found
        return found
    config = read_json(folder / "config.json")
    arch = str(config.get("model_type") or manifest.runtime)
    parameters, dtype = count_parameters(folder, manifest)
    context = manifest.max_seq_len or config.get("max_position_embeddings")
    info: dict[str, Any] = {"general.architecture": arch, "general.basename": manifest.name,
                            "general.parameter_count": parameters}
    for ours, theirs in (("context_length", context), ("embedding_length", config.get("hidden_size")),
                         ("block_count", config.get("num_hidden_layers")),
                         ("attention.head_count", config.get("num_attention_heads")),
                         ("vocab_size", config.get("vocab_size"))):
        if isinstance(theirs, int):
            info[f"{arch}.{ours}"] = theirs
    template = chat_template(folder)
    found = Facts(digest=digest, family=arch, parameters=parameters, quantization=dtype,
                  context_length=context if isinstance(context, int) else None, info=info,
                  template=template)
    _cache[key] = found
    return found


def gguf_facts(manifest: Manifest, g: GgufFacts, digest: str) -> Facts:
    """A GGUF model's facts: its header's, read at pull (`Manifest.gguf`)."""
    context = manifest.max_seq_len or g.context_length
    info: dict[str, Any] = {"general.architecture": g.architecture, "general.basename": manifest.name,
                            "general.parameter_count": g.parameters, "general.file_type": g.file_type}
    if context:
        info[f"{g.architecture}.context_length"] = context
    return Facts(digest=digest, family=g.architecture, parameters=g.parameters, quantization=g.file_type,
                 context_length=context, info=info, template=g.chat_template)


def details(manifest: Manifest, f: Facts) -> Details:
    return Details(parent_model=f"{manifest.base}:latest" if manifest.base else "",
                   format="gguf" if manifest.gguf is not None else "safetensors",
                   family=f.family, families=[f.family], parameter_size=parameter_size(f.parameters),
                   quantization_level=f.quantization)


def capabilities(manifest: Manifest, f: Facts) -> list[str]:
    """Ollama's words for what a model can do: a generator whose chat template can
    express tools also has "tools", an image embedder "vision"."""
    own = fleet_capabilities(manifest.task, manifest.runtime, f.template)
    return [*CAPABILITIES.get(manifest.task, ()), *(c for c in ("tools", "vision") if c in own)]
