"""The fault suite: makes tests/fault/fault_harness.py importable
(the project runs pytest in importlib mode)."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
