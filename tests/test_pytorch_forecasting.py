"""pytorch-forecasting (1.8) models trained by ``lightning.pytorch.Trainer`` under the
project's ``FlightRecorderCallback``, with the failures forecasters meet planted.

The library guards much itself: ``TimeSeriesDataSet`` refuses NaN/Inf in any real or target
column (a NaN price never reaches a batch) and a ``MultiHorizonMetric`` replaces a non-finite
summed loss with a constant 1e9, so what reaches the recorder are the failures below.
"""

from __future__ import annotations

import glob
import warnings

import pytest

pytest.importorskip("pytorch_forecasting")

import lightning.pytorch as pl  # noqa: E402
import pytorch_forecasting_models as M  # noqa: E402
import torch  # noqa: E402
from bundles import nanreplay_json, source_line  # noqa: E402

from recorder.lightning import FlightRecorderCallback  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("in_tests_dir"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def _callback(tmp_path, factory: str, **kwargs):
    return FlightRecorderCallback(loss_fn="loss", out_dir=tmp_path,
                                  factory=f"pytorch_forecasting_models:{factory}",
                                  factory_kwargs=kwargs)


@pytest.mark.parametrize("transformation", ["log", "softplus"])
def test_a_zero_sold_under_a_log_or_softplus_target_normalizer_is_data_outside_the_support(
        tmp_path, transformation):
    """DeepAR's ``NormalDistributionLoss`` under ``GroupNormalizer(transformation=...)``: the
    distribution is a Normal through ``ExpTransform`` (``SoftplusTransform``), whose support is
    the positive numbers, so ``log_prob`` refuses the day store 1 was closed (0 sold), in the
    decoder window of sample 3 at step 4. The loss is the LightningModule's own ``self.loss``,
    into which the model's forward writes the transformation: the replay re-runs that
    submodule of the rebuilt model (it crashed on the attribute a loss rebuilt on its own
    lacked), and names the transform that sets the support and the normalizer's remedy, and
    the batch's tensor that holds the 0."""
    model = M.make_deepar(transformation=transformation)
    ds = M.dataset(M.sales_frame(zero_at=(1, 20)), M._normalizer(transformation))
    with pytest.raises(ValueError, match="within the support"):
        M.fit(model, ds, [_callback(tmp_path, "make_deepar", transformation=transformation)])
    (bundle,) = glob.glob(str(tmp_path / "*.nan"))
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["reproduced"], rep["cause"]) == (4, True, "invalid")
    assert (o["phase"], o["module"], o["samples"]) == ("forward", "", [3])
    # the data refused, not the cast inside the metric that last wrote it (aten._to_copy)
    assert o["tensor"] == 'batch["decoder_target"]'
    assert '(batch["decoder_target"], nothing the model learns)' in rep["hint"]
    last = {"log": "ExpTransform", "softplus": "SoftplusTransform"}[transformation]
    assert "TransformedDistribution refused its value" in rep["hint"]
    assert f"last transform ({last}, of [AffineTransform, {last}])" in rep["hint"]
    assert 'transformation="log1p"' in rep["hint"]
    assert not any("could not be stored" in n for n in rep.get("notes", []))


def test_revin_of_a_series_that_never_sold_is_named_at_its_division(tmp_path):
    """A model of the user's (the docs' new-architecture MLP) standardises each encoder window
    by its own std without an eps: store 2 never sold anything, its windows are constant, 0/0
    in ``revin``. pytorch-forecasting's metric then swaps the NaN loss for a constant 1e9, so
    the step ends in backward's 'does not require grad'; the recorder's bundle, written on
    that exception, names the division, store 2's windows and the eps of 0."""
    ds = M.window_dataset(M.sales_frame(constant_series=2))
    pl.seed_everything(0, verbose=False)
    x, _ = next(iter(M.loader(ds)))
    store2 = (x["groups"][:, 0] == 2).nonzero().flatten().tolist()
    with pytest.raises(RuntimeError, match="does not require grad") as info:
        M.fit(M.make_window_mlp(), ds, [_callback(tmp_path, "make_window_mlp")])
    assert "nanreplay" in "".join(getattr(info.value, "__notes__", []))
    (bundle,) = glob.glob(str(tmp_path / "*.nan"))
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["cause"], o["phase"]) == (0, "invalid", "forward")
    assert store2 == [2, 3, 4, 6]
    assert (o["module"], o["op"], o["samples"]) == ("revin", "aten.div", store2)
    assert o["source"].startswith(source_line("pytorch_forecasting_models.py",
                                              "return (x - mean) / std, mean, std"))
    assert "revin's attribute eps" in rep["hint"] and "0/0" in rep["hint"]


