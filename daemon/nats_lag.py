"""Several boxes (--nats): each model's JetStream backlog on `/metrics`, for dashboards and autoscalers.

The cluster reads each stored model's work consumer (`work_<model>` on FLEET_WORK) at
every heartbeat and hands (model, pending, unacked) to its `on_lag` hook; `LagGauges`
is that hook. It sets, per model:
    fleet_nats_pending_messages        waiting in JetStream, taken by no box (the queue depth)
    fleet_nats_unacked_messages        taken by a box, not answered yet
    fleet_nats_consumer_lag_messages   pending + unacked: the number KEDA's nats-jetstream
                                       scaler computes for the same consumer
    fleet_nats_oldest_wait_seconds     age of the oldest waiting request (0 when none waits)
The age is the JetStream timestamp of the first message past the consumer's delivered
sequence on the model's subject (one consumer info and one message get, only while
something waits; at most one read per model in flight). Boxes share wall time (the
deadline headers already assume it), so now minus that timestamp is the wait.

Every box storing a model exports the same JetStream numbers for it: aggregate over
boxes with `max by (model)`, not `sum`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from fleet.daemon.cluster import STREAM, consumer_name, work_subject
from fleet.daemon.metrics import Metrics

log = logging.getLogger("fleet.cluster")


class LagGauges:
    """The cluster's `on_lag` hook: the four `fleet_nats_*` gauges of a model."""

    def __init__(self, metrics: Metrics, js: Callable[[], Any]) -> None:
        self.metrics = metrics
        #: The cluster's JetStream context now (it changes when the box moves to another server).
        self._js = js
        self._reading: dict[str, asyncio.Task] = {}

    def __call__(self, model: str, pending: int, unacked: int) -> None:
        self.metrics.set_nats_lag(model, pending, unacked)
        if pending == 0:
            self.metrics.set_nats_oldest_wait(model, 0.0)
            return
        if model in self._reading:  # the last read has not come back: it sets the gauge
            return
        task = asyncio.get_running_loop().create_task(self._read_oldest(model), name=f"nats-oldest-{model}")
        self._reading[model] = task
        task.add_done_callback(lambda _t: self._reading.pop(model, None))

    async def _read_oldest(self, model: str) -> None:
        try:
            age = await self.oldest_wait_s(self._js(), model)
        except Exception as exc:  # JetStream busy or the message just taken: the next heartbeat reads again
            log.debug("reading the oldest waiting request of %s failed: %s", model, exc)
            return
        self.metrics.set_nats_oldest_wait(model, age)

    @staticmethod
    async def oldest_wait_s(js: Any, model: str) -> float:
        """Seconds the oldest request of `model` not yet delivered to any box has waited (0: none)."""
        from nats.js.errors import NotFoundError

        info = await js.consumer_info(STREAM, consumer_name(model))
        if info.num_pending == 0:
            return 0.0
        try:
            msg = await js.get_msg(STREAM, seq=info.delivered.stream_seq + 1, next=True, subject=work_subject(model))
        except NotFoundError:  # taken (or expired) since the consumer info
            return 0.0
        return max(0.0, time.time() - msg.time.timestamp())  # nats.py: the stored time, in UTC
