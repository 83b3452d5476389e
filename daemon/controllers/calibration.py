"""`POST /v1/models/{model_id}/calibration`: fit a decision model's temperatures
(daemon/calibration.py; `fleetctl calibrate`). The operator's: it writes models.toml."""

from __future__ import annotations

import msgspec
from litestar import Controller, Request, Response, post

from fleet.errors import BadRequest

from fleet.daemon.calibration import CalibrateRequest, calibrate
from fleet.daemon.core import Daemon
from fleet.daemon.http import body_is_msgpack, reply
from fleet.daemon.operator import operator_only


class CalibrationController(Controller):
    path = "/v1/models"

    @post("/{model_id:str}/calibration", status_code=200, guards=[operator_only])
    async def calibration(self, request: Request, daemon: Daemon, model_id: str) -> Response:
        body = await request.body()
        try:
            req = (msgspec.msgpack.decode(body, type=CalibrateRequest) if body_is_msgpack(request)
                   else msgspec.json.decode(body, type=CalibrateRequest))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BadRequest(f"invalid calibration request: {exc}") from None
        return reply(request, await calibrate(daemon, model_id, req))
