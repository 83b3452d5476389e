"""`POST /v1/systemone`: typed decisions in TypeSafe's System One shape (daemon/systemone.py)."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, Request, Response, post

from fleet.errors import FleetError, InputTooLong, Unsupported

from fleet.daemon import systemone, tasks
from fleet.daemon.defaults import decision_model
from fleet.daemon.core import Daemon
from fleet.daemon.fields import ignored_header
from fleet.daemon.http import answer_headers, body_is_msgpack, reply


def is_adapter(daemon: Daemon, name: str) -> bool:
    """Is `name` a LoRA adapter stored here (False for one only another box stores)?"""
    try:
        return daemon.manifest(name, "decide").base is not None
    except FleetError:
        return False


def read_body(body: bytes, *, msgpack: bool) -> Any:
    """The body as plain data; one that does not parse is a validation error, as the
    original server answers it (422, `json_invalid` at the byte it stopped)."""
    try:
        return msgspec.msgpack.decode(body) if msgpack else msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        where = str(exc).rpartition("(byte ")[2].rstrip(")")
        loc = [int(where)] if where.isdigit() else []
        raise systemone.Invalid([systemone.problem(loc, "JSON decode error", "json_invalid", {},
                                                   {"error": str(exc)})]) from None


class SystemOneController(Controller):
    path = "/v1"

    @post("/systemone", status_code=200)
    async def systemone(self, request: Request, daemon: Daemon) -> Response:
        try:
            parsed = systemone.parse(read_body(await request.body(), msgpack=body_is_msgpack(request)))
        except systemone.Invalid as exc:
            return reply(request, {"detail": exc.detail}, status=exc.status)
        if parsed.unsupported:
            raise Unsupported(parsed.unsupported)
        model = decision_model(daemon, parsed.model)
        # `x_adapter` must be a stored LoRA adapter of the model (400 naming its adapters).
        lora = tasks.target_model(daemon, "decide", model, parsed.adapter) if parsed.adapter else None
        try:
            res, answer = await tasks.decide(daemon, parsed.request(model))
        except InputTooLong as exc:
            exc.status = 413  # over the model's budget: System One's status for it
            raise
        body = {"model": model, "answers": systemone.answers(parsed, res),
                "usage": {"input_tokens": res.input_tokens, "output_tokens": 0}}
        if lora is not None or is_adapter(daemon, model):  # whose temperatures its answers took
            body.update({**({"x_adapter": lora} if lora else {}),
                         "x_temperatures_from": res.temperatures_from or None})
        headers = {**answer_headers(answer), **ignored_header(parsed.ignored)}
        return reply(request, body, headers=headers)
