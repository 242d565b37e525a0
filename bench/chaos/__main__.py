"""`python -m bench.chaos`: one seeded chaos run (run.py says how)."""

import sys

from .run import main

sys.exit(main())
