"""How a text adapter's batch is shaped, written once for every adapter.

Each task adapter (dense, sparse and multi-vector embedders, classify,
extract, rerank, decide) runs its batch the same way:

1. refuse the requests it cannot answer before any forward: each fails alone
   (`split_refused`; the refusals: `text_only`, `no_prompts`, `too_long`, the
   one `input_too_long` answer),
2. flatten the rest into one list of inputs, each cut to the characters the
   model can read (`flat_inputs`, `cut_to_bound`),
3. cut that list into micro-batches of similar length (`micro_batches`):
   padding is paid per micro-batch, so sorting by length cuts wasted compute;
   each runs in one forward pass and its outputs are scattered back to input
   order with one fancy-indexed assignment,
4. split per request (counts -> `offsets`) and build one result per request
   (the rerankers' answer: `rank_into`).

Split from runtimes/adapters/hf_common.py (loading and dtype choice), and holding what
five adapters had each written out: a rule changes here for all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from fleet.errors import BadRequest
from fleet.messages import RerankResult, WorkError
from fleet.prompts import resolve_prompt
from fleet.runtimes.base import TYPICAL_CHARS_PER_TOKEN


# ---- micro-batches and the one length rule --------------------------------------

def input_too_long(model: str, what: str, size: int, limit: int, unit: str = "tokens") -> WorkError:
    """The one `input_too_long` answer: which input, its size, the model's limit, the fix."""
    return WorkError("input_too_long", f"{what} has {size} {unit}; {model} takes at most {limit} {unit} "
                                       "(send truncate=true to cut it)")


#: Characters a text keeps per token the model reads, cut before tokenizing: fast
#: tokenizers normalise and split the whole string before they truncate, so a 15 MB
#: text cost ~20 s of a worker and GBs of RSS for 256 tokens. A token rarely spans
#: more than a word (WordPiece turns a word over 100 characters into one [UNK]); 32
#: per token on average leaves what the model sees unchanged on any real text.
CHARS_PER_TOKEN = 32


def char_bound(max_tokens: int) -> int:
    return max_tokens * CHARS_PER_TOKEN


def cut_to_bound(texts: list[str], max_tokens: int) -> list[str]:
    """`texts`, each cut to `char_bound(max_tokens)` characters (uncut ones are not copied)."""
    bound = char_bound(max_tokens)
    return [t if len(t) <= bound else t[:bound] for t in texts]


def over_char_bound(model: str, texts: Sequence[str], max_tokens: int, what: str = "input") -> WorkError | None:
    """With truncate=false: a text over the character bound is refused before any
    tokenizing (its token count is not worth computing; the answer names characters)."""
    bound = char_bound(max_tokens)
    for i, t in enumerate(texts):
        if len(t) > bound:
            return input_too_long(model, f"{what} {i}", len(t), bound, unit="characters")
    return None


def split_refused(requests: Sequence[Any], refuse: Callable[[Any], Any]) -> tuple[list[Any], list[int]]:
    """Step 1 of every batch: (results with each refused request's WorkError in
    its place, indices of the requests that run). A refused request fails alone."""
    results = [refuse(r) for r in requests]
    return results, [i for i, r in enumerate(results) if r is None]


def micro_batches(lengths: np.ndarray, step: int, fixed: float = 0.0, rows: int = 1) -> Iterator[np.ndarray]:
    """Input indices in micro-batches of at most `step`, shortest inputs first.

    `lengths` is any per-input size proxy: tokens where they are known (the
    encoders on a CPU tokenize first: `sorted_cuts`), else characters, which group
    similar lengths less well (8 merged 32-text requests: 15 % padding against 7 %).
    Stable, so equal lengths keep input order.
    `fixed`: a forward's fixed cost in the units of `lengths` (`Adapter.fixed_chars`):
    the sorted inputs are cut where padding them to one length would cost more
    than another forward (`padding_cuts`, each run a multiple of `rows` inputs but
    the shortest); 0 cuts by count alone.
    """
    order = np.argsort(lengths, kind="stable")
    n, step = len(order), max(1, step)
    bounds = padding_cuts(lengths[order], step, fixed, rows) if fixed > 0 and n > 1 else [*range(0, n, step), n]
    for k in range(len(bounds) - 1):
        yield order[bounds[k] : bounds[k + 1]]


#: The one micro-batch of a one-input batch (read only: indices into it).
ONE_ROW = np.zeros(1, dtype=np.intp)
ONE_ROW.flags.writeable = False


