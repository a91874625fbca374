"""Shared fixtures of the recorder tests: a seeded global RNG and a fresh bundle directory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # `import models` from every test file

# The models are tiny: one intra-op thread is faster than two fighting over a busy machine.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same global torch RNG state (deterministic weights)."""
    torch.manual_seed(0)
    yield


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    return tmp_path / "bundles"


@pytest.fixture(scope="session")
def toy(tmp_path_factory) -> Path:
    """The bundle of examples/train_toy.py, made once per session (see tests/bundles.py)."""
    from bundles import shared_toy_bundle

    return shared_toy_bundle(tmp_path_factory)
