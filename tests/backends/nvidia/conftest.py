"""The nvidia_sm100 kernels run here under Triton's interpreter, on CPU tensors, on tiny shapes.

TRITON_INTERPRET must be set before triton decorates the kernels, so it is set at collection time,
before any kernel module is imported; the kernels then multiply in float32 (bf16 dots are wrong
under the interpreter), which the comparisons' tolerances allow for.
"""

from __future__ import annotations

import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (tox installs it for the interpreted kernel tests)")
