"""Steps that a failed decomposition ends (``torch.linalg.LinAlgError``): an exact GP whose
learned lengthscale makes its kernel too smooth for float32's jitter, a whitening layer on a
batch with a dead sensor, each sample's camera matrix inverted where one is blank, and a ZCA
layer given a NaN its own standardisation made. The op raises inside one module's forward
before any hook sees a non-finite value (and mostly from a finite matrix): the recorder wrote
no bundle, and the user only had the traceback. Now the step's bundle is written (``reason``
``linalg``), the error reaches the loop unchanged with the summary as a note, and
``nanreplay`` names the module, the op and whether float64 makes the matrix fail too."""

from __future__ import annotations

import json
from pathlib import Path

import linalg_error_models as M
import pytest
import torch
from bundles import invoke_cli, nanreplay_json
from torch import nn

from recorder import FlightRecorder

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _raised(out_dir: Path, run) -> tuple[int, Path]:
    """Run the loop ``run(steps)`` (it appends each step it starts); the user's own error
    must reach it as it was raised: a LinAlgError, not a NonFiniteError, noted with the
    summary. Returns the step it died at and the bundle."""
    steps: list[int] = []
    with pytest.raises(torch.linalg.LinAlgError) as info:
        run(steps)
    err = info.value
    assert type(err) is torch.linalg.LinAlgError, type(err)
    notes = getattr(err, "__notes__", [])
    bundles = sorted(out_dir.glob("*.nan"))
    assert len(bundles) == 1, bundles
    assert any(n.startswith(f"nanreplay: a matrix decomposition failed at step {steps[-1]} ")
               and str(bundles[0]) in n for n in notes), notes
    return steps[-1], bundles[0]


def _check(rep: dict, step: int, module: str, op: str, cause: str, samples: list[int]) -> None:
    o = rep["origin"]
    assert (rep["event"]["step"], rep["reproduced"], o["phase"], o["module"], o["op"],
            rep["cause"], o["samples"]) == (step, True, "forward", module, op, cause, samples), \
        json.dumps({k: rep[k] for k in ("origin", "cause", "hint", "problems")}, indent=1)
    assert o["source"].startswith("linalg_error_models.py:"), o["source"]


def test_gp_lengthscale_too_smooth_for_float32_jitter_is_precision(out_dir):
    """An exact GP on 16 points with a jitter of 1e-7: as the learned lengthscale grows, the
    kernel's eigenvalues fall below float32's rounding of it, and cholesky fails at step 14.
    In float64 the matrix is positive-definite (its smallest eigenvalue is the jitter):
    ``precision``, with jitter scaled to the matrix, cholesky_ex or float64 as the hint, and
    the step re-run in float64 is finite."""
    model = M.make_gp()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x, y = M.gp_data()

    def run(steps):
        with FlightRecorder(model, opt, out_dir=out_dir, factory="linalg_error_models:make_gp"):
            for step in range(40):
                steps.append(step)
                opt.zero_grad()
                model(x, y).backward()
                opt.step()

    step, bundle = _raised(out_dir, run)
    assert step == 14
    rep = nanreplay_json(bundle, "--try", "dtype=float64")
    _check(rep, 14, "mll", "aten.linalg_cholesky_ex", "precision", [])
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]
    assert "positive-definite in float64" in rep["hint"] and "cholesky_ex" in rep["hint"] \
        and "jitter" in rep["hint"], rep["hint"]


