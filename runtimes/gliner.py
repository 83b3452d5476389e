"""Zero-shot entity extraction with GLiNER (task `extract`, runtime `gliner`).

The entity types come with each request (`labels`). GLiNER reads them as part
of its prompt (`<<ENT>> label ... <<SEP>> words`), so the labels of one forward
pass are shared by every text in it and change what it predicts: requests are
grouped by their label list (same labels, same order) and each group runs in
length-sorted micro-batches. Requests with different labels share a worker
batch (one claim, one ack) but not a forward pass; merging label lists would
change each request's answer, so it is not done.

Spans are the library's (`start`/`end` character offsets into the text as sent,
`label`, `score`), non-overlapping (`flat_ner`), above `threshold` (the model
entry's `extra.threshold`, default 0.5), in text order.

The `gliner` package is imported at load only, so the API process and other
runtimes never need it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fleet.errors import FleetError, ModelLoadFailed
from fleet.protocol import ExtractRequest
from runtimes.base import Adapter
from runtimes.hf_common import cut_to_bound, footprint_bytes, input_too_long, micro_batches, over_char_bound
from fleet.messages import EntitySpan, ExtractResult, WorkError

#: Entity types one request may ask for (each is part of every text's prompt).
MAX_LABELS = 64
MAX_LABEL_CHARS = 100
DEFAULT_THRESHOLD = 0.5


def load_gliner(spec: Any, device: str) -> Any:
    try:
        from gliner import GLiNER
    except ImportError:
        raise ModelLoadFailed(f"{spec.name!r} needs the gliner package: pip install gliner") from None
    try:
        model = GLiNER.from_pretrained(str(spec.path), local_files_only=True)
    except FleetError:
        raise
    except Exception as exc:  # the library raises many types for bad folders
        raise ModelLoadFailed(f"cannot load {spec.name!r} as a GLiNER model: {exc}") from exc
    return model.to(device).eval()


class GlinerExtractor(Adapter):
    request_type = ExtractRequest

    def __init__(self, spec: Any, device: str, *, loader=load_gliner) -> None:
        super().__init__(spec, device)
        self._loader = loader  # injected in tests (the real one imports gliner)

    def load(self) -> None:
        self.model = self._loader(self.spec, self.device)
        config = getattr(self.model, "config", None)
        #: Words per text the model reads (GLiNER's `max_len`); past it the library cuts the text.
        self.max_words = int(getattr(config, "max_len", 384) or 384)
        self.threshold = float(self.spec.extra.get("threshold", DEFAULT_THRESHOLD))
        predict = getattr(self.model, "inference", None) or getattr(self.model, "batch_predict_entities", None)
        if predict is None:
            raise ModelLoadFailed(f"{self.spec.name!r}: this gliner version has neither inference() nor "
                                  "batch_predict_entities()")
        self._predict = predict

    def footprint_bytes(self) -> int:
        return footprint_bytes(self.model) if hasattr(self.model, "parameters") else 0

    def refuse(self, req: ExtractRequest) -> WorkError | None:
        if not req.labels:
            return WorkError("bad_request", f"{self.spec.name} is a zero-shot extraction model: send `labels`, "
                                            "the entity types to look for")
        if len(req.labels) > MAX_LABELS:
            return WorkError("bad_request", f"{len(req.labels)} labels is more than the limit of {MAX_LABELS}")
        bad = next((x for x in req.labels if not x.strip() or len(x) > MAX_LABEL_CHARS), None)
        if bad is not None:
            return WorkError("bad_request", f"label {bad!r} must be 1 to {MAX_LABEL_CHARS} characters")
        if len(set(req.labels)) != len(req.labels):
            return WorkError("bad_request", "`labels` has duplicates")
        if not req.truncate:
            if over_text := over_char_bound(self.spec.name, req.inputs, self.max_words):
                return over_text
            words = [len(t.split()) for t in req.inputs]
            over = next((i for i, n in enumerate(words) if n > self.max_words), None)
            if over is not None:
                return input_too_long(self.spec.name, f"input {over}", words[over], self.max_words, "words")
        return None

    def run_batch(self, requests: list[ExtractRequest]) -> list[Any]:
        # 1. Requests that cannot run fail alone; the others group by their labels.
        results: list[Any] = [self.refuse(r) for r in requests]
        groups: dict[tuple[str, ...], list[int]] = {}
        for i, r in enumerate(requests):
            if results[i] is None:
                groups.setdefault(tuple(r.labels), []).append(i)
        # 2. One run per label list over all of its requests' texts; split back.
        for labels, members in groups.items():
            texts = cut_to_bound([t for i in members for t in requests[i].inputs], self.max_words)
            spans = self.extract(texts, list(labels))
            at = 0
            for i in members:
                n = len(requests[i].inputs)
                words = sum(min(len(t.split()), self.max_words) for t in texts[at : at + n])
                results[i] = ExtractResult(spans[at : at + n], words)
                at += n
        return results

    def extract(self, texts: list[str], labels: list[str]) -> list[list[EntitySpan]]:
        """Spans per text (text order), texts run in length-sorted micro-batches."""
        out: list[Any] = [None] * len(texts)
        lengths = np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts))
        for idx in micro_batches(lengths, self.spec.profile.micro_batch_items):
            found = self._predict([texts[j] for j in idx], labels, flat_ner=True, threshold=self.threshold)
            if len(found) != len(idx):
                raise RuntimeError(f"gliner returned {len(found)} span lists for {len(idx)} texts; this is a bug")
            for j, spans in zip(idx, found):
                out[int(j)] = to_spans(spans, len(texts[int(j)]))
        return out

    def unload(self) -> None:
        self.model = None


def to_spans(found: list[dict], text_len: int) -> list[EntitySpan]:
    """The library's dicts as EntitySpans, in text order; offsets must lie in the text."""
    spans = []
    for d in sorted(found, key=lambda d: (d["start"], d["end"])):
        start, end = int(d["start"]), int(d["end"])
        if not 0 <= start < end <= text_len:
            raise RuntimeError(f"gliner span [{start}, {end}) is outside a text of {text_len} characters; this is a bug")
        spans.append(EntitySpan(str(d["label"]), start, end, float(d["score"])))
    return spans
