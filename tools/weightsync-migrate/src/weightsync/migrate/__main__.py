"""``python -m weightsync.migrate``: the same command as ``weightsync migrate``, without the umbrella CLI."""

from __future__ import annotations

import sys

from weightsync.migrate.cli import main

if __name__ == "__main__":
    sys.exit(main())