def test_a_healthy_fit_raises_no_event_and_trains_bit_identically(tmp_path):
    ds = M.window_dataset(M.sales_frame())
    plain = M.make_window_mlp()
    M.fit(plain, ds)
    recorded = M.make_window_mlp()
    cb = _callback(tmp_path, "make_window_mlp")
    M.fit(recorded, ds, [cb])
    assert cb.recorder is not None and cb.recorder.event is None
    assert not glob.glob(str(tmp_path / "*.nan"))
    a, b = plain.state_dict(), recorded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_log_link_over_a_flagship_store_in_other_units_overflows_exp_on_its_rows(tmp_path):
    """The user's MLP with a log link (``exp`` of its output) over raw sales (an identity
    normalizer): store 3 reports units where the others report thousands, its windows reach
    2.8e4, and ``exp`` overflows on its rows at the first step. The metric swaps the Inf loss
    for 1e9; the bundle written on backward's error names ``aten.exp``, store 3's row and the
    data out of scale."""
    kw = {"log_link": True, "eps": 1e-5}
    ds = M.window_dataset(M.sales_frame(flagship=3), raw=True)
    pl.seed_everything(0, verbose=False)
    x, _ = next(iter(M.loader(ds)))
    store3 = (x["groups"][:, 0] == 3).nonzero().flatten().tolist()
    with pytest.raises(RuntimeError, match="does not require grad"):
        M.fit(M.make_window_mlp(**kw), ds, [_callback(tmp_path, "make_window_mlp", **kw)])
    (bundle,) = glob.glob(str(tmp_path / "*.nan"))
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["cause"], o["phase"]) == (0, "overflow", "forward")
    assert store3 == [1]
    assert (o["module"], o["op"], o["samples"]) == ("", "aten.exp", store3)
    assert "out of scale" in rep["hint"] and "--try drop=1" in rep["hint"]


SGD_TOO_FAST = {"lr": 5.0, "optimizer": "sgd", "loss": "rmse"}


def test_a_diverging_loss_the_metric_swaps_for_a_constant_is_explained_without_a_bundle(
        tmp_path):
    """SGD at lr 5 without clipping diverges; at step 13 pytorch-forecasting's RMSE overflows
    inside the metric, which warns 'Loss is not finite' and returns a constant 1e9 with no
    graph. Every value the recorder saw was finite and backward fails with 'does not require
    grad': the callback's note says why (it said nothing) and how to get a bundle."""
    with pytest.raises(RuntimeError, match="does not require grad") as info:
        M.fit(M.make_window_mlp(**SGD_TOO_FAST), M.window_dataset(M.sales_frame()),
              [_callback(tmp_path, "make_window_mlp", **SGD_TOO_FAST)], max_steps=30, clip=None)
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "the loss the training_step returned at step 13" in notes
    assert 'filterwarnings("error", "Loss is not finite")' in notes
    assert not glob.glob(str(tmp_path / "*.nan"))


def test_the_metrics_warning_raised_as_an_error_is_replayed_to_the_losss_overflow(tmp_path):
    """The same run with the note's filter: the warning, raised inside the metric, is the
    recorder's check event at step 13; the replay raises it again (nanreplay runs without
    the filter: its re-run went past the raise, a fidelity mismatch) and, the model's output
    finite, finds the op in the loss: RMSE's squared error overflowing on sample 3, after
    the run had been diverging since step 2."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "Loss is not finite")
        with pytest.raises(UserWarning, match="Loss is not finite"):
            M.fit(M.make_window_mlp(**SGD_TOO_FAST), M.window_dataset(M.sales_frame()),
                  [_callback(tmp_path, "make_window_mlp", **SGD_TOO_FAST)], max_steps=30,
                  clip=None)
    (bundle,) = glob.glob(str(tmp_path / "*.nan"))
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["reproduced"], rep["cause"]) == (13, True, "overflow")
    assert (o["phase"], o["module"], o["op"], o["samples"]) == ("loss", "<loss>", "aten.pow",
                                                                [3])
    assert "the run was diverging" in rep["hint"] and "lower the learning rate" in rep["hint"]
