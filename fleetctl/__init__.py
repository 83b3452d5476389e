"""fleetctl: the CLI verbs and the Python client of fleet.

What every process shares (errors, settings, contract types, catalog, store) is
the kernel package `fleet`. This package must stay light: importing it never
imports torch or transformers.
"""

from fleet import __version__

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
