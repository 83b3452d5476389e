"""fleet: serve a fleet of small open models from one box.

This package is the client side (CLI, store, catalog, contract types). It must
stay light: importing it never imports torch or transformers.
"""

__version__ = "0.1.0"
