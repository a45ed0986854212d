import sys

from weightsync.cli.main import main

sys.exit(main())
