"""End to end on astronomy models (``astronomy_models``): photometric redshifts from ugriz
fluxes turned into AB magnitudes in ``forward`` under a heteroscedastic Gaussian NLL, or from
catalogue magnitudes with missing bands coded -99; a mixture density network for redshift
PDFs; a transformer over irregularly sampled multi-band light curves ``(time, band, flux,
flux_err)`` batched by a ``collate_fn`` with a padding mask, with a loss holding the model for
its learned flux-error jitter; a galaxy morphology CNN with rotation augmentation. Each planted
failure of the domain fires under the recorder and is replayed with the CLI; the healthy
versions raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import astronomy_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, Dataset, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

STEPS, N = 4, 8


def line_of(text: str) -> str:
    return source_line("astronomy_models.py", text)


def photometry_loader(steps: int = STEPS, **bad) -> DataLoader:
    """Fluxes, errors and spectroscopic redshifts; the data condition ``bad`` in the last batch."""
    g = torch.Generator().manual_seed(0)
    parts = [M.photometry(g, N, **(bad if s == steps - 1 else {})) for s in range(steps)]
    return DataLoader(TensorDataset(*[torch.cat([p[i] for p in parts]) for i in range(3)]),
                      batch_size=N)


def mags_loader(missing=None, outlier=None) -> DataLoader:
    """Catalogue magnitudes and redshifts: the last batch's row ``missing`` with its z band
    coded -99; its row ``outlier`` with a spectroscopic redshift of 8 (a high-z quasar)."""
    g = torch.Generator().manual_seed(0)
    parts = [M.catalogue_mags(g, N, missing=(missing if s == STEPS - 1 else None))
             for s in range(STEPS)]
    mags, z = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    if outlier is not None:
        z[(STEPS - 1) * N + outlier] = 8.0
    return DataLoader(TensorDataset(mags, z), batch_size=N)


class LightCurves(Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def light_curve_loader(err_pad: float = 1.0, **bad) -> DataLoader:
    """Light curves collated with their padding mask; the data condition ``bad`` (keywords of
    ``light_curves``: ``empty``, ``bright``) in the last batch; ``err_pad``: the flux error the
    collate_fn pads with."""
    g = torch.Generator().manual_seed(0)
    items = []
    for s in range(STEPS):
        items += M.light_curves(g, N, **(bad if s == STEPS - 1 else {}))
    return DataLoader(LightCurves(items), batch_size=N,
                      collate_fn=lambda b: M.collate_light_curves(b, err_pad=err_pad))


def photoz_step(model, loss_fn, batch):
    *x, z = batch
    return loss_fn(model(x[0]), z)


def lc_step(model, loss_fn, batch):
    t, band, flux, err, pad, y = batch
    return loss_fn(model(t, band, flux, err, pad)[0], y)


def jitter_step(model, loss_fn, batch):
    t, band, flux, err, pad, y = batch
    return loss_fn(model(t, band, flux, err, pad), y, flux, err, pad)


def morph_step(model, loss_fn, batch):
    img, y = batch
    k = int(torch.randint(0, 4, (1,)))  # rotation augmentation: galaxies have no up
    return loss_fn(model(torch.rot90(img, k, (2, 3))), y)


def train(make: str, crit, loader: DataLoader, step, out_dir=None, record: bool = True,
          lr: float = 1e-3):
    """Adam with gradient clipping, as survey pipelines train; ``crit``: the loss, or a
    function of the model making it (a loss holding the model)."""
    model = getattr(M, make)()
    loss = crit(model) if getattr(crit, "__name__", "") == "<lambda>" else crit
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    torch.manual_seed(1)
    rec = FlightRecorder(model, optimizer, loss_fn=loss, out_dir=out_dir,
                         factory=f"astronomy_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else loss
        for batch in loader:
            optimizer.zero_grad()
            step(model, loss_fn, batch).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
    return model


def fire(*args, **kwargs):
    with pytest.raises(NonFiniteError) as info:
        train(*args, **kwargs)
    return info.value.event, info.value.bundle_path


def origin_of(rep: dict) -> tuple:
    o = rep["origin"]
    return rep["reproduced"], o["phase"], o["module"], o["op"], o["made"], o["samples"]


def test_negative_sky_subtracted_flux_names_the_magnitude_log_and_says_asinh(tmp_path):
    """A faint galaxy's u-band flux is -0.2 after sky subtraction: ``log10`` of it in the
    model's magnitude conversion is NaN. The replay names the log at that galaxy and, since
    the value is a measurement (not a whole-number code), says to use a transform defined
    there (asinh magnitudes) rather than calling it a missing-value code or corrupt record."""
    ev, bundle = fire("make_photoz", M.gaussian_nll, photometry_loader(negative=3),
                      photoz_step, tmp_path)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "forward", ""), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "forward", "", "aten.log10", "nan", [3]), rep["origin"]
    assert rep["origin"]["source"] == line_of("mags = ZP - 2.5 * torch.log10(x)"), rep["origin"]
    assert rep["cause"] == "invalid", rep
    assert "holds -0.2 at sample(s) 3 (column 0)" in rep["hint"], rep["hint"]
    assert "asinh magnitudes" in rep["hint"], rep["hint"]
    assert "a code for a missing value" not in rep["hint"], rep["hint"]
    assert "clamp the op's input into its domain" in rep["hint"], rep["hint"]
    assert "log barrier" not in rep["hint"], rep["hint"]  # (the batch's value: no iterate)


def test_missing_band_coded_minus_99_overflows_the_flux_conversion_and_is_named_a_code(
        tmp_path):
    """A galaxy with no z-band observation, coded -99 in the catalogue: the model's
    ``10 ** (-0.4 (m - 22.5))`` is 4e48, past float32. The replay names the power at that
    galaxy as an overflow of the data alone, and the -99 as a missing-value code to mask or
    impute before the model (not a time before an event or a flipped sign)."""
    ev, bundle = fire("make_photoz_mags", M.gaussian_nll, mags_loader(missing=5),
                      photoz_step, tmp_path)
    assert (ev["step"], ev["phase"]) == (3, "forward"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "forward", "", "aten.pow", "+inf", [5]), rep["origin"]
    assert rep["origin"]["source"] == line_of("flux = 10 ** (-0.4 * (x - ZP))"), rep["origin"]
    assert rep["cause"] == "overflow", rep
    assert "hold -99 where every other sample's values are 0 or more: a missing-value code" \
        in rep["hint"], rep["hint"]
    assert "a time since an event" not in rep["hint"], rep["hint"]


def test_learned_error_floor_driven_negative_by_adam_names_the_parameter_under_log(tmp_path):
    """A learned systematic error floor ``sys_var`` added to the predicted variance in log
    space, ``logaddexp(log_var, log(sys_var))``, trained as a raw parameter: Adam's steps of
    ~lr take it from 0.02 below 0 at step 5, and its log is NaN for every galaxy. The replay
    names the log on that line, made of parameters alone (every sample), and the parameter
    with its negative value, to learn its log instead."""
    ev, bundle = fire("make_photoz_floor", M.gaussian_nll, photometry_loader(steps=12),
                      photoz_step, tmp_path, lr=0.03)
    assert (ev["step"], ev["phase"]) == (5, "forward"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "forward", "", "aten.log", "nan", list(range(N)))
    assert rep["origin"]["source"] == line_of("torch.logaddexp(out[:, 1], torch.log(self.sys_var")
    assert rep["cause"] == "invalid", rep
    assert "the parameter sys_var (-0.009557)" in rep["hint"], rep["hint"]
    assert "learn its log and use .exp()" in rep["hint"], rep["hint"]


def test_mdn_density_of_a_catastrophic_outlier_underflows_and_logsumexp_trains(tmp_path):
    """The MDN's NLL written as ``-log(sum(pi * N(z | mu, sigma)))``: a spectroscopic redshift
    of 8 lies so many sigmas from every component that each density underflows to 0 and the
    log is -inf. The replay names the log in the loss at that galaxy, an underflow, and says
    logsumexp; the same batch under the log-space NLL raises no event."""
    ev, bundle = fire("make_mdn", M.MDNLoss(naive=True), mags_loader(outlier=2), photoz_step,
                      tmp_path)
    assert (ev["step"], ev["phase"]) == (3, "loss"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "loss", "<loss>", "aten.log", "-inf", [2]), rep["origin"]
    assert rep["origin"]["source"] == line_of("return -torch.log(dens.sum(-1)).mean()")
    assert rep["cause"] == "underflow", rep
    assert "logsumexp" in rep["hint"], rep["hint"]
    train("make_mdn", M.MDNLoss(naive=False), mags_loader(outlier=2), photoz_step,
          tmp_path / "log-space")


def test_light_curve_with_no_detection_names_the_masked_mean_and_its_padding_mask(tmp_path):
    """An object with no detection left after quality cuts: every token is padding, and the
    masked mean pool ``(h * keep).sum(1) / keep.sum(1)`` is 0/0. The replay names the division
    at that object and the padding mask (True where padded) as what is empty, not the band ids
    as token ids."""
    ev, bundle = fire("make_lightcurve", torch.nn.CrossEntropyLoss(),
                      light_curve_loader(empty=4), lc_step, tmp_path)
    assert (ev["step"], ev["phase"]) == (3, "forward"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "forward", "", "aten.div", "nan", [4]), rep["origin"]
    assert rep["origin"]["source"] == line_of("pooled = (h * keep).sum(1) / keep.sum(1)")
    assert rep["cause"] == "invalid", rep
    assert "args[4] (a padding mask, True at the padding) is set at every position" \
        in rep["hint"], rep["hint"]
    assert "token ids" not in rep["hint"], rep["hint"]


def test_learned_jitter_in_a_loss_holding_the_model_names_the_reciprocal_backward(tmp_path):
    """The collate_fn pads flux errors with 0 and the loss, given the model at construction,
    weights the chi^2 by ``1 / (flux_err^2 + jitter^2)`` with the model's jitter starting at
    0, padded tokens left out with ``torch.where``: the forward is finite, but the discarded
    branch's backward is 0 * inf at every padded token, and the jitter's gradient NaN. Before,
    the replay rebuilt the loss with a copy of the model and left the loss's direct path to
    the jitter out: 'not reproduced', a gradient 'exactly 0' turned NaN by the loop. Now the
    loss holds the rebuilt model and the re-run takes that path: the reciprocal's backward in
    the loss, at the padded light curves, with torch.where's advice."""
    loader = light_curve_loader(err_pad=0.0)
    padded = torch.nonzero(next(iter(loader))[4].any(1)).flatten().tolist()
    ev, bundle = fire("make_lightcurve_jitter", lambda m: M.JitterLoss(m), loader, jitter_step,
                      tmp_path)
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "backward", "<loss>", "ReciprocalBackward0", "nan",
                              padded), rep["origin"]
    assert 0 < len(padded) < N
    assert rep["origin"]["source"] == line_of("ivar = torch.where(pad, torch.zeros_like(var)")
    assert rep["cause"] == "invalid", rep
    assert "torch.where(mask, x, 1)" in rep["hint"], rep["hint"]


