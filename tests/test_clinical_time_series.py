"""End to end on clinical / EHR time series with missingness (``clinical_time_series_models``):
GRU-D (input and hidden decay on the time since each variable's last observation, imputation
toward the training-set mean) and a SeFT / mTAN-style set encoder over the irregular (time,
variable, value) triplets under a padding mask, trained on padded stays from a DataLoader's
``collate_fn`` under a mortality BCE with ``pos_weight``, a length-of-stay MSE on
``log1p(days)`` and a masked reconstruction MSE over the observed entries. Each planted
failure of the domain fires under the recorder and is replayed with the CLI; the healthy run
raises no event and trains bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import clinical_time_series_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

FACTORY = "clinical_time_series_models"


def line_of(text: str) -> str:
    return source_line("clinical_time_series_models.py", text)


def stays(bad=None, n: int = 16, nan_missing: bool = False) -> DataLoader:
    """Two batches of 8 padded stays; ``bad(stays)`` writes the data condition."""
    data, _, _ = M.stay_dataset(torch.Generator().manual_seed(0), n, nan_missing=nan_missing)
    if bad is not None:
        bad(data)
    return DataLoader(data, batch_size=8, shuffle=False, collate_fn=M.collate_stays)


def train_grud(crit, out_dir, bad=None, make: str = "make_grud", recon: bool = True,
               record: bool = True, half: bool = False, **kw):
    """Adam with gradient clipping, as GRU-D trains; ``recon``: the reconstruction head's
    masked MSE against the standardised values (``"raw"``: the charted values)."""
    model = getattr(M, make)()
    if half:
        model = model.half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"{FACTORY}:{make}", **kw) if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for b in stays(bad, nan_missing="allow_nan" in kw):
            x, m, delta, last = (b[k].to(model.x_mean.dtype)
                                 for k in ("values", "mask", "delta", "last"))
            out = model(x, m, delta, last, b["length"])
            extra = () if not recon else (b["raw" if recon == "raw" else "values"], b["mask"])
            loss = loss_fn(out, b["died"], b["los"], *extra)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return model


def train_seft(crit, out_dir, minutes: bool = False, scale: float = 1.0):
    """AdamW under float16 autocast (the losses in float32), the times in hours, or in
    minutes since admission as the chart export writes them."""
    model = M.make_seft_scaled(scale)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory=f"{FACTORY}:make_seft_scaled",
                        factory_kwargs={"scale": scale}) as rec:
        for b in stays():
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(*M.triplets(b, minutes=minutes))
            loss = rec.loss_fn([o.float() for o in out], b["died"], b["los"])
            opt.zero_grad()
            loss.backward()
            opt.step()


def fire(train, *args, code: int | None = 0, **kwargs):
    with pytest.raises(NonFiniteError) as info:
        train(*args, **kwargs)
    return info.value.event, nanreplay_json(info.value.bundle_path, code=code)


def origin_of(rep: dict) -> tuple:
    o = rep["origin"]
    return rep["reproduced"], o["phase"], o["module"], o["op"], o["made"], o["samples"]


def test_stay_with_no_charted_value_names_the_masked_mse_count_and_the_record(tmp_path):
    """Stay 10 has no charted value in its window: the masked MSE's sum over its observed
    entries divided by their count is 0/0 at its row of the second batch. The replay names
    the division on its line at sample 2, a sample with no valid entry, and the mask."""
    ev, rep = fire(train_grud, M.ClinicalLoss(), tmp_path, bad=lambda s: M.blank_stay(s, 10))
    assert (ev["step"], ev["phase"]) == (1, "loss"), ev
    assert origin_of(rep) == (True, "loss", "<loss>", "aten.div", "nan", [2]), rep["origin"]
    assert rep["origin"]["source"] == line_of("return (se.flatten(1).sum(1) / mask"), rep
    assert rep["cause"] == "invalid", rep
    assert "count.clamp(min=1)" in rep["hint"] and "no valid entry" in rep["hint"], rep["hint"]


def test_missing_values_as_nan_times_the_mask_name_the_imputation_product(tmp_path):
    """The values exported with NaN where not charted, allowed as missing values
    (``allow_nan``): GRU-D's ``m * x`` is NaN * 0 at every missing entry, so the handling lets
    them through. The replay names that product on its line and says to fill before it."""
    ev, rep = fire(train_grud, M.ClinicalLoss(), tmp_path, recon=False, allow_nan=["args[0]"])
    assert (ev["step"], ev["phase"], ev["tensor"]) == (0, "input", "args[0]"), ev
    assert origin_of(rep)[:2] == (True, "input"), rep["origin"]
    assert rep["origin"]["samples"] == list(range(8)), rep["origin"]
    assert rep["origin"]["source"] == line_of("return m * x + (1 - m) * (gamma_x"), rep
    assert rep["cause"] == "input", rep
    assert "aten.mul" in rep["hint"] and "NaN * 0 is NaN" in rep["hint"], rep["hint"]
    assert "torch.where(observed, x, 0)" in rep["hint"], rep["hint"]


def test_log_of_uncharted_zeros_under_where_is_a_backward_nan_of_the_log(tmp_path):
    """The reconstruction in log units of the charted values, the uncharted 0s left out with
    ``torch.where`` after the log: the forward is finite, but the pow's backward multiplies
    the log's -inf by the 0 gradient where gives them. The replay names that backward node on
    the loss's line, the log's pole, and to make the log's input safe before it."""
    ev, rep = fire(train_grud, M.ClinicalLoss(recon=M.log_lab_mse), tmp_path, recon="raw")
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    assert origin_of(rep) == (True, "backward", "<loss>", "PowBackward0", "nan",
                              list(range(8))), rep["origin"]
    assert rep["origin"]["source"] == line_of("(pred - torch.log(raw)) ** 2"), rep
    assert rep["cause"] == "invalid", rep
    assert "aten.log" in rep["hint"] and "torch.where(mask, x, 1)" in rep["hint"], rep["hint"]