def _dead_sensor_loop(name: str, out_dir: Path):
    """The loop of ``make_<name>`` over six batches whose sensor 2 reads 0 from step 3, for
    :func:`_raised`."""
    model = getattr(M, f"make_{name}")()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()

    def run(steps):
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory=f"linalg_error_models:make_{name}"):
            for step, (x, y) in enumerate(M.whiten_batches(6, dead_at=3)):
                steps.append(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()

    return run


def test_whitening_a_batch_with_a_dead_sensor_is_invalid(out_dir):
    """A whitening layer factors the batch covariance with cholesky and no ridge; at step 3
    sensor 2 reads 0 for the whole batch, so the covariance has a zero row: not
    positive-definite in exact arithmetic either, ``invalid``; the whole batch made the
    matrix, so no sample is named."""
    step, bundle = _raised(out_dir, _dead_sensor_loop("whiten", out_dir))
    assert step == 3
    rep = nanreplay_json(bundle)
    _check(rep, 3, "whiten", "aten.linalg_cholesky_ex", "invalid", [])
    assert "not positive-definite in exact arithmetic too" in rep["hint"] \
        and "ridge" in rep["hint"], rep["hint"]
    info = invoke_cli(bundle, "--info").stdout.splitlines()  # (nothing re-run)
    assert info[1] == "event      step 3, phase forward, linalg", info
    assert info[2].startswith("detail     torch.linalg.LinAlgError: linalg.cholesky: "), info


def test_inverse_of_a_blank_camera_matrix_names_its_sample(out_dir):
    """Each sample's pixel is unprojected through torch.linalg.inv of its camera matrix; at
    step 2 record 5's camera is a blank record of zeros: singular in exact arithmetic,
    ``invalid``, and as the batch holds one matrix per sample, sample 5 is named."""
    model = M.make_raynet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crit = nn.MSELoss()

    def run(steps):
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="linalg_error_models:make_raynet"):
            for step, (cams, pix, t) in enumerate(M.ray_batches(6, blank_at=2, row=5)):
                steps.append(step)
                opt.zero_grad()
                crit(model(cams, pix), t).backward()
                opt.step()

    step, bundle = _raised(out_dir, run)
    assert step == 2
    rep = nanreplay_json(bundle, "--try", "drop=5", "--try", "dtype=float64")
    _check(rep, 2, "unproject", "aten.linalg_inv_ex", "invalid", [5])
    assert "singular in exact arithmetic too" in rep["hint"] and "pinv" in rep["hint"], \
        rep["hint"]
    # without the blank record the step runs on; float64 fails as float32 did
    drop, wide = rep["what_if"]
    assert drop["finite"] is True, drop
    assert "linalg.inv" in wide["error"] and "at step 2" in wide["error"], wide


def test_eigh_of_a_nan_the_layer_made_blames_the_op_that_made_it(out_dir):
    """A ZCA layer standardises each feature with no eps (0/0 for the dead sensor of step
    3) and then calls eigh on the NaN correlation matrix, which fails to converge inside the
    same forward: the op that made the NaN is named, aten.div, ``invalid`` as for any forward
    origin, with eigh's failure as a note."""
    step, bundle = _raised(out_dir, _dead_sensor_loop("zca", out_dir))
    assert step == 3
    rep = nanreplay_json(bundle)
    _check(rep, 3, "zca", "aten.div", "invalid", list(range(32)))
    assert any("aten._linalg_eigh raised on the nan that aten.div made" in p
               for p in rep["problems"]), rep["problems"]


@pytest.mark.parametrize("kind", ["module", "function"])
def test_cholesky_in_the_loss_fn_is_named_in_the_loss(out_dir, kind):
    """The GP as GPyTorch-style loops write it: the model returns the kernel matrix and the
    loss_fn (the marginal likelihood: an nn.Module, or a plain function called through
    ``rec.loss_fn``) factors it. The failure is in the loss: module ``<loss>``, phase
    ``loss``, ``precision`` as in the model."""
    model = M.make_kernel()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x, y = M.gp_data()

    def run(steps):
        with FlightRecorder(model, opt, out_dir=out_dir, factory="linalg_error_models:make_kernel",
                            loss_fn=M.MarginalLikelihood() if kind == "module" else M.gp_nll
                            ) as rec:
            mll = rec.loss_fn
            for step in range(40):
                steps.append(step)
                opt.zero_grad()
                mll(model(x), y).backward()
                opt.step()

    step, bundle = _raised(out_dir, run)
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], rep["cause"]) == \
        (step, "loss", "<loss>", "aten.linalg_cholesky_ex", "precision"), \
        json.dumps({k: rep[k] for k in ("origin", "cause", "hint", "problems")}, indent=1)


