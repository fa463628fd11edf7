"""`python -m benchmarks.wire ...`: the wire benchmark (main.py), or one of its own processes (`_ROLE`)."""

import sys

from benchmarks.wire.main import main

sys.exit(main())