def test_times_in_minutes_under_float16_overflow_without_blaming_the_one_death(tmp_path):
    """The set encoder's time embedding, trained on hours, given minutes since admission
    under float16 autocast: the pooled state grows 60x and the length-of-stay head's weight
    gradient overflows float16. The replay names that backward node in ``los`` as an
    overflow; it used to add that sample 5 of the 0/1 mortality labels (the batch's one
    death) 'reach 1, the other rows being 0: out of scale'."""
    ev, rep = fire(train_seft, M.ClinicalLoss(), tmp_path, minutes=True, scale=4.0)
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    assert origin_of(rep) == (True, "backward", "los", "AddmmBackward0", "+inf", []), rep
    assert rep["cause"] == "overflow", rep
    assert "float32" in rep["hint"] and "out of scale" not in rep["hint"], rep["hint"]


def test_adam_eps_lost_in_float16_weights_is_named_as_the_optimizer(tmp_path):
    """GRU-D cast to float16 with its Adam state: eps=1e-8 is 0 in float16, and an entry
    whose gradient squared rounds to 0 divides 0 by 0 in the first update. The replay names
    the update, the lost eps and float32 master weights (not re-run: the bundle holds the
    weights after the update)."""
    ev, rep = fire(train_grud, M.ClinicalLoss(), tmp_path, recon=False, half=True, code=1)
    assert (ev["step"], ev["phase"]) == (0, "optimizer"), ev
    assert rep["cause"] == "optimizer", rep
    assert "eps=1e-08 is 0 in float16" in rep["hint"], rep["hint"]
    assert "keep the weights and optimizer state in float32" in rep["hint"], rep["hint"]


def test_batch_pos_weight_without_a_death_names_the_count_of_positives(tmp_path):
    """``pos_weight`` computed per batch as ``n_neg / n_pos``: the second batch has no death,
    the weight is +inf. The replay names the division on its line, no sample, and the count
    that is 0 in this batch."""
    ev, rep = fire(train_grud, M.BatchWeightedLoss(), tmp_path, recon=False,
                   bad=lambda s: M.survivors_only(s, 8))
    assert (ev["step"], ev["phase"]) == (1, "loss"), ev
    assert origin_of(rep) == (True, "loss", "<loss>", "aten.div", "+inf", []), rep["origin"]
    assert rep["origin"]["source"] == line_of("return (1 - died).sum() / died.sum()"), rep
    assert rep["cause"] == "invalid", rep
    assert "no row is to blame" in rep["hint"], rep["hint"]


def test_hand_written_bce_of_a_saturated_sigmoid_is_precision_with_the_logits_form(tmp_path):
    """The class-weighted BCE written on probabilities, ``log(1 - sigmoid(z))``, with a
    mortality logit of 20: 1 - sigmoid rounds to 0 in float32. The replay names the log,
    precision, and BCE with logits."""
    ev, rep = fire(train_grud, M.HandBCE(), tmp_path, make="make_grud_drifted", recon=False)
    assert (ev["step"], ev["phase"]) == (0, "loss"), ev
    assert origin_of(rep) == (True, "loss", "<loss>", "aten.log", "-inf", list(range(8))), rep
    assert rep["origin"]["source"] == line_of("(1 - died) * torch.log(1 - p)"), rep
    assert rep["cause"] == "precision", rep
    assert "binary_cross_entropy_with_logits" in rep["hint"], rep["hint"]