@pytest.mark.parametrize("fn, forced", [
    (lambda: torch.linalg.cholesky(torch.ones(3, 3)), "linalg"),
    (lambda: torch.linalg.solve(torch.zeros(3, 3), torch.ones(3)), "linalg"),
    (lambda: torch.linalg.eigh(torch.full((3, 3), float("nan"))), "linalg"),
    # plain RuntimeErrors of a failed decomposition on torch 2.13
    (lambda: torch.linalg.lu_factor(torch.zeros(3, 3)), "linalg"),
    (lambda: torch.linalg.eig(torch.full((3, 3), float("nan"))), "linalg"),
    # the argument checks: a bug in the code, not a matrix the step made
    (lambda: torch.linalg.cholesky(torch.ones(2, 3)), None),
    (lambda: torch.linalg.vector_norm(torch.ones(3, dtype=torch.long)), None),
], ids=["cholesky", "solve", "eigh", "lu_factor", "eig", "not-square", "dtype"])
def test_which_errors_force_a_bundle(fn, forced):
    from recorder.linalg import linalg_reason
    with pytest.raises(RuntimeError) as info:
        fn()
    assert linalg_reason(info.value) == forced


@pytest.mark.parametrize("where", ["shape", "loop"])
def test_no_bundle_for_a_shape_error_or_a_failure_in_the_loop(out_dir, where):
    """torch.linalg refusing a non-square matrix is a bug in the code, not a matrix the step
    made; a decomposition that fails in the loop's own code, outside the model and the loss
    (a metric on the features), is not the recorded step's and could not be re-run: neither
    writes a bundle, and the error reaches the loop as raised, with no note."""
    model = M.make_whiten()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError) as info:
        with FlightRecorder(model, opt, out_dir=out_dir,
                            factory="linalg_error_models:make_whiten"):
            model(torch.randn(8, 6))[:, :2].sum().backward()
            opt.step()
            out = model(torch.randn(8, 6))
            torch.linalg.cholesky(out if where == "shape" else torch.zeros(3, 3))
    assert type(info.value) is (RuntimeError if where == "shape"
                                else torch.linalg.LinAlgError), type(info.value)
    assert not getattr(info.value, "__notes__", None)
    assert not list(out_dir.glob("*.nan"))


@pytest.mark.filterwarnings("ignore::UserWarning")  # (Lightning's own advice)
@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")
def test_lightning_callback_writes_the_bundle_of_a_failed_cholesky(out_dir):
    """The whitening net trained by ``lightning.Trainer.fit`` with the callback: the
    LinAlgError of step 3 reaches the caller of fit unchanged, noted, and its bundle replays
    to the same op and module."""
    L = pytest.importorskip("lightning")
    from recorder.lightning import FlightRecorderCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.crit = M.make_whiten(), nn.CrossEntropyLoss()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.crit(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    xs, ys = zip(*M.whiten_batches(6, dead_at=3))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=32)
    cb = FlightRecorderCallback(module="net", loss_fn="crit", out_dir=out_dir,
                                factory="linalg_error_models:make_whiten")
    trainer = L.Trainer(accelerator="cpu", max_steps=6, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    with pytest.raises(torch.linalg.LinAlgError) as info:
        trainer.fit(Module(), loader)
    assert type(info.value) is torch.linalg.LinAlgError
    assert any("matrix decomposition failed at step 3" in n
               for n in getattr(info.value, "__notes__", [])), info.value
    bundle, = out_dir.glob("*.nan")
    _check(nanreplay_json(bundle), 3, "whiten", "aten.linalg_cholesky_ex", "invalid", [])
