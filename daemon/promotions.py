"""Promotion: a candidate takes an alias only when an evaluation says it is no worse.

`promote` runs the evaluation file (fleet.evaluation) through the candidate and the
alias's current version side by side, over the same path clients' requests take (the
task functions of daemon.tasks: lanes, batches, pieces), computes the task's metrics
for both, and refuses (409 `promotion_refused`, both versions' numbers in the message)
when the candidate is worse on any of them by more than the margin, unless forced with
a reason. A generate evaluation may name a judge model (fleet.judge): it grades each
pair of answers against the line's reference, and its win rate is one more metric.
Either way it writes a promotion package (fleet.promotions) into the store,
and, when it may, switches the alias (or starts a canary) through `AliasBook.change`,
recording the package in the alias's history.

A generate line's answer runs to the line's `max_tokens` (else EVAL_MAX_TOKENS) or to its
version's context less the prompt, whichever is shorter (`Run.generate`): a model with
a short context is compared on the answers that fit it; a prompt that alone does not fit
is a 422 naming the line and the version, never scored as the model's failure.

The evaluation's requests are the operator's work on this box: each waits like a
client's request, and the run is bounded by the file (fleet.evaluation.MAX_LINES) and
by EVAL_CONCURRENCY requests in flight.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import msgspec
import numpy as np

from fleet.catalog import load_catalog, parse_source
from fleet.errors import BadRequest, FleetError, InputTooLong, ModelNotFound, PromotionRefused
from fleet.evaluation import (
    METRICS, EvalSet, classification_metrics, compare, generation_metrics, retrieval_metrics, span_f1,
)
from fleet.judge import VERDICT_MAX_TOKENS, VERDICT_SCHEMA, WIN_RATE, JudgeReport, judge_messages, summary, tally, \
    winner_of
from fleet.messages import GenerateResult
from fleet.promotions import Capacity, EvalReport, GenerationLimit, Package, VersionFacts, new_id
from fleet.protocol import ClassifyRequest, EmbedRequest, ExtractRequest, GenerateRequest, RerankRequest
from fleet.store import Manifest

from fleet.daemon import tasks
from fleet.daemon.core import Daemon, live_profiles

_encode = msgspec.msgpack.Encoder().encode
#: Inputs per evaluation request (texts of classify, extract and embed).
EVAL_CHUNK = 32
#: Evaluation requests in flight at once, per version.
EVAL_CONCURRENCY = 4
#: Tokens a generation in an evaluation may produce where its line names none (an answer
#: longer than this does not match); a version's context may bound it further.
EVAL_MAX_TOKENS = 256


def context_of(daemon: Daemon, version: str) -> int | None:
    """Tokens (prompt and answer) `version` takes, as its worker bounds them: the store's
    max_seq_len, never past the model's positions (its config.json, a LoRA adapter's
    base's, or its GGUF header's); None where none says."""
    manifest = daemon.store.get(version)
    model = daemon.store.get(manifest.base) if manifest.base is not None else manifest
    limits = [manifest.max_seq_len, model.max_seq_len, model.gguf.context_length if model.gguf else None]
    try:
        config = json.loads((daemon.store.path(model.name) / "config.json").read_bytes())
    except (OSError, ValueError):
        config = {}
    positions = config.get("max_position_embeddings") if isinstance(config, dict) else None
    limits.append(positions if isinstance(positions, int) and not isinstance(positions, bool) else None)
    known = [x for x in limits if x]
    return min(known) if known else None


class Run:
    """One version's pass over an evaluation: its metrics, the tokens it read, its time."""

    def __init__(self, daemon: Daemon, version: str) -> None:
        self.daemon, self.version = daemon, version
        self.tokens = 0
        #: generate: each line's answer (what a judge compares), the version's context
        #: (tokens; None: unknown) and the answers it ended.
        self.answers: list[str] = []
        self.context: int | None = None
        self.context_bound = 0
        self.gate = asyncio.Semaphore(EVAL_CONCURRENCY)

    async def many(self, jobs: list[Any]) -> list[Any]:
        async def one(job: Any) -> Any:
            async with self.gate:
                return await job

        return await asyncio.gather(*(one(j) for j in jobs))

    async def metrics(self, ev: EvalSet) -> dict[str, float]:
        return await getattr(self, ev.task)(ev)

    # -- one method per task -----------------------------------------------------------

    async def classify(self, ev: EvalSet) -> dict[str, float]:
        async def chunk(texts: list[str]) -> list[Any]:
            req = ClassifyRequest(model=self.version, inputs=texts, top_k=1)
            results, usage, _ = await tasks.classify(self.daemon, req, _encode(req))
            self.tokens += usage.input_tokens
            return results

        rows = [r for part in await self.many([chunk(ev.texts[i:i + EVAL_CHUNK])
                                               for i in range(0, len(ev.texts), EVAL_CHUNK)]) for r in part]
        return classification_metrics(ev.labels, [r[0].label for r in rows],
                                      np.array([r[0].score for r in rows]))

    async def embed(self, ev: EvalSet) -> dict[str, float]:
        async def chunk(texts: list[str]) -> np.ndarray:
            req = EmbedRequest(model=self.version, inputs=texts)
            res, _ = await tasks.embed(self.daemon, req, _encode(req))
            self.tokens += res.input_tokens
            return tasks.vectors(res).astype(np.float32)

        def embedded(texts: list[str]) -> list[Any]:
            return [chunk(texts[i:i + EVAL_CHUNK]) for i in range(0, len(texts), EVAL_CHUNK)]

        parts = await self.many(embedded(ev.queries) + embedded(ev.documents))
        n_q = -(-len(ev.queries) // EVAL_CHUNK)
        queries, docs = np.concatenate(parts[:n_q]), np.concatenate(parts[n_q:])
        candidates = ev.candidates or [list(range(len(ev.documents)))] * len(ev.queries)
        scores = [docs[c] @ queries[q] for q, c in enumerate(candidates)]
        return retrieval_metrics(scores, candidates, ev.relevant)

    async def rerank(self, ev: EvalSet) -> dict[str, float]:
        candidates = ev.candidates or [list(range(len(ev.documents)))] * len(ev.queries)

        async def one(query: str, docs: list[int]) -> np.ndarray:
            req = RerankRequest(model=self.version, query=query, documents=[ev.documents[d] for d in docs])
            hits, usage, _ = await tasks.rerank(self.daemon, req, _encode(req))
            self.tokens += usage.input_tokens
            scores = np.empty(len(docs))
            scores[[h.index for h in hits]] = [h.relevance_score for h in hits]
            return scores

        scores = await self.many([one(q, c) for q, c in zip(ev.queries, candidates)])
        return retrieval_metrics(scores, candidates, ev.relevant)

    async def extract(self, ev: EvalSet) -> dict[str, float]:
        async def one(text: str, labels: list[str] | None) -> set[tuple[int, int, str]]:
            req = ExtractRequest(model=self.version, inputs=[text], labels=labels)
            results, usage, _ = await tasks.extract(self.daemon, req, _encode(req))
            self.tokens += usage.input_tokens
            return {(e.start, e.end, e.entity) for e in results[0]}

        predicted = await self.many([one(t, labels) for t, labels in zip(ev.texts, ev.extract_labels)])
        return span_f1(ev.spans, predicted)

    async def generate(self, ev: EvalSet) -> dict[str, float]:
        context = context_of(self.daemon, self.version)

        async def ask(prompt: dict[str, Any], max_tokens: int | None) -> GenerateResult:
            req = msgspec.convert({"model": self.version, **prompt, "max_tokens": max_tokens, "temperature": 0.0},
                                  GenerateRequest)
            return (await tasks.generate(self.daemon, req, _encode(req)))[0]

        async def one(n: int, prompt: dict[str, Any], asked: int | None) -> GenerateResult:
            limit = asked or EVAL_MAX_TOKENS
            # Without max_tokens the worker runs an answer to the context's room (its
            # length_limit says "context" when it got there). A context that cannot hold
            # `limit` past any prompt always leaves less: ask open-ended at once. Else ask
            # `limit`, and where this prompt leaves less room (the worker's 400 on
            # max_tokens) ask again open-ended.
            try:
                if context is not None and context - 1 <= limit:
                    return await ask(prompt, None)
                try:
                    return await ask(prompt, limit)
                except BadRequest:  # not InputTooLong (422): that prompt fits no answer at all
                    return await ask(prompt, None)
            except InputTooLong as exc:
                raise InputTooLong(
                    f"evaluation line {n}: its prompt alone does not fit {self.version} ({exc.message}); the line "
                    "cannot be evaluated on this version, which says nothing of its answers", param="eval",
                    hint="shorten the line's prompt or drop the line") from None

        try:
            results = await self.many([one(n, p, m) for n, p, m in zip(ev.line_numbers, ev.prompts, ev.max_tokens)])
        except msgspec.ValidationError as exc:
            raise BadRequest(f"an evaluation line's `messages` do not fit a chat request: {exc}") from None
        self.tokens += sum(r.input_tokens + r.output_tokens for r in results)
        self.answers = [r.text for r in results]
        self.context, self.context_bound = context, sum(r.length_limit == "context" for r in results)
        return generation_metrics(self.answers, ev.expected, ev.schemas)


def check_judge(daemon: Daemon, judge: str, ev: EvalSet) -> None:
    """A judge is a stored generator, for a generate evaluation with references: else a
    4xx before anything runs."""
    if ev.task != "generate":
        raise BadRequest(f"a judge grades generated answers; this evaluation is {ev.task}'s", param="judge")
    if not daemon.store.exists(judge):
        raise ModelNotFound(f"judge {judge!r} is not in the store", hint="fleetctl list shows what is pulled",
                            param="judge")
    task = daemon.store.get(judge).task
    if task != "generate":
        raise BadRequest(f"judge {judge!r} serves {task}: a judge must be a generator (it answers which answer "
                         "fits the reference better)", param="judge")
    if all(e is None for e in ev.expected):
        raise BadRequest(f"a judge compares answers with each line's `expected`: none of the {ev.lines} lines has one",
                         param="judge")


async def judged(daemon: Daemon, judge: str, ev: EvalSet, candidate: list[str], current: list[str]) -> JudgeReport:
    """The judge's verdict on every line with a reference (fleet.judge: the prompt, the
    alternating order, identical answers tied unasked), through the generate path with
    its output held to the verdict schema."""
    run = Run(daemon, judge)

    async def one(n: int) -> str | None:
        if candidate[n] == current[n]:
            return None
        messages = judge_messages(n, ev.prompts[n], ev.expected[n] or "", candidate[n], current[n])
        req = msgspec.convert({"model": judge, "messages": messages, "max_tokens": VERDICT_MAX_TOKENS,
                               "temperature": 0.0, "format": VERDICT_SCHEMA}, GenerateRequest)
        res, _ = await tasks.generate(daemon, req, _encode(req))
        return winner_of(res.text)

    lines = [n for n, e in enumerate(ev.expected) if e is not None]
    return tally(judge, lines, await run.many([one(n) for n in lines]))


def licence_of(daemon: Daemon, manifest: Manifest) -> str:
    """The licence the catalog names for the model (by name, else by source; a LoRA
    adapter's own entry), "unknown" when none does: fleet keeps no model card."""
    try:
        catalog = load_catalog(daemon.settings.home)
        entry = catalog.find(manifest.name) or catalog.find_by_source(parse_source(manifest.source))
    except FleetError:
        entry = None
    return (entry.license if entry is not None else None) or "unknown"


def facts_of(daemon: Daemon, manifest: Manifest) -> VersionFacts:
    return VersionFacts(name=manifest.name, source=manifest.source, revision=manifest.revision, task=manifest.task,
                        runtime=manifest.runtime, base=manifest.base, pulled_at=manifest.created_at,
                        size_bytes=manifest.size_bytes, licence=licence_of(daemon, manifest), files=manifest.files)


def generation_limit(ev: EvalSet, runs: list[Run]) -> GenerationLimit | None:
    """What bounded a generate evaluation's answers, per version (None: another task)."""
    if ev.task != "generate":
        return None
    return GenerationLimit(max_tokens=EVAL_MAX_TOKENS, lines_with_max_tokens=sum(m is not None for m in ev.max_tokens),
                           context={r.version: r.context for r in runs},
                           context_bound={r.version: r.context_bound for r in runs})


async def evaluate(daemon: Daemon, ev: EvalSet, candidate: str, current: str | None, judge: str | None = None,
                   ) -> tuple[dict[str, float], dict[str, float] | None, Capacity, JudgeReport | None,
                              GenerationLimit | None]:
    """Both versions' metrics, side by side, the candidate's throughput and footprint as
    the evaluation measured them, the judge's verdicts (with a judge and a current
    version: the win rates join the metrics), and what bounded generated answers."""
    runs = [Run(daemon, candidate)] + ([Run(daemon, current)] if current else [])
    t0 = time.perf_counter()
    results = await asyncio.gather(*(r.metrics(ev) for r in runs))
    seconds = time.perf_counter() - t0
    workers = await daemon.workers()
    resident = max((m.get("bytes", 0) for w in workers if w["up"] for n, m in w["models"].items() if n == candidate),
                   default=0)
    capacity = Capacity(tokens=runs[0].tokens, seconds=round(seconds, 3),
                        tokens_per_s=round(runs[0].tokens / seconds, 1) if seconds else 0.0,
                        resident_bytes=resident,
                        how="measured on the evaluation's own requests (both versions running at once), not a "
                            "`fleetctl tune` run: a floor, not the model's capacity")
    limit = generation_limit(ev, runs)
    if judge is None or current is None:
        return results[0], (results[1] if current else None), capacity, None, limit
    verdicts = await judged(daemon, judge, ev, runs[0].answers, runs[1].answers)
    lost = (verdicts.current_wins + verdicts.ties / 2) / verdicts.lines
    return ({**results[0], WIN_RATE: verdicts.win_rate}, {**results[1], WIN_RATE: lost}, capacity, verdicts, limit)


async def promote(daemon: Daemon, *, alias: str, candidate: str, ev: EvalSet, margin: float, force: bool,
                  reason: str, owner: str, canary_percent: float, judge: str | None = None) -> Package:
    """Evaluate, write the package, switch the alias (or start its canary): module doc."""
    from fleet.daemon.aliases import check_target, event_of, set_to, with_canary

    before = daemon.aliases.table.get(alias)
    check_target(daemon, alias, candidate, before)
    if not daemon.store.exists(candidate):
        raise BadRequest(f"{candidate!r} is not stored on this box: a promotion evaluates and records the version "
                         "it promotes from this box's store", param="candidate")
    manifest = daemon.store.get(candidate)
    if manifest.task != ev.task:
        raise BadRequest(f"{candidate!r} serves {manifest.task}, the evaluation was read as {ev.task}")
    current = before.version if before is not None else None
    if current == candidate and not canary_percent:
        raise BadRequest(f"alias {alias!r} already points at {candidate!r}", param="candidate")
    if canary_percent and current is None:
        raise BadRequest(f"a canary runs beside a version: alias {alias!r} has none yet, promote without --canary",
                         param="canary_percent")
    if judge is not None:
        check_judge(daemon, judge, ev)
        if current is None:
            raise BadRequest(f"a judge compares the candidate with the alias's version: alias {alias!r} has none yet",
                             param="judge")
    ran, now, capacity, verdicts, limit = await evaluate(daemon, ev, candidate, current, judge)
    worse = compare(ran, now, margin) if now is not None else []
    workers = await daemon.workers()
    report = EvalReport(file_sha256=ev.sha256, lines=ev.lines,
                        metrics=list(METRICS[ev.task]) + ([WIN_RATE] if verdicts else []),
                        lower_is_better=[m for m in METRICS[ev.task] if m == "ece"], margin=margin,
                        candidate=ran, current=now, regressions=worse, judge=verdicts, generation=limit)
    kind = "refused" if worse and not force else ("canary" if canary_percent else "promote")
    package = Package(
        id=new_id(), alias=alias, kind=kind, owner=owner, reason=reason, forced=bool(worse) and force,
        candidate=facts_of(daemon, manifest), replaced=current,
        rollback_target=current if not canary_percent else None, canary_percent=canary_percent,
        evaluation=report, capacity=capacity,
        serving_profile=[msgspec.to_builtins(p) for p in live_profiles(workers, candidate)]
        or [{"profile": "default", "settings": msgspec.to_builtins(manifest.profile), "from": "manifest"}])
    await daemon.aliases.write_package(package)
    if kind == "refused":
        await daemon.aliases.record(event_of("refused", by=owner, reason=reason, package=package.id)(before, before))
        raise PromotionRefused(
            f"{candidate} is worse than {current} on the evaluation ({ev.lines} lines, sha256 {ev.sha256[:12]}) by more "
            f"than the margin {margin:g}: {'; '.join(worse)} (candidate vs current)"
            + (f"; {summary(verdicts)}" if verdicts else "") + f"; {alias} still points at "
            f"{current}. Package {package.id} records both versions' numbers",
            hint=f"fleetctl history {alias}; to promote anyway: --force --reason \"why\"")
    change = (with_canary(alias, candidate, canary_percent, by=owner) if canary_percent
              else set_to(alias, candidate, by=owner))
    await daemon.aliases.change(alias, change, event_of(kind, by=owner, reason=reason, package=package.id))
    return package
