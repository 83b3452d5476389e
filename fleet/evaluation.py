"""Evaluation files and the metrics a promotion compares versions by (pure functions).

An evaluation file is JSONL, one example a line, in the shape of its task:

| task | a line | metrics |
| --- | --- | --- |
| classify | `{"text", "label"}` | accuracy, macro_f1, ece (↓) |
| embed, rerank | `{"query", "positive"}`: every line's positive is a document of one corpus, the others' its negatives; or `{"query", "documents": [...], "relevant": [i, ...]}` | ndcg@10, mrr |
| extract | `{"text", "entities": [{"start", "end", "label"}], "labels"?: [...]}` | span_f1 (exact start, end and label; micro) |
| generate | `{"prompt" or "messages", "expected"}` and/or `{..., "schema": {JSON Schema}}`, `"max_tokens"?: n` | exact_match, schema_valid |

`ece` is the expected calibration error of the top label's probability (10 equal-width
bins), lower is better; every other metric is better higher. `compare` lists the metrics
on which a candidate is worse than the current version by more than a margin.

A generate line's answer is bounded by its own `max_tokens`, else the promotion's default,
and by each version's context less the prompt (daemon.promotions): a model with a short
context is evaluated on what fits it, not refused on every line.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from fleet.calibration import ECE_BINS, ece
from fleet.errors import BadRequest

#: Lines an evaluation file may hold (the daemon runs every one through both versions).
MAX_LINES = 10_000
#: Documents of a pairs corpus (`{"query", "positive"}` lines): a reranker scores every
#: query against every document, so the pairs form is bounded (more: send `documents`).
MAX_PAIR_DOCUMENTS = 512
#: The most a generate line's `max_tokens` may ask (the generate route's own ceiling).
MAX_LINE_TOKENS = 1 << 20
#: Metrics where lower is better; all others are better higher.
LOWER_IS_BETTER = frozenset({"ece"})
METRICS: dict[str, tuple[str, ...]] = {
    "classify": ("accuracy", "macro_f1", "ece"),
    "embed": ("ndcg@10", "mrr"),
    "rerank": ("ndcg@10", "mrr"),
    "extract": ("span_f1",),
    "generate": ("exact_match", "schema_valid"),
}


@dataclass
class EvalSet:
    """A parsed evaluation file: its task's fields, one entry per line."""

    task: str
    sha256: str
    lines: int
    texts: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    #: embed / rerank: the queries, the corpus, and each query's relevant documents and candidates.
    queries: list[str] = field(default_factory=list)
    documents: list[str] = field(default_factory=list)
    relevant: list[set[int]] = field(default_factory=list)
    candidates: list[list[int]] | None = None
    #: extract: each text's gold spans (start, end, label) and the label list to ask for.
    spans: list[set[tuple[int, int, str]]] = field(default_factory=list)
    extract_labels: list[list[str] | None] = field(default_factory=list)
    #: generate: each line's prompt or messages, expected text and schema.
    prompts: list[dict[str, Any]] = field(default_factory=list)
    expected: list[str | None] = field(default_factory=list)
    schemas: list[dict[str, Any] | None] = field(default_factory=list)
    #: generate: each line's own `max_tokens` (None: the promotion's default) and its
    #: line number in the file (what a refusal names).
    max_tokens: list[int | None] = field(default_factory=list)
    line_numbers: list[int] = field(default_factory=list)


def _line_error(n: int, what: str) -> BadRequest:
    return BadRequest(f"evaluation line {n}: {what}", param="eval")


