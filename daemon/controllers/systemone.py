"""`POST /v1/systemone`: typed decisions in TypeSafe's System One shape (daemon/systemone.py)."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, Request, Response, post

from fleet.catalog import load_catalog
from fleet.errors import BadRequest, FleetError, InputTooLong, ModelNotFound, Unsupported

from fleet.daemon import systemone, tasks
from fleet.daemon.defaults import stored_tasks
from fleet.daemon.core import Daemon
from fleet.daemon.fields import ignored_header
from fleet.daemon.http import answer_headers, body_is_msgpack, reply


def decision_model(daemon: Daemon, name: str) -> str:
    """The store name a request's `model` runs on: `jev-latest` is this box's default
    decision model (config `default_models.decide`, else the only stored one)."""
    if name != systemone.DEFAULT_ALIAS:
        return reads_decisions(daemon, name)
    configured = daemon.settings.default_models.get("decide")
    if configured:
        return reads_decisions(daemon, configured)
    stored = sorted(n for n, task in stored_tasks(daemon.store) if task == "decide")
    if len(stored) == 1:
        return stored[0]
    if not stored:
        raise ModelNotFound(f"{name!r} is this box's default decision model, and none is stored",
                            hint="fleetctl pull path:DIR --task decide (any causal LM) adds one")
    raise BadRequest(f"{name!r} is this box's default decision model, and {len(stored)} are stored: name one of "
                     f"{', '.join(stored)}, or set default_models.decide in config.toml", param="model")


def reads_decisions(daemon: Daemon, name: str) -> str:
    """`name`, unless it is a stored generator fleet reads no decisions from. A
    transformers generator answers them from the weights its worker holds
    (runtimes/decide_shared.py); another (a GGUF's llama.cpp runtime reads no label
    logits) is refused with how to pull its weights as a decision model (the
    catalog's `<name>-decide` where there is one)."""
    try:
        daemon.manifest(name, "decide")  # cached: a decision model or a generator costs no look-up here
        return name
    except ModelNotFound:
        return name  # the route answers it (a remote box's, an upstream's, or none)
    except BadRequest:
        pass  # stored, for another task
    stored = daemon.aliases.resolve(name)
    manifest = daemon.store.get(stored)
    if manifest.task != "generate":
        return name
    twin = f"{stored}-decide"
    try:
        entry = load_catalog(daemon.settings.home).find(twin)
    except FleetError:
        entry = None
    if entry is not None and entry.task == "decide":
        how = f"fleetctl pull {twin}"
    elif manifest.source.startswith("hf:"):
        how = f"fleetctl pull {manifest.source} --task decide --name {twin}"
    else:
        how = f"pull its source again with --task decide --name {twin}"
    raise BadRequest(f"{stored!r} is a {manifest.runtime} generator, which reads no decisions; they are read from "
                     f"a transformers causal LM, stored as a generator or as a decision model (task decide): {how}",
                     param="model")


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
