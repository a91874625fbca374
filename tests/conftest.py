"""Shared fixtures of the recorder tests: a seeded global RNG and a fresh bundle directory.

Under ``CI=true`` the run also refuses to lose evidence quietly: a missing optional test
dependency (transformers, accelerate, lightning, NumPy, Opacus, PyTorch Geometric, Ignite, PEFT,
diffusers, GPyTorch, Pyro, pytorch_optimizer, headless Chromium) stops the run before any test
instead of skipping the tests that need it; any other skip fails unless it says it needs a
device or a Python this machine lacks (``ci.ACCEPTED_SKIPS``); Hypothesis runs derandomized and
without a database. Hypothesis keeps its files under the user's cache directory, outside the
checkout.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir

# Bytecode is cached even where the environment says not to (PYTHONDONTWRITEBYTECODE=1, as on
# this project's machines): every xdist worker and every fresh interpreter a test starts (the
# CLI, torchrun's ranks, the benchmarks) compiled each module it imported again (the test
# extras are installed with --no-compile), and pytest rewrote every test file's asserts again:
# half of each worker's collection time (40 s of CPU against 19 s with the cache).
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

sys.path.insert(0, str(Path(__file__).parent))  # `import models` from every test file

from ci import ACCEPTED_SKIPS, CI  # noqa: E402

# The test extras (pyproject.toml) whose absence would otherwise skip tests.
OPTIONAL_MODULES = ("transformers", "accelerate", "lightning", "numpy", "opacus", "torch_geometric",
                    "ignite", "peft", "diffusers", "gpytorch", "pyro", "pytorch_optimizer",
                    "monai", "kornia", "x_transformers", "vector_quantize_pytorch", "einops",
                    "torchdiffeq", "zuko", "schedulefree", "pytorch_metric_learning",
                    "trl", "datasets", "sentence_transformers", "stable_baselines3", "gymnasium",
                    "skorch", "pytorch_tabnet", "optuna",
                    "torchcrf", "torchmetrics", "pytorch_msssim",
                    "botorch", "keras", "pytorch_forecasting", "poutyne", "deepxde")
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")

# Hypothesis's files (example database, constants cache) go to the user's cache, not the checkout.
set_hypothesis_home_dir(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                        / "nanreplay-hypothesis")
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.load_profile("ci" if CI else "default")

# Every Python a test starts (the CLI in a fresh interpreter, torchrun's workers, a user's
# script) imports this checkout's packages, not the checkout an editable install points at
# (a git worktree's suite would otherwise test another tree's replay).
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(Path(__file__).resolve().parent.parent), *filter(None, [os.environ.get("PYTHONPATH")])])

# The models are tiny: one intra-op thread is faster than two fighting over a busy machine.
torch.set_num_threads(1)


def missing_test_dependencies() -> list[str]:
    missing = [m for m in OPTIONAL_MODULES if importlib.util.find_spec(m) is None]
    if not any(shutil.which(n) for n in CHROMIUM_NAMES):
        missing.append("chromium (apt-get install -y chromium chromium-driver)")
    return missing


def pytest_configure(config):
    if CI and (missing := missing_test_dependencies()):
        raise pytest.UsageError(f"CI=true and {', '.join(missing)} not installed: the tests "
                                "that need them would be skipped; install the test extras "
                                "(pip install -e \".[test]\") and Chromium, as the README's "
                                "test command does")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI a skipped test is a failed one, unless it needs a device or a Python version
    this machine lacks."""
    outcome = yield
    report = outcome.get_result()
    if CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not any(ok in reason for ok in ACCEPTED_SKIPS):
            report.outcome = "failed"
            report.longrepr = f"skipped under CI=true, where nothing may be skipped: {reason}"


# The files whose tests take longest (torchrun's processes, the benchmark scripts, Trainers,
# torch.compile), run first: xdist then shares the rest out around them instead of one worker
# finishing a slow file alone at the end of the run.
SLOW_FIRST = ("test_torchrun.py", "test_benchmarks_smoke.py", "test_huggingface.py",
              "test_compiled.py", "test_image_registration.py", "test_compiled_training.py",
              "test_fidelity.py", "test_recorder_api.py", "test_docs_examples.py",
              "test_neural_odes.py", "test_trl_stack.py", "test_botorch_bo.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """accelerate keeps process-wide state (``AcceleratorState``: the mixed precision the first
    ``Accelerator`` or ``Trainer`` fixed): reset it as each test file ends, as accelerate's own
    test cases do, so the next file's ``Accelerator(mixed_precision=...)`` is not refused by
    whichever file xdist happened to run before it in that worker."""
    if (nextitem is None or nextitem.path != item.path) and "accelerate.state" in sys.modules:
        state = sys.modules["accelerate.state"]
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same global torch RNG state (deterministic weights)."""
    torch.manual_seed(0)
    yield


# torch.distributions' KL registry as torch ships it, read before any test module is imported:
# importing Pyro (tests/test_pyro_svi.py, at collection) registers Pyro's own KL functions for
# torch's distribution types (``Independent`` x ``Independent``), for the whole process
TORCH_KL = dict(torch.distributions.kl._KL_REGISTRY)


@pytest.fixture(autouse=True)
def torch_kl_registry(request):
    """torch's own KL registry for every test but Pyro's: a ``kl_divergence`` of two
    ``Independent`` distributions otherwise runs Pyro's function, and a replay names Pyro's line
    as the op's source instead of the test model's, by whether xdist collected Pyro's tests in
    that worker."""
    kl = torch.distributions.kl
    if "pyro" in request.module.__name__ or kl._KL_REGISTRY == TORCH_KL:
        yield
        return
    saved = dict(kl._KL_REGISTRY)
    kl._KL_REGISTRY.clear()
    kl._KL_REGISTRY.update(TORCH_KL)
    kl._KL_MEMOIZE.clear()
    try:
        yield
    finally:
        kl._KL_REGISTRY.clear()
        kl._KL_REGISTRY.update(saved)
        kl._KL_MEMOIZE.clear()


@pytest.fixture(autouse=True)
def validation_at_torch_default():
    """torch.distributions' validation at torch's default (on), as a training script and the
    nanreplay process start: a torch.compile elsewhere in this test process turned it off for
    the process (dynamo's patcher calls ``set_default_validate_args(False)``). For every test:
    one whose model's distribution refuses a value passes or fails by the order xdist ran the
    tests in otherwise."""
    before = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(True)
    yield
    torch.distributions.Distribution.set_default_validate_args(before)


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    return tmp_path / "bundles"


@pytest.fixture
def in_tests_dir(monkeypatch):
    """Run from tests/, as a user runs nanreplay from their project root: the replay imports a
    bundle's factory (``"gan_models:make_gan"``) only from the working directory, the one
    place whose modules it trusts. A module opts in with
    ``pytestmark = pytest.mark.usefixtures("in_tests_dir")``."""
    monkeypatch.chdir(Path(__file__).parent)


@pytest.fixture(scope="session")
def toy(tmp_path_factory) -> Path:
    """The bundle of examples/train_toy.py, made once per session (see tests/bundles.py)."""
    from bundles import shared_toy_bundle

    return shared_toy_bundle(tmp_path_factory)
