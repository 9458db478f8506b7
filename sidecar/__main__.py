"""``python -m kalos_retrievers.sidecar`` is ``kalos-sidecar``."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
