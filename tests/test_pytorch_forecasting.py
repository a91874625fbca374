"""pytorch-forecasting (1.8) models trained by ``lightning.pytorch.Trainer`` under the
project's ``FlightRecorderCallback``, with the failures forecasters meet planted.

The library guards much itself: ``TimeSeriesDataSet`` refuses NaN/Inf in any real or target
column (a NaN price never reaches a batch) and a ``MultiHorizonMetric`` replaces a non-finite
summed loss with a constant 1e9, so what reaches the recorder are the failures below.
"""

from __future__ import annotations

import glob

import pytest

pytest.importorskip("pytorch_forecasting")

import pytorch_forecasting_models as M  # noqa: E402
from bundles import nanreplay_json  # noqa: E402

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


def test_a_zero_sold_under_a_log_target_normalizer_is_named_as_data_outside_the_support(
        tmp_path):
    """DeepAR's ``NormalDistributionLoss`` under ``GroupNormalizer(transformation="log")``: the
    distribution is a Normal through ``ExpTransform``, so ``log_prob`` refuses the day store 1
    was closed (0 sold), in the decoder window of sample 3 at step 4. The loss is the
    LightningModule's own ``self.loss``, into which the model's forward writes the
    transformation: the replay re-runs that submodule of the rebuilt model (it crashed on the
    attribute a loss rebuilt on its own lacked)."""
    model = M.make_deepar(transformation="log")
    ds = M.dataset(M.sales_frame(zero_at=(1, 20)), M._normalizer("log"))
    with pytest.raises(ValueError, match="within the support"):
        M.fit(model, ds, [_callback(tmp_path, "make_deepar", transformation="log")])
    (bundle,) = glob.glob(str(tmp_path / "*.nan"))
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["reproduced"], rep["cause"]) == (4, True, "invalid")
    assert (o["phase"], o["samples"]) == ("forward", [3])
    assert "TransformedDistribution refused its value" in rep["hint"]
    assert "ExpTransform" in rep["hint"] and "log1p" in rep["hint"]
    assert not any("could not be stored" in n for n in rep.get("notes", []))
