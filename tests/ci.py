"""What a CI run (``CI=true``) demands of the suite, and the skips it accepts.

Under CI nothing may be skipped except a check that needs hardware or a Python the machine does
not have; those skips carry one of the reasons below (see ``conftest.py``).
"""

from __future__ import annotations

import os

import pytest
import torch

CI = os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}
NEEDS_CUDA = "needs a CUDA device"
NEEDS_PY311 = "needs Python 3.11"
ACCEPTED_SKIPS = (NEEDS_CUDA, NEEDS_PY311)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_CUDA)
