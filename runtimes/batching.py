"""The steps every text adapter's batch shares, written once.

Each text adapter (dense, sparse and multi-vector embedders, classify, extract,
rerank) runs its batch in the same four steps (runtimes/hf_common.py says why):
it refuses the requests it cannot answer before any forward (each fails alone:
`split_refused`), flattens the rest into one list of inputs, runs them in
micro-batches, and splits the outputs back per request. The refusals (text
only, prompts, over the model's length) and the flattening were written out
in five adapters, and the rerank answer (scores best first, cut to `top_n`)
in both rerankers; they are one function each here, so a rule changes in
one place for every adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fleet.errors import BadRequest
from fleet.messages import RerankResult, WorkError
from fleet.prompts import resolve_prompt
from fleet.runtimes.hf_common import cut_to_bound, first_too_long, input_too_long, offsets, over_char_bound


def text_only(model: str, inputs: Sequence[Any]) -> WorkError | None:
    """A request with an image refused by a text model."""
    if any(x.__class__ is not str for x in inputs):
        return WorkError("bad_request", f"{model} embeds text only; images need an image model (runtime clip)")
    return None


def no_prompts(model: str, runtime: str, req: Any) -> WorkError | None:
    """A prompt refused by a model that reads none (SPLADE, CLIP)."""
    if req.prompt or req.prompt_name is not None:
        return WorkError("bad_request", f"{model} (runtime {runtime}) takes no prompts: put the text you mean "
                                        "in the input")
    return None


def prompt_of(model: str, table: dict[str, str], default: str | None, req: Any) -> str | WorkError:
    """The text `req` puts before each input ('' = none: fleet.prompts), or why it cannot."""
    try:
        return resolve_prompt(model, table, default, req.prompt, req.prompt_name)
    except BadRequest as exc:
        return WorkError(exc.code, exc.message)


def prompted(texts: list[str], prompt: str) -> list[str]:
    """`texts` with `prompt` in front of each (the same list when there is none)."""
    return [prompt + t for t in texts] if prompt else texts


def too_long(model: str, texts: Sequence[str], max_tokens: int, lengths: Callable[[Any], Sequence[int]],
             what: str = "input", counted: str | None = None) -> WorkError | None:
    """With truncate=false: the first text over the model's length, refused. A text
    over the character bound is refused before any tokenizing (`over_char_bound`);
    the others are counted by `lengths` (tokens per text with the special tokens,
    untruncated). `counted`: what the token count names (default `what`: a
    reranker counts the query with each document)."""
    if over := over_char_bound(model, texts, max_tokens, what):
        return over
    first = first_too_long(lengths(texts), max_tokens)
    if first is None:
        return None
    return input_too_long(model, f"{counted or what} {first[0]}", first[1], max_tokens)


def flat_inputs(requests: Sequence[Any], live: list[int], max_tokens: int,
                prompts: list[str] | None = None) -> tuple[list[str], np.ndarray]:
    """(the live requests' inputs in one list, each with its request's prompt in
    front (`prompts`, one per live request; None: none) and cut to the character
    bound (`cut_to_bound`), inputs per live request (int64))."""
    if prompts is None:
        texts = [t for i in live for t in requests[i].inputs]
    else:
        texts = [t for i, p in zip(live, prompts) for t in prompted(requests[i].inputs, p)]
    counts = np.fromiter((len(requests[i].inputs) for i in live), dtype=np.int64, count=len(live))
    return cut_to_bound(texts, max_tokens), counts


def rank_into(results: list[Any], requests: Sequence[Any], live: list[int], counts: np.ndarray,
              logits: np.ndarray, activated: np.ndarray, tokens: np.ndarray) -> None:
    """The rerankers' last step: per live request, its documents' scores (the
    logits with `raw_scores`, else `activated`), best first (stable: ties keep
    document order, as the daemon merges split requests), cut to `top_n`, with
    the tokens its pairs read; into `results`."""
    starts, ends = offsets(counts)
    token_sums = np.add.reduceat(tokens, starts)
    for k, i in enumerate(live):
        req = requests[i]
        scores = (logits if req.raw_scores else activated)[starts[k] : ends[k]]
        order = np.argsort(-scores, kind="stable")
        if req.top_n is not None:
            order = order[: req.top_n]
        results[i] = RerankResult(order.astype("<i4").tobytes(), scores[order].astype("<f4").tobytes(),
                                  int(token_sums[k]))
