"""The key/value caches of decision states (runtimes/adapters/decide.py): kept between
batches (`PrefixCache`), read from a forward's cache (`plain_layers`) and gathered
into one cache for a micro-batch of packs (`gathered`)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from fleet.errors import ModelLoadFailed


class PrefixCache:
    """States' key/value caches kept between batches, least recently used out first,
    within PREFIX_CACHE_BYTES: an agent asking new questions of the same state pays
    its prefix once. Keyed by the prefix's token ids."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.entries: OrderedDict[bytes, tuple[list[tuple[Any, Any]], int]] = OrderedDict()

    def get(self, key: bytes) -> list[tuple[Any, Any]] | None:
        hit = self.entries.get(key)
        if hit is None:
            return None
        self.entries.move_to_end(key)
        return hit[0]

    def put(self, key: bytes, layers: list[tuple[Any, Any]]) -> None:
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        if size > self.limit or key in self.entries:
            return
        while self.used + size > self.limit:
            _, (_, old) = self.entries.popitem(last=False)
            self.used -= old
        self.entries[key] = (layers, size)
        self.used += size

    def clear(self) -> None:
        self.entries.clear()
        self.used = 0


def plain_layers(cache: Any) -> list[tuple[Any, Any]]:
    """Each layer's (keys, values) of a cache of full-attention layers; others are refused."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if layers is None or any(type(layer) is not DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers or []}) or [type(cache).__name__]
        raise ModelLoadFailed(f"decisions read full-attention key/value caches; this model uses {', '.join(kinds)}")
    return [(layer.keys, layer.values) for layer in layers]


def gathered(states: list[list[tuple[Any, Any]]], width: int, rows: Any) -> Any:
    """A cache whose row r holds state `rows[r]`'s keys and values, right-padded to `width`
    (the padding is masked; zeros keep it finite)."""
    from transformers import DynamicCache

    layers = []
    for layer in range(len(states[0])):
        k0, v0 = states[0][layer]
        keys = k0.new_zeros((len(states), k0.shape[1], width, k0.shape[3]))
        values = v0.new_zeros((len(states), v0.shape[1], width, v0.shape[3]))
        for s, state in enumerate(states):
            k, v = state[layer]
            keys[s, :, : k.shape[2]] = k[0]
            values[s, :, : v.shape[2]] = v[0]
        layers.append((keys.index_select(0, rows), values.index_select(0, rows)))
    return DynamicCache(ddp_cache_data=layers)