def test_one_pass_variance_of_a_bright_constant_star_rounds_to_zero_and_says_precision(
        tmp_path):
    """Each light curve standardised in ``forward`` with the one-pass variance
    ``E[f^2] - E[f]^2``: a bright non-variable star (fluxes ~3e4, scatter 0.1) has a true
    variance of 0.01 that float32 rounds to 0 (E[f^2] ~ 9e8, its spacing 64), and the
    division by its square root is +inf. The replay names the division at that star as a
    precision loss (float64 holds a positive variance) with the centred formula's advice."""
    ev, bundle = fire("make_lightcurve_standardised", torch.nn.CrossEntropyLoss(),
                      light_curve_loader(bright=2), lc_step, tmp_path)
    assert (ev["step"], ev["phase"]) == (3, "forward"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "forward", "", "aten.div", "+inf", [2]), rep["origin"]
    assert rep["origin"]["source"] == line_of("flux, flux_err = (flux - mean) / var.sqrt()")
    assert rep["cause"] == "precision", rep
    assert "E[x²] − E[x]²" in rep["hint"] and "torch.var" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("case", ["photoz", "floor", "lightcurve", "jitter", "morphology"])
def test_healthy_runs_raise_no_event_and_train_bit_identically(tmp_path, case):
    """The healthy versions (positive fluxes, every light curve detected and variable, errors
    padded with 1, calibrated cutouts) raise no event; the recorder changes none of the
    trained weights."""
    g = torch.Generator().manual_seed(0)
    img, y = M.cutouts(g, STEPS * N)
    args = {"photoz": ("make_photoz", M.gaussian_nll, photometry_loader(), photoz_step),
            "floor": ("make_photoz_floor", M.gaussian_nll, photometry_loader(), photoz_step),
            "lightcurve": ("make_lightcurve_standardised", torch.nn.CrossEntropyLoss(),
                           light_curve_loader(), lc_step),
            "jitter": ("make_lightcurve_jitter", lambda m: M.JitterLoss(m),
                       light_curve_loader(), jitter_step),
            "morphology": ("make_morphology", torch.nn.CrossEntropyLoss(),
                           DataLoader(TensorDataset(img, y), batch_size=N), morph_step)}[case]
    recorded = train(*args, out_dir=tmp_path)
    plain = train(*args, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
