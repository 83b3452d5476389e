"""fleet's kernel: what every process shares (the API daemon, the workers, the CLI).

Errors, settings, the contract Structs, the catalog, the store and pulling,
the worker<->daemon messages and control commands, pins. This package imports no
other package of the project, and nothing heavy: importing it never imports torch.
"""

__version__ = "0.26.0"
