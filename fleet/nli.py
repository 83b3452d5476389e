"""Natural-language-inference labels: which of a classifier's labels are entailment
and contradiction (zero-shot classification reads candidate labels through them).

Imported by the API process and the workers alike: no heavy imports.
"""

from __future__ import annotations

from collections.abc import Sequence

#: The hypothesis each candidate label is put in when a request gives none
#: (transformers' zero-shot classification pipeline's default).
DEFAULT_HYPOTHESIS = "This example is {}."


def nli_ids(labels: Sequence[str]) -> tuple[int, int] | None:
    """(entailment, contradiction): the positions of the first labels named so
    ("ENTAILMENT", "entailment", "contradiction", ...), or None when the classifier
    has not both (it is no NLI model)."""
    found: dict[str, int] = {}
    for i, label in enumerate(labels):
        low = str(label).lower()
        for key in ("entail", "contradict"):
            if low.startswith(key):
                found.setdefault(key, i)
    if len(found) != 2:
        return None
    return found["entail"], found["contradict"]


def hypotheses(template: str, labels: Sequence[str]) -> list[str]:
    """Each candidate label in `template` (its `{}`), as the pipeline formats it;
    ValueError naming what is wrong with a template that does not take one."""
    try:
        out = [template.format(label) for label in labels]
    except (IndexError, KeyError, ValueError) as exc:
        raise ValueError(f"`hypothesis_template` {template!r} cannot be formatted with a label ({exc}); "
                         "put {} where the label goes") from None
    if labels and out[0] == template:
        raise ValueError(f"`hypothesis_template` {template!r} has no {{}} where the label goes")
    return out
