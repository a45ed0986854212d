"""The ``weightsync`` command: ``demo``, ``doctor``, ``migrate``."""
