"""The ``weightsync`` command: ``demo``, ``doctor``, ``migrate``."""

from importlib.metadata import version as _version

__version__ = _version("weightsync-cli")
"""This distribution's version (from its installed metadata)."""