def parse_eval(text: str, task: str) -> EvalSet:
    """The evaluation file `text` for a model of `task` (module doc), or a 400 naming the
    first line that does not fit. Its sha256 is of the bytes as sent."""
    if task not in METRICS:
        raise BadRequest(f"fleet cannot evaluate {task} models: promotion evaluates {', '.join(METRICS)}")
    raw = text.encode()
    rows = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not rows:
        raise BadRequest("the evaluation file has no lines", param="eval")
    if len(rows) > MAX_LINES:
        raise BadRequest(f"the evaluation file has {len(rows)} lines; at most {MAX_LINES}", param="eval")
    out = EvalSet(task=task, sha256=hashlib.sha256(raw).hexdigest(), lines=len(rows))
    corpus: dict[str, int] = {}
    for n, line in rows:
        try:
            obj = msgspec.json.decode(line)
        except msgspec.DecodeError as exc:
            raise _line_error(n, f"not JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise _line_error(n, "not a JSON object")
        if task == "classify":
            out.texts.append(_text(obj, "text", n))
            out.labels.append(_text(obj, "label", n))
        elif task in ("embed", "rerank"):
            _retrieval_line(out, obj, n, corpus)
        elif task == "extract":
            _extract_line(out, obj, n)
        else:
            _generate_line(out, obj, n)
    if task in ("embed", "rerank") and out.candidates is None and len(out.documents) > MAX_PAIR_DOCUMENTS:
        raise BadRequest(f"{len(out.documents)} distinct positives form the corpus; at most {MAX_PAIR_DOCUMENTS} in "
                         "the pairs form: give each query its own `documents` and `relevant`", param="eval")
    return out


def _text(obj: dict[str, Any], key: str, n: int) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise _line_error(n, f"`{key}` must be a non-empty string")
    return value


def _retrieval_line(out: EvalSet, obj: dict[str, Any], n: int, corpus: dict[str, int]) -> None:
    query = _text(obj, "query", n)
    if "positive" in obj:
        if out.candidates is not None:
            raise _line_error(n, "mixes the pairs form (`positive`) with `documents` lines")
        doc = _text(obj, "positive", n)
        out.queries.append(query)
        out.relevant.append({corpus.setdefault(doc, len(corpus))})
        if len(corpus) > len(out.documents):
            out.documents.append(doc)
        return
    docs, relevant = obj.get("documents"), obj.get("relevant")
    if not isinstance(docs, list) or not docs or not all(isinstance(d, str) and d for d in docs):
        raise _line_error(n, "needs `positive`, or `documents` (non-empty strings) with `relevant`")
    if (not isinstance(relevant, list) or not relevant
            or not all(isinstance(i, int) and 0 <= i < len(docs) for i in relevant)):
        raise _line_error(n, f"`relevant` must list indices into `documents` (0..{len(docs) - 1})")
    if out.queries and out.candidates is None:
        raise _line_error(n, "mixes `documents` lines with the pairs form (`positive`)")
    out.candidates = out.candidates or []
    start = len(out.documents)
    out.documents.extend(docs)
    out.queries.append(query)
    out.candidates.append(list(range(start, start + len(docs))))
    out.relevant.append({start + i for i in relevant})


def _extract_line(out: EvalSet, obj: dict[str, Any], n: int) -> None:
    text = _text(obj, "text", n)
    entities = obj.get("entities")
    if not isinstance(entities, list):
        raise _line_error(n, "`entities` must be a list of {start, end, label}")
    spans = set()
    for e in entities:
        if (not isinstance(e, dict) or not isinstance(e.get("start"), int) or not isinstance(e.get("end"), int)
                or not isinstance(e.get("label"), str) or not 0 <= e["start"] < e["end"] <= len(text)):
            raise _line_error(n, "each entity is {start, end, label} with 0 <= start < end <= the text's length")
        spans.add((e["start"], e["end"], e["label"]))
    labels = obj.get("labels")
    if labels is not None and (not isinstance(labels, list) or not all(isinstance(x, str) for x in labels)):
        raise _line_error(n, "`labels` must be a list of strings")
    out.texts.append(text)
    out.spans.append(spans)
    out.extract_labels.append(labels)


def _generate_line(out: EvalSet, obj: dict[str, Any], n: int) -> None:
    if ("prompt" in obj) == ("messages" in obj):
        raise _line_error(n, "needs exactly one of `prompt` or `messages`")
    if "prompt" in obj:
        prompt = {"prompt": _text(obj, "prompt", n)}
    else:
        if not isinstance(obj["messages"], list) or not obj["messages"]:
            raise _line_error(n, "`messages` must be a non-empty list")
        prompt = {"messages": obj["messages"]}
    expected, schema = obj.get("expected"), obj.get("schema")
    if expected is None and schema is None:
        raise _line_error(n, "needs `expected` (exact match), `schema` (JSON-schema validity), or both")
    if expected is not None and not isinstance(expected, str):
        raise _line_error(n, "`expected` must be a string")
    if schema is not None and not isinstance(schema, dict):
        raise _line_error(n, "`schema` must be a JSON Schema object")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or not 1 <= max_tokens <= MAX_LINE_TOKENS):
        raise _line_error(n, f"`max_tokens` must be a whole number from 1 to {MAX_LINE_TOKENS}, got {max_tokens!r}")
    out.max_tokens.append(max_tokens)
    out.line_numbers.append(n)
    out.prompts.append(prompt)
    out.expected.append(expected)
    out.schemas.append(schema)


