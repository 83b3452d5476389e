"""What a worker holds and last did: its resident models and its last batch.

Plain records shared by the step loop (`runtimes.worker`) and the continuous
batcher (`runtimes.continuous`), so neither imports the other at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtimes.base import Adapter
from runtimes.memory import Footprint


@dataclass
class Resident:
    adapter: Adapter
    loaded_at: float
    last_used: float
    served: int = 0
    load_ms: float = 0.0
    #: Measured weights and the activation allowance (runtimes.memory).
    footprint: Footprint = Footprint(0)


#: Batches kept in the info blob's ring (`batches`): the daemon reads it every
#: METRICS_REFRESH_S and turns entries past the last sequence it saw into batch
#: metrics, so a worker may run this many batches between two reads without loss.
BATCH_RING = 64


@dataclass
class BatchStats:
    model: str = ""
    items: int = 0
    tokens: int = 0
    padded: int = 0  # items x longest (tokens)
    ms: float = 0.0
    at: float = 0.0
    returned: int = 0  # over-pulled items given back when this batch was formed


@dataclass(frozen=True)
class NotNowMemo:
    """A "not here, now" load verdict, kept so the lane is skipped without deciding again."""

    until_ns: int  # the worker's clock
    #: Left to the workers holding the model: the worker may block for new work.
    left_to_holders: bool
