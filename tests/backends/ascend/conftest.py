"""The ascend950 glue tests: fake_torch_npu (next to this file) stands in for torch_npu, which must never be
imported here (without CANN it breaks `import torch`)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).parent)
if HERE not in sys.path:  # --import-mode=importlib: make fake_torch_npu importable by the test modules
    sys.path.insert(0, HERE)
