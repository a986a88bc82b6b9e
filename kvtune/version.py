"""kvtune's version, in a module of its own so that any stage can stamp files with it without
importing the package's public API."""

__version__ = "0.1.0"
