"""One streaming generation, as its routes read it: text and tool-call pieces as the
worker publishes them, then the result.

The worker publishes partial results (fleet.messages.GenerateChunk) while the item
stays claimed; the broker hands them to the stream's `asyncio.Queue`, and the final
result (the whole text, every call) ends it, filling in whatever no piece carried.
A piece is taken only where it continues what was sent (its `start`): a piece sent
twice, or one from a worker that restarted the generation, is skipped.

Tool calls stream as the model writes them (runtimes.adapters.tools, `call_pieces`): a call's
first piece names it, the next ones carry its arguments' characters; routes that
stream calls whole (Ollama, Responses) read `deltas()`, which leaves them out.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import NamedTuple

import msgspec

from fleet.messages import CallPiece, GenerateChunk, GenerateResult
from fleet.messages import TokenLogprob as WireLogprob
from fleet.protocol import GenerateRequest
from fleet.local_queue import Done

from fleet.daemon.aliases import resolved
from fleet.daemon.core import Daemon
from fleet.daemon.tasks import check_generate, generate_tokens, observe_generation, target_model

_encode = msgspec.msgpack.Encoder().encode
_generate = msgspec.msgpack.Decoder(GenerateResult)
_chunk = msgspec.msgpack.Decoder(GenerateChunk)


class Part(NamedTuple):
    """What a stream adds at one step: text (with the logprobs of the tokens it
    completes) and pieces of tool calls."""

    text: str
    logprobs: list[WireLogprob] | None
    calls: list[CallPiece]


class TextStream:
    """One streaming generation (module doc)."""

    def __init__(self, daemon: Daemon, req: GenerateRequest, payload: bytes) -> None:
        req, payload = resolved(daemon.aliases, req, payload, _encode)
        check_generate(req)
        self.daemon, self.model = daemon, req.model
        self.pieces: asyncio.Queue[Done] = asyncio.Queue()
        self.task = asyncio.ensure_future(daemon.submit(
            "generate", target_model(daemon, "generate", req.model, req.adapter), payload,
            tokens=generate_tokens(req, payload), timeout_ms=req.timeout_ms, on_partial=self.pieces.put_nowait,
        ))
        self.sent = 0  # characters of the final text already sent
        self.logprobs_sent = 0  # token logprobs already sent
        self.call_sent: list[int] = []  # characters of each call's arguments already sent
        self.result: GenerateResult | None = None
        self._next: asyncio.Future[Done] | None = None

    async def _wait(self) -> Done | None:
        """The next partial result, or None once the final result is in (and no piece is left)."""
        if self._next is None:
            self._next = asyncio.ensure_future(self.pieces.get())
        await asyncio.wait({self.task, self._next}, return_when=asyncio.FIRST_COMPLETED)
        if self._next.done():
            piece, self._next = self._next.result(), None
            return piece
        # The broker hands over every piece before it resolves the final result.
        if self.pieces.empty():
            self._next.cancel()
            self._next = None
            return None
        return await self._wait()

    async def started(self) -> None:
        """Wait for the first piece or the end: an error before any text raises here,
        so the client gets it with its HTTP status."""
        if self._next is None:
            self._next = asyncio.ensure_future(self.pieces.get())
        await asyncio.wait({self.task, self._next}, return_when=asyncio.FIRST_COMPLETED)
        if self.task.done() and not self._next.done():
            self.task.result()

    async def deltas(self) -> AsyncIterator[tuple[str, list[WireLogprob] | None]]:
        """New text with the logprobs of the tokens it completes, in order, without the
        calls (the result holds them whole)."""
        async for part in self.parts():
            if part.text or part.logprobs:
                yield part.text, part.logprobs

    async def parts(self) -> AsyncIterator[Part]:
        """New text and call pieces, in order; the final result fills in what no piece carried."""
        try:
            while (done := await self._wait()) is not None:
                piece = _chunk.decode(done.result)
                text, logprobs = "", None
                if piece.start == self.sent and piece.text:
                    text, logprobs = piece.text, piece.logprobs
                    self.sent += len(text)
                    self.logprobs_sent += len(logprobs or ())
                calls = [c for c in piece.calls if self._continues(c)]
                if text or calls:
                    yield Part(text, logprobs, calls)
            self.result = res = _generate.decode(self.task.result().body)
            observe_generation(self.daemon, self.model, self.task.result(), res)
            rest = res.logprobs[self.logprobs_sent:] if res.logprobs is not None else None
            text = res.text[self.sent:]
            self.sent, self.logprobs_sent = len(res.text), self.logprobs_sent + len(rest or ())
            calls = self._unsent_calls(res)
            if text or rest or calls:
                yield Part(text, rest, calls)
        finally:
            if self._next is not None:
                self._next.cancel()
            if not self.task.done():
                # The client went away: the broker cancels the queue item, and the
                # worker drops the sequence at its next step.
                self.task.cancel()

    def _continues(self, piece: CallPiece) -> bool:
        """Does a call piece continue what was sent (a new call's first, or the next
        characters of one begun)? Taken if so."""
        if piece.index == len(self.call_sent) and piece.start == 0:
            self.call_sent.append(len(piece.arguments))
            return True
        if piece.index < len(self.call_sent) and piece.start == self.call_sent[piece.index] and piece.arguments:
            self.call_sent[piece.index] += len(piece.arguments)
            return True
        return False

    def _unsent_calls(self, res: GenerateResult) -> list[CallPiece]:
        """The result's calls past what pieces carried: one no piece began, whole; the
        rest of the arguments of one begun."""
        out = []
        for i, call in enumerate(res.tool_calls):
            if i >= len(self.call_sent):
                out.append(CallPiece(i, call.name, 0, call.arguments))
            elif len(call.arguments) > self.call_sent[i]:
                out.append(CallPiece(i, call.name, self.call_sent[i], call.arguments[self.call_sent[i]:]))
        return out
