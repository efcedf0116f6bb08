"""``python -m tests.chaos``: the fault-injection scenarios from the command line (tests/chaos/scenarios.py)."""
import sys

from tests.chaos.scenarios import main

sys.exit(main())
