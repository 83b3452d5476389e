"""`POST /v1/promotions`: evaluate a candidate against an alias's version, and promote it
only when it is no worse (daemon.promotions); `GET /v1/promotions/{promotion_id}`: a
promotion package (fleet.promotions).

Body: `{candidate, alias, eval, margin?, force?, reason?, owner?, canary_percent?, judge?}`,
`eval` being the evaluation file's text (JSONL; fleet.evaluation says each task's
lines). Replies: the package (200); a regression past the margin is 409
`promotion_refused` naming every metric with both versions' numbers (the package of
the refused attempt is kept). `force` needs a `reason`. `judge` names a stored generator
that grades a generate evaluation's answer pairs (fleet.judge); another task's model is a
400. Promoting is the operator's.
"""

from __future__ import annotations

import msgspec
from litestar import Controller, Request, Response, get, post

from fleet.aliases import check_percent, validate_alias
from fleet.catalog import validate_name
from fleet.errors import BadRequest, ModelNotFound
from fleet.evaluation import parse_eval

from fleet.daemon import promotions
from fleet.daemon.controllers.aliases import body_of, check_reason, owner_of
from fleet.daemon.core import Daemon
from fleet.daemon.http import reply
from fleet.daemon.operator import operator_only


class PromoteRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    candidate: str
    alias: str
    #: The evaluation file's text (JSONL).
    eval: str
    #: How much worse (absolute, on each metric) the candidate may be.
    margin: float = 0.0
    force: bool = False
    reason: str = ""
    owner: str | None = None
    #: > 0: send this share of the alias's clients to the candidate, the version staying.
    canary_percent: float = 0.0
    #: A stored generator that grades each pair of answers of a generate evaluation.
    judge: str | None = None


class PromotionsController(Controller):
    path = "/v1/promotions"

    @post("", guards=[operator_only], status_code=200)
    async def promote(self, request: Request, daemon: Daemon) -> Response:
        body = await body_of(request, PromoteRequest)
        validate_alias(body.alias)
        validate_name(body.candidate)
        if body.judge is not None:
            validate_name(body.judge)
        owner, reason = owner_of(body.owner), check_reason(body.reason)
        if not 0.0 <= body.margin <= 1.0:
            raise BadRequest(f"margin is an absolute difference of metrics between 0 and 1, got {body.margin:g}",
                             param="margin")
        if body.force and not reason.strip():
            raise BadRequest("--force needs a --reason: it is kept in the package and the history", param="reason")
        check_percent(body.canary_percent)
        if not daemon.store.exists(body.candidate):
            raise ModelNotFound(f"model {body.candidate!r} is not in the store",
                                hint="fleetctl list shows what is pulled", param="candidate")
        ev = parse_eval(body.eval, daemon.store.get(body.candidate).task)
        package = await promotions.promote(daemon, alias=body.alias, candidate=body.candidate, ev=ev,
                                           margin=body.margin, force=body.force, reason=reason, owner=owner,
                                           canary_percent=body.canary_percent, judge=body.judge)
        return reply(request, package)

    @get("/{promotion_id:str}")
    async def show(self, request: Request, daemon: Daemon, promotion_id: str) -> Response:
        return reply(request, await daemon.aliases.package(promotion_id))
