"""fleet: serve a fleet of small open models from one box.

This package is the client side (CLI, store, catalog, contract types). It must
stay light: importing it never imports torch or transformers.
"""

__version__ = "0.1.0"

#: Imported on first use (module `__getattr__`), so `import fleetctl` stays light:
#: the client pulls in httpx and the contract types only when asked for.
_LAZY = {"Client": "fleetctl.client", "AsyncClient": "fleetctl.client", "FleetEmbeddings": "fleetctl.client"}

__all__ = ["AsyncClient", "Client", "FleetEmbeddings", "__version__"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fleetctl' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
