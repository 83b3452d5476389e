"""Streaming generation load: closed-loop clients stepped to the knee, with time to
first token (TTFT), the gaps between streamed tokens (inter-token, ITL) and output
tokens/s. `fleetctl bench --task generate` runs it against one server (`bench_server`);
bench/generate_engines.py runs it against several engines on one model.

Every target is driven through a `run(prompt) -> Reply` callable: an OpenAI-style
streamed `/v1/completions` (fleet, llama.cpp's server) or an in-process engine. A
step is `clients` threads each sending `requests` requests back to back; steps double
the clients (or follow an explicit list) until bench/knee.py calls one past the knee.
Output tokens/s counts generated tokens over the step's wall time. This module never
imports torch.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
from rich.table import Table

from fleet.bench import corpus
from fleet.bench.knee import CLOSED, StepResult, find_knee

#: Prompt lengths (words of the corpus; ~1.3 tokens each): mixed in every step.
PROMPT_WORDS = (15, 40, 80, 150, 300)


def mixed_prompts() -> list[str]:
    """One prompt of each PROMPT_WORDS length, from places spread over bench/corpus.txt."""
    words = " ".join(corpus.load()).split()
    return [" ".join(words[i * 997 % 5000:i * 997 % 5000 + n]) for i, n in enumerate(PROMPT_WORDS)]


class WarmupFailed(Exception):
    """The first request failed (no such model, not a generator, ...): nothing to ramp."""


@dataclass
class Reply:
    ttft_ms: float
    gaps_ms: list[float]
    tokens: int
    ms: float


@dataclass
class Step:
    clients: int
    replies: list[Reply] = field(default_factory=list)
    wall_s: float = 0.0
    errors: int = 0
    #: The first failure's text: what a reader needs when a step has errors.
    error_sample: str = ""

    def summary(self) -> dict:
        lat = sorted(r.ms for r in self.replies)
        ttft = sorted(r.ttft_ms for r in self.replies)
        gaps = sorted(g for r in self.replies for g in r.gaps_ms)
        tokens = sum(r.tokens for r in self.replies)
        out = {"clients": self.clients, "requests": len(self.replies), "errors": self.errors,
               "output_tokens": tokens, "output_tokens_per_s": round(tokens / self.wall_s, 1) if self.wall_s else 0,
               "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p95": pct(ttft, 95),
               "itl_ms_p50": pct(gaps, 50), "itl_ms_p95": pct(gaps, 95),
               "latency_ms_p50": pct(lat, 50), "latency_ms_p95": pct(lat, 95)}
        if self.error_sample:
            out["error_sample"] = self.error_sample
        return out

    def knee_row(self) -> StepResult:
        s = self.summary()
        lat = sorted(r.ms for r in self.replies)
        return StepResult(offered=self.clients, throughput_rps=len(self.replies) / self.wall_s,
                          tokens_per_s=s["output_tokens_per_s"], p50_ms=pct(lat, 50), p95_ms=pct(lat, 95),
                          p99_ms=pct(lat, 99), sent=len(self.replies) + self.errors, ok=len(self.replies),
                          errors=self.errors, mode=CLOSED)


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return round(values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))], 1)


def timed(chunks: Iterator[int]) -> Reply:
    """A reply from a stream of token counts as they arrive (0: a chunk without text)."""
    start = last = time.perf_counter()
    first, gaps, tokens = None, [], 0
    for n in chunks:
        now = time.perf_counter()
        if n and first is None:
            first = now
        elif n:
            gaps.append((now - last) * 1000)
        if n:
            last = now
        tokens += n
    end = time.perf_counter()
    return Reply(((first or end) - start) * 1000, gaps, tokens, (end - start) * 1000)


def completions_stream(url: str, model: str, max_tokens: int, *, headers: dict[str, str] | None = None,
                       usage: bool = True) -> Callable[[str], Reply]:
    """Greedy streamed `/v1/completions` of `max_tokens` tokens. With `usage` the server's
    own completion_tokens count is the reply's (fleet); without, one text chunk is one
    token (llama.cpp's server streams one token a chunk and sends no usage)."""
    client = httpx.Client(timeout=600, headers=headers or {})

    def run(prompt: str) -> Reply:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        if usage:
            body["stream_options"] = {"include_usage": True}
        counted: dict = {}

        def chunks() -> Iterator[int]:
            with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        counted.update(event["usage"])
                    yield 1 if event.get("choices") and event["choices"][0].get("text") else 0

        reply = timed(chunks())
        reply.tokens = counted.get("completion_tokens", reply.tokens)
        return reply

    return run


def closed_loop(run: Callable[[str], Reply], texts: list[str], clients: int, requests: int) -> Step:
    """`clients` threads, each sending `requests` requests back to back (prompts rotate)."""
    step = Step(clients)
    lock = threading.Lock()

    def client(c: int) -> None:
        for k in range(requests):
            try:
                reply = run(texts[(c + k) % len(texts)])
            except Exception as exc:  # counted; the knee judges error rates
                with lock:
                    step.errors += 1
                    step.error_sample = step.error_sample or f"{type(exc).__name__}: {exc}"[:300]
                continue
            with lock:
                step.replies.append(reply)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    step.wall_s = time.perf_counter() - start
    return step


def ramp(name: str, run: Callable[[str], Reply], texts: list[str], requests: int, max_clients: int,
         log: Callable[[str], None], clients: list[int] | None = None) -> dict:
    """Clients 1, 2, 4, ... (or the `clients` given) until a step is past the knee (or `max_clients`)."""
    plan = clients or [c for c in (2 ** i for i in range(16)) if c <= max_clients]
    steps: list[Step] = []
    for n in plan:
        step = closed_loop(run, texts, n, requests)
        steps.append(step)
        log(f"{name}: {json.dumps(step.summary())}")
        if clients is None and find_knee([s.knee_row() for s in steps]).first_bad is not None:
            break
    knee = find_knee([s.knee_row() for s in steps])
    at = next((s for s in steps if knee.knee is not None and s.clients == knee.knee.offered), None)
    return {"steps": [s.summary() for s in steps], "knee_clients": at.clients if at else None,
            "knee": at.summary() if at else None,
            "past_knee": {str(int(v.step.offered)): list(v.reasons) for v in knee.verdicts if v.reasons}}


def ttft_alone(run: Callable[[str], Reply], prompt: str, rounds: int = 5, between: str | None = None) -> float:
    """Median TTFT of one prompt, alone (`rounds` tries). With `between`, that prompt runs
    (untimed) before each try: a server that reuses the last prompt's prefix
    (llama.cpp's) then prefills the whole prompt, as for a new client."""
    def once() -> float:
        if between is not None:
            run(between)
        return run(prompt).ttft_ms

    return round(statistics.median(once() for _ in range(rounds)), 1)


def bench_server(url: str, model: str, texts: list[str], *, max_tokens: int, requests: int, max_clients: int,
                 clients: list[int] | None, headers: dict[str, str] | None,
                 log: Callable[[str], None]) -> dict:
    """One server's ramp (what `fleetctl bench --task generate` measures), after one warm-up request."""
    run = completions_stream(url, model, max_tokens, headers=headers)
    try:
        run(texts[0])
    except (RuntimeError, httpx.HTTPError) as exc:
        raise WarmupFailed(str(exc)) from None
    out = ramp("fleet", run, texts, requests, max_clients, log, clients)
    out["ttft_ms_longest_prompt_alone"] = ttft_alone(run, max(texts, key=len), rounds=3)
    return out


def _ms(a: float, b: float) -> str:
    return f"{a:,.0f}/{b:,.0f}"


def steps_table(name: str, result: dict) -> Table:
    """One target's steps, 80 columns: tokens/s, TTFT and ITL percentiles, the verdict."""
    t = Table(title=f"{name}: steps", title_justify="left")
    for col in ("clients", "req", "out tok/s", "TTFT p50/95 ms", "ITL p50/95 ms", "err", "verdict"):
        t.add_column(col, justify="left" if col == "verdict" else "right")
    for s in result["steps"]:
        reasons = result["past_knee"].get(str(s["clients"]))
        verdict = "knee" if s["clients"] == result["knee_clients"] else ("past: " + "; ".join(reasons)
                                                                          if reasons else "ok")
        t.add_row(str(s["clients"]), str(s["requests"]), f"{s['output_tokens_per_s']:.1f}",
                  _ms(s["ttft_ms_p50"], s["ttft_ms_p95"]), _ms(s["itl_ms_p50"], s["itl_ms_p95"]),
                  str(s["errors"]), verdict)
    return t


def knee_table(results: dict[str, dict]) -> Table:
    """Every target at its knee, 80 columns (a target that never kept up shows dashes)."""
    t = Table(title="generation at the knee", title_justify="left")
    for col in ("target", "clients", "out tok/s", "TTFT p50/95 ms", "ITL p50/95 ms"):
        t.add_column(col, justify="left" if col == "target" else "right")
    for name, r in results.items():
        k = r.get("knee")
        if not k:
            t.add_row(name, "-", "-", "-", "-")
            continue
        t.add_row(name, str(r["knee_clients"]), f"{k['output_tokens_per_s']:.1f}",
                  _ms(k["ttft_ms_p50"], k["ttft_ms_p95"]), _ms(k["itl_ms_p50"], k["itl_ms_p95"]))
    return t