# ---- metrics ------------------------------------------------------------------------------------

def classification_metrics(gold: list[str], predicted: list[str], confidence: np.ndarray) -> dict[str, float]:
    """Accuracy, macro-F1 over the labels either side names, and the top label's ECE."""
    gold_a, pred_a = np.asarray(gold, dtype=object), np.asarray(predicted, dtype=object)
    correct = gold_a == pred_a
    f1s = []
    for label in sorted(set(gold) | set(predicted)):
        tp = float(np.sum(correct & (gold_a == label)))
        fp, fn = float(np.sum((pred_a == label) & ~correct)), float(np.sum((gold_a == label) & ~correct))
        f1s.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    return {"accuracy": float(correct.mean()), "macro_f1": float(np.mean(f1s)),
            "ece": expected_calibration_error(confidence, correct)}


def expected_calibration_error(confidence: np.ndarray, correct: np.ndarray, bins: int = ECE_BINS) -> float:
    """Σ over equal-width confidence bins of |accuracy - mean confidence| x the bin's share
    (fleet.calibration.ece: the one definition `fleetctl calibrate` reports too)."""
    return ece(np.clip(np.asarray(confidence, dtype=np.float64), 0.0, 1.0), np.asarray(correct, dtype=bool), bins)


def retrieval_metrics(scores: list[np.ndarray], candidates: list[list[int]], relevant: list[set[int]],
                      ) -> dict[str, float]:
    """nDCG@10 and MRR (binary relevance): `scores[q]` scores query q's `candidates[q]`."""
    ndcg, rr = [], []
    for s, docs, rel in zip(scores, candidates, relevant):
        order = [docs[i] for i in np.argsort(-np.asarray(s), kind="stable")]
        gains = np.array([1.0 if d in rel else 0.0 for d in order])
        discounts = 1.0 / np.log2(np.arange(2, len(order) + 2))
        ideal = float(discounts[:min(len(rel), 10)].sum())
        ndcg.append(float((gains[:10] * discounts[:10]).sum()) / ideal if ideal else 0.0)
        hits = np.flatnonzero(gains)
        rr.append(1.0 / (hits[0] + 1) if hits.size else 0.0)
    return {"ndcg@10": float(np.mean(ndcg)), "mrr": float(np.mean(rr))}


def span_f1(gold: list[set[tuple[int, int, str]]], predicted: list[set[tuple[int, int, str]]]) -> dict[str, float]:
    """Micro F1 of exact (start, end, label) spans."""
    tp = sum(len(g & p) for g, p in zip(gold, predicted))
    fp = sum(len(p - g) for g, p in zip(gold, predicted))
    fn = sum(len(g - p) for g, p in zip(gold, predicted))
    return {"span_f1": 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 1.0}


def generation_metrics(texts: list[str], expected: list[str | None], schemas: list[dict[str, Any] | None],
                       ) -> dict[str, float]:
    """Exact match (whitespace-stripped) over the lines with `expected`, and the share of
    answers that are JSON valid against their line's `schema`, over the lines with one."""
    out: dict[str, float] = {}
    matched = [t.strip() == e.strip() for t, e in zip(texts, expected) if e is not None]
    if matched:
        out["exact_match"] = sum(matched) / len(matched)
    checked = [(t, s) for t, s in zip(texts, schemas) if s is not None]
    if checked:
        try:
            import jsonschema
        except ImportError:
            raise BadRequest("JSON-schema validity needs the jsonschema package: pip install jsonschema") from None
        valid = 0
        for text, schema in checked:
            try:
                jsonschema.validate(msgspec.json.decode(text), schema)
                valid += 1
            except (msgspec.DecodeError, jsonschema.ValidationError):
                pass
            except jsonschema.SchemaError as exc:
                raise BadRequest(f"an evaluation line's `schema` is not a JSON Schema: {exc.message}") from None
        out["schema_valid"] = valid / len(checked)
    return out


def compare(candidate: dict[str, float], current: dict[str, float], margin: float) -> list[str]:
    """The metrics on which `candidate` is worse than `current` by more than `margin`
    (absolute), each as "name: candidate vs current"."""
    worse = []
    for name, now in current.items():
        new = candidate.get(name)
        if new is None or math.isnan(new) or math.isnan(now):
            continue
        loss = new - now if name in LOWER_IS_BETTER else now - new
        if loss > margin + 1e-12:
            worse.append(f"{name} {new:.4f} vs {now:.4f}")
    return worse