def test_log_of_a_same_day_discharge_says_log1p_not_a_blank_record(tmp_path):
    """Lengths of stay in whole days, stay 13 discharged on its day of admission: the
    ``log(days)`` target is -inf at its row. The replay names the log at sample 5 and says a
    0 of such data is an ordinary record, log1p; it used to add that the record was blank,
    'fix or filter such records', which contradicts it."""
    ev, rep = fire(train_grud, M.LogLosLoss(), tmp_path, recon=False,
                   bad=lambda s: M.whole_days(s, 13))
    assert (ev["step"], ev["phase"]) == (1, "loss"), ev
    assert origin_of(rep) == (True, "loss", "<loss>", "aten.log", "-inf", [5]), rep["origin"]
    assert rep["origin"]["source"] == line_of("F.mse_loss(out[1], torch.log(los))"), rep
    assert rep["cause"] == "invalid", rep
    assert "torch.log1p(count)" in rep["hint"] and "ordinary record" in rep["hint"], rep
    assert "blank record" not in rep["hint"] and "filter" not in rep["hint"], rep["hint"]


def test_training_mean_of_a_never_charted_variable_is_named_as_the_buffer(tmp_path):
    """A lab never charted in the training split: its training-set mean is 0/0, copied into
    GRU-D's ``x_mean`` buffer, which the imputation multiplies in. The replay says the loop
    wrote the buffer non-finite after building the model."""
    def uncharted(data):
        for s in data:
            for key in ("values", "raw", "mask", "last"):
                s[key][:, 4] = 0

    def train(out_dir):
        model = M.make_grud()
        model.x_mean[4] = float("nan")  # (training_stats over no observation)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        with FlightRecorder(model, opt, loss_fn=M.ClinicalLoss(), out_dir=out_dir,
                            factory=f"{FACTORY}:make_grud") as rec:
            for b in stays(uncharted):
                out = model(b["values"], b["mask"], b["delta"], b["last"], b["length"])
                loss = rec.loss_fn(out, b["died"], b["los"], b["values"], b["mask"])
                opt.zero_grad()
                loss.backward()
                opt.step()

    ev, rep = fire(train, tmp_path)
    assert (ev["step"], ev["phase"]) == (0, "forward"), ev
    assert origin_of(rep)[:4] == (True, "weights", "", "aten.mul"), rep["origin"]
    assert rep["cause"] == "weights", rep
    assert "buffer x_mean" in rep["hint"] and "0/0" in rep["hint"], rep["hint"]


def test_zero_training_std_inside_the_model_names_the_buffer_not_a_masked_branch(tmp_path):
    """The training set's std kept in the model, 0 for creatinine (charted once there): the
    charted creatinine of samples 0, 2, 4, 5 and 7 divided by it is +-inf, selected by the
    ``torch.where`` of the charted entries, and saturates the GRU cell's gates; the cell's
    weight gradient is NaN. The replay names that node, then the division and the buffer's
    zero entry; it used to give the generic eps and 'torch.where and masked_fill still send
    the gradient through both branches', though no mask dropped the infinity."""
    def train(out_dir):
        model = M.make_grud_standardised()
        g = torch.Generator().manual_seed(0)
        x, m, _, _ = M.simulate_stays(g, 16)
        mean, std = M.training_stats(x, m)
        model.norm.mean.copy_(mean)
        model.norm.std.copy_(std.index_fill(0, torch.tensor([5]), 0.0))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        with FlightRecorder(model, opt, loss_fn=M.ClinicalLoss(), out_dir=out_dir,
                            factory=f"{FACTORY}:make_grud_standardised") as rec:
            for b in stays():
                out = model(b["raw"], b["mask"], b["delta"], b["last"], b["length"])
                loss = rec.loss_fn(out, b["died"], b["los"])
                opt.zero_grad()
                loss.backward()
                opt.step()

    ev, rep = fire(train, tmp_path)
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    assert origin_of(rep)[:5] == (True, "backward", "grud.cell", "AddmmBackward0", "nan"), rep
    assert rep["cause"] == "invalid", rep
    hint = rep["hint"]
    assert line_of("(raw - self.mean) / self.std") in hint, hint
    assert "the divisor is the buffer norm.std" in hint and "0 at entry 5" in hint, hint
    assert "both branches" not in hint, hint


def test_healthy_grud_raises_nothing_and_trains_bit_identically(tmp_path):
    """The healthy GRU-D run: no event, and the same weights with and without the
    recorder."""
    a = train_grud(M.ClinicalLoss(), tmp_path / "a")
    b = train_grud(M.ClinicalLoss(), tmp_path / "b", record=False)
    assert not list((tmp_path / "a").glob("*.nan"))
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


def test_healthy_set_encoder_under_float16_autocast_raises_nothing(tmp_path):
    train_seft(M.ClinicalLoss(), tmp_path, minutes=False, scale=4.0)
    assert not list(tmp_path.glob("*.nan"))
