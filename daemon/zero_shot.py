"""Zero-shot classification (`candidate_labels`): answered by an NLI classifier, refused
for any other.

Hugging Face's zero-shot classification reads each candidate label as a hypothesis
about the text (`hypothesis_template`, "This example is {}." by default) and asks a
natural-language-inference model how strongly the text entails it. A classifier whose
labels include entailment and contradiction (one trained on MNLI or XNLI) answers that;
any other classifier could only answer with its own labels, so a request naming
candidate labels to one is refused, naming the NLI classifiers the store holds. The
worker scores the pairs (runtimes.adapters.classify).
"""

from __future__ import annotations

import json

from fleet.errors import BadRequest, FleetError
from fleet.nli import DEFAULT_HYPOTHESIS, hypotheses, nli_ids
from fleet.protocol import ClassifyRequest
from fleet.store import Manifest

from fleet.daemon.core import Daemon


def model_labels(daemon: Daemon, manifest: Manifest) -> list[str]:
    """A stored classifier's labels in order (its config.json `id2label`); [] when it has none."""
    if not any(f.path == "config.json" for f in manifest.files):
        return []
    try:
        config = json.loads((daemon.store.path(manifest.name) / "config.json").read_text())
        id2label = {int(k): str(v) for k, v in (config.get("id2label") or {}).items()}
    except (OSError, ValueError, AttributeError):
        return []
    return [id2label[i] for i in sorted(id2label)]


def nli_models(daemon: Daemon) -> list[str]:
    """The stored classifiers that can answer zero-shot classification."""
    names = []
    for manifest in daemon.store.list():
        if manifest.task == "classify" and manifest.base is None and nli_ids(model_labels(daemon, manifest)):
            names.append(manifest.name)
    return names


def check(daemon: Daemon, req: ClassifyRequest, model: str) -> None:
    """Refuse a zero-shot request `model` cannot answer, before it is queued: no labels,
    a template without `{}`, more pairs than `max_inputs`, an adapter, or a model that is
    no NLI classifier (the message names those the store holds)."""
    labels = req.candidate_labels or []
    if not labels or any(not label.strip() for label in labels):
        raise BadRequest("`candidate_labels` must name at least one label, none of them empty",
                         param="candidate_labels")
    try:
        hypotheses(req.hypothesis_template or DEFAULT_HYPOTHESIS, labels[:1])
    except ValueError as exc:
        raise BadRequest(str(exc), param="hypothesis_template") from None
    pairs, limit = len(req.inputs) * len(labels), daemon.settings.max_inputs
    if pairs > limit:
        raise BadRequest(f"{len(req.inputs)} inputs x {len(labels)} candidate labels = {pairs} text-hypothesis pairs "
                         f"is more than the limit of {limit} per request (max_inputs)", param="candidate_labels")
    if req.adapter:
        raise BadRequest("zero-shot classification runs on the NLI model itself: send it without `adapter`",
                         param="adapter")
    labels_of_model = model_labels(daemon, daemon.manifest(model, "classify"))
    if nli_ids(labels_of_model):
        return
    try:
        others = [name for name in nli_models(daemon) if name != model]
    except FleetError:
        others = []
    where = (f"stored NLI classifiers: {', '.join(others)} (name one as `model`, or use its URL /models/NAME/)"
             if others else "none is stored: pull one (a classifier trained on MNLI or XNLI) with `fleetctl pull`")
    raise BadRequest(f"zero-shot classification (`candidate_labels`) needs an NLI model, a classifier whose labels "
                     f"include entailment and contradiction; {model!r} has {', '.join(labels_of_model) or 'no labels'}"
                     f"; {where}", param="model")
