"""Zero-shot extraction (runtime `gliner`): the adapter's grouping by labels,
micro-batching, span conversion and per-request failures, on a fake model that
behaves like GLiNER's `inference` (labels in, character spans out) and records
every call. The real-weights test needs the `gliner` package, which is not
installed here: gliner 0.2.29 requires transformers < 5.17 and this project runs
transformers 5.24, so installing it would downgrade the shared environment.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fleet.protocol import ExtractRequest
from runtimes.base import ModelSpec, Profile
from fleet.messages import EntitySpan, ExtractResult, WorkError

#: What the fake model knows per entity type.
LEXICON = {"person": ["Angela Merkel", "José Núñez", "Ada"], "city": ["Berlin", "São Paulo", "Paris"],
           "company": ["Acme Corp"]}


class FakeGliner:
    """`inference(texts, labels, flat_ner, threshold)` -> per text a list of
    {start, end, text, label, score}, like gliner's. The score depends on the
    label's position in the prompt (as GLiNER's does on the whole prompt), so a
    request run with another label list would get other scores."""

    class config:
        max_len = 12

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], list[str], float]] = []

    def inference(self, texts, labels, flat_ner=True, threshold=0.5):
        assert flat_ner
        self.calls.append((list(texts), list(labels), threshold))
        out = []
        for text in texts:
            spans = []
            for pos, label in enumerate(labels):
                for name in LEXICON.get(label, []):
                    for m in re.finditer(re.escape(name), text):
                        score = 0.9 - 0.1 * pos
                        if score >= threshold:
                            spans.append({"start": m.start(), "end": m.end(), "text": name, "label": label,
                                          "score": score})
            out.append(spans[::-1])  # unordered on purpose: the adapter sorts by offset
        return out


def adapter(micro: int = 2, **extra):
    from runtimes.gliner import GlinerExtractor

    spec = ModelSpec(name="tiny-gliner", path=Path("/nonexistent"), task="extract", runtime="gliner",
                     profile=Profile(micro_batch_items=micro), extra=extra)
    fake = FakeGliner()
    a = GlinerExtractor(spec, "cpu", loader=lambda spec, device: fake)
    a.load()
    return a, fake


TEXTS = ["Angela Merkel flew from Berlin to Paris.", "José Núñez moved to São Paulo.", "nothing here", "Ada"]


def test_requests_group_by_label_list_and_split_back():
    a, fake = adapter()
    batch = [
        ExtractRequest("m", TEXTS[:2], labels=["person", "city"]),
        ExtractRequest("m", TEXTS[2:], labels=["city"]),
        ExtractRequest("m", [TEXTS[0]], labels=["person", "city"]),  # same labels as the first: same runs
        ExtractRequest("m", ["x"]),  # no labels
    ]
    results = a.run_batch(batch)
    assert isinstance(results[3], WorkError) and results[3].code == "bad_request" and "labels" in results[3].message
    # Two label lists -> two groups; the first group's three texts in micro-batches of 2.
    by_labels = {}
    for texts, labels, _ in fake.calls:
        by_labels.setdefault(tuple(labels), []).extend(texts)
    assert sorted(by_labels) == [("city",), ("person", "city")]
    assert sorted(by_labels[("person", "city")]) == sorted([TEXTS[0], TEXTS[1], TEXTS[0]])
    assert all(len(texts) <= 2 for texts, _, _ in fake.calls)
    first = results[0]
    assert isinstance(first, ExtractResult) and len(first.spans) == 2
    assert first.spans[0] == [EntitySpan("person", 0, 13, pytest.approx(0.9)),
                              EntitySpan("city", 24, 30, pytest.approx(0.8)),
                              EntitySpan("city", 34, 39, pytest.approx(0.8))]
    text = TEXTS[1]
    assert [(s.entity, text[s.start:s.end]) for s in first.spans[1]] == [("person", "José Núñez"),
                                                                       ("city", "São Paulo")]
    # The same request alone gives the same answer (grouping never mixes label lists).
    assert a.run_batch([batch[2]])[0].spans == results[2].spans == [first.spans[0]]
    assert results[1].spans == [[], []]  # "Ada" is a person, and only cities were asked for
    assert results[1].input_tokens == 3  # words read


def test_threshold_comes_from_the_model_entry():
    a, fake = adapter(threshold=0.85)
    (res,) = a.run_batch([ExtractRequest("m", [TEXTS[0]], labels=["person", "city"])])
    assert fake.calls[0][2] == 0.85
    assert [s.entity for s in res.spans[0]] == ["person"]  # the cities scored 0.8


@pytest.mark.parametrize("labels, truncate, code, needle", [
    ([], True, "bad_request", "labels"),
    (["person", "person"], True, "bad_request", "duplicates"),
    (["  "], True, "bad_request", "characters"),
    ([f"t{i}" for i in range(65)], True, "bad_request", "limit"),
    (["person"], False, "input_too_long", "12"),
])
def test_bad_requests_fail_alone(labels, truncate, code, needle):
    a, fake = adapter()
    long = " ".join(["word"] * 20)
    ok = ExtractRequest("m", ["Ada"], labels=["person"])
    results = a.run_batch([ExtractRequest("m", [long], labels=labels, truncate=truncate), ok])
    assert isinstance(results[0], WorkError) and results[0].code == code and needle in results[0].message
    assert results[1].spans == [[EntitySpan("person", 0, 3, pytest.approx(0.9))]]


def test_a_span_outside_its_text_is_a_bug_not_an_answer():
    from runtimes.gliner import to_spans

    with pytest.raises(RuntimeError, match="this is a bug"):
        to_spans([{"start": 3, "end": 9, "label": "x", "score": 1.0}], 5)


def test_real_gliner_weights():
    pytest.importorskip("gliner", reason="gliner is not installed: gliner 0.2.29 requires transformers < 5.17 "
                                         "and this environment runs transformers 5.24 (installing it would "
                                         "downgrade the shared venv), so no GLiNER model can be built or loaded")
    from gliner import GLiNER

    from runtimes.gliner import GlinerExtractor
    from tests.conftest import default_model_dir

    folder = Path(pytest.importorskip("tempfile").mkdtemp()) / "gliner"
    from gliner import GLiNERConfig

    GLiNER(GLiNERConfig(model_name=str(default_model_dir()), max_len=64)).save_pretrained(folder)
    spec = ModelSpec(name="g", path=folder, task="extract", runtime="gliner", profile=Profile(micro_batch_items=2))
    a = GlinerExtractor(spec, "cpu")
    a.load()
    direct = GLiNER.from_pretrained(str(folder), local_files_only=True)
    labels = ["person", "city"]
    (res,) = a.run_batch([ExtractRequest("g", TEXTS, labels=labels)])
    want = direct.inference(TEXTS, labels, flat_ner=True, threshold=0.5)
    assert [[(s.start, s.end, s.entity) for s in spans] for spans in res.spans] == \
        [sorted((d["start"], d["end"], d["label"]) for d in row) for row in want]