def sorted_cuts(inputs: list[Any], step: int, fixed_tokens: float | None, direct: Any,
                tokenize: Callable[[list[Any]], dict[str, Any]], rows: int = 1,
                ) -> tuple[list[np.ndarray], Callable[[np.ndarray], dict[str, Any]]]:
    """A batch's length-sorted micro-batches (`micro_batches`: input indices) and what
    tokenizes one of them (host token tensors, padded to its longest).

    `inputs`: texts, or (text, text) pairs; `step`: the adapter's micro-batch size
    (`Adapter.micro_items`); `fixed_tokens`: `Adapter.fixed_tokens`; `tokenize`: the
    adapter's tokenization of a list of inputs (its direct tokenizer where one
    serves, else the model's own); `rows`: `Adapter.row_multiple`.
    Where micro-batches are cut by a forward's fixed cost (`fixed_tokens`: a CPU)
    and a `direct` tokenizer (`tokenizing.DirectTokenizer`) serves, the inputs are
    tokenized first, in one call, and sorted by the tokens the forward reads; each
    micro-batch then only pads its encodings. Sorted by characters, 8 merged
    32-text requests of the bench corpus padded 15.1 % of their tokens against
    7.2 % (the length-sorted limit: 5.7 %): characters order inputs of similar
    length badly, and a micro-batch is padded to its longest in tokens. Otherwise
    (a GPU cuts by count; a model's own tokenizer) characters order them
    (`Adapter.fixed_chars`)."""
    n = len(inputs)
    if n == 1:  # a lone input (a lone client's request): no sort to make
        return [ONE_ROW], lambda idx: tokenize(inputs)
    pairs = n > 0 and not isinstance(inputs[0], str)
    if direct is not None and fixed_tokens is not None:
        encodings = direct.encode(inputs)
        lengths = np.fromiter(map(len, encodings), dtype=np.int64, count=n)
        features = direct.features
        return (list(micro_batches(lengths, step, fixed=fixed_tokens, rows=rows)),
                lambda idx: features([encodings[j] for j in idx], pairs=pairs))
    chars = (np.fromiter((len(a) + len(b) for a, b in inputs), dtype=np.int64, count=n) if pairs
             else np.fromiter(map(len, inputs), dtype=np.int64, count=n))
    fixed = 0.0 if fixed_tokens is None else fixed_tokens * TYPICAL_CHARS_PER_TOKEN
    return list(micro_batches(chars, step, fixed=fixed, rows=rows)), lambda idx: tokenize([inputs[j] for j in idx])


def padding_cuts(lengths: np.ndarray, step: int, fixed: float, rows: int = 1) -> list[int]:
    """Bounds (0, ..., n) cutting ascending `lengths` into runs of at most `step`
    whose predicted forward time, the sum over runs of `fixed` + items x longest
    (each run padded to its longest), is least: one pass of dynamic programming
    over at most `step` starts per end (a few us each: ~1 ms for 256 inputs).
    Every run but the first (the shortest inputs) holds a multiple of `rows`
    inputs: an engine that builds kernels per input shape meets fewer shapes
    (`base.ROW_MULTIPLES`).

    A request's texts vary in length: one micro-batch of 32 random corpus texts
    pads 53 % of its forward; cut where it pays, the same texts run 1.3-1.5x
    faster (bench/README, issue 27). Ties cut as count alone would (runs of `step`
    from the shortest)."""
    n = len(lengths)
    size = lengths.astype(np.float64)
    ends = np.arange(n + 1, dtype=np.float64)
    best = np.zeros(n + 1)
    back = np.zeros(n + 1, dtype=np.int64)
    rows = rows if rows <= step else 1  # no run of `step` holds a multiple of it
    for j in range(1, n + 1):
        lo = max(0, j - step)
        cost = best[lo:j] + (j - ends[lo:j]) * size[j - 1]
        if rows > 1:
            starts = ends[lo:j]
            cost[(starts > 0) & ((j - starts) % rows != 0)] = np.inf
        k = len(cost) - 1 - int(cost[::-1].argmin())  # a tie: the latest start
        best[j] = cost[k] + fixed
        back[j] = lo + k
    bounds = [n]
    while bounds[-1]:
        bounds.append(int(back[bounds[-1]]))
    return bounds[::-1]


def offsets(counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of each request's slice in the flattened inputs."""
    ends = np.cumsum(np.asarray(counts, dtype=np.int64))
    return ends - np.asarray(counts, dtype=np.int64), ends


def first_too_long(lengths: Sequence[int], limit: int) -> tuple[int, int] | None:
    """(index, tokens) of the first input over `limit` tokens, or None."""
    over = np.flatnonzero(np.asarray(lengths, dtype=np.int64) > limit)
    if not len(over):
        return None
    return int(over[0]), int(lengths[int(over[0])])


# ---- the text adapters' shared steps ---------------------------------------

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
