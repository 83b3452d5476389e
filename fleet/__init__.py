"""fleet's kernel: what every process shares (the API daemon, the workers, the CLI).

Errors, settings, the contract Structs, the catalog, the store and pulling,
the worker<->daemon messages and control commands, pins. This package imports no
other package of the project, and nothing heavy: importing it never imports torch.
"""

import os as _os

__version__ = "0.36.0"

# The server's packages, fleet.daemon, fleet.runtimes, fleet.local_queue and fleet.bench:
# the wheel installs them inside this folder (pyproject's package-dir); in a checkout they
# are the repository's folders beside it, so there the repository's root joins this
# package's path. Nothing installs them as top-level modules.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isfile(
        _os.path.join(_root, "daemon", "__init__.py")):
    __path__.append(_root)  # noqa: F821 (a package's own __path__)
del _root
