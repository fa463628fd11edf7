"""`python -m benchmarks.wan ...`: the WAN benchmark (main.py), `pings`, `combine`, or one of the processes
inside the testbed's namespaces (`_ROLE`)."""

import sys

from benchmarks.wan.main import main

sys.exit(main())
