"""End to end on event-camera optical flow written as EV-FlowNet / E-RAFT code is
(``event_vision_models``): windows of ``(x, y, t, p)`` events binned in the Dataset into voxel
grids, latest-timestamp maps and masks of pixels with events; the voxel grid normalised by its
nonzero mean/std and an exponential time surface in ``forward``; a small U-Net; a masked
endpoint error per window plus a Charbonnier smoothness. Trained as those repos train: a
DataLoader, Adam, gradient clipping (and float16 autocast). Each planted bug fires under the
recorder and is replayed with the CLI; the healthy run raises no event and trains
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import event_vision_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("event_vision_models.py", text)


def train(make: str, out_dir, record: bool = True, amp: bool = False, loss_kw=None,
          adam_eps: float = 1e-8, **plant):
    """Four steps of 8 windows (the planted window 29 is row 5 of the last step)."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=adam_eps)
    crit = M.FlowLoss(**(loss_kw or {}))
    loader = torch.utils.data.DataLoader(M.windows(**plant), batch_size=8)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"event_vision_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for voxel, t_last, has_event, t_end, flow in loader:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                out = model(voxel, t_last, has_event, t_end)
            loss = loss_fn(out.float(), flow, has_event)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return model


def fire(make: str, tmp_path, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, **kw)
    return info.value.event, info.value.bundle_path


def origin(rep):
    o = rep["origin"]
    return rep["reproduced"], o["phase"], o["module"], o["op"], o["made"], o["samples"]


def test_empty_window_under_the_nonzero_mean_is_0_over_0_in_norm(tmp_path):
    """A window with no events (the sensor saw nothing move): E-RAFT's mean over the voxel
    grid's nonzero entries divides 0 by a count of 0 in that window only."""
    ev, bundle = fire("make_flownet_no_clamp", tmp_path, empty=29)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "norm", [5])
    rep = nanreplay_json(bundle)
    assert origin(rep) == (True, "forward", "norm", "aten.div", "nan", [5]), rep["origin"]
    assert rep["origin"]["source"] == line_of("mean = v.sum((1, 2, 3), keepdim=True) / n"), rep
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "0 by 0" in h, h
    assert "0 in sample(s) [5]: they have no valid entry" in h and "count.clamp(min=1)" in h, h


def test_empty_window_in_the_masked_endpoint_error_is_a_loss_event(tmp_path):
    """The loss's per-window mean over its pixels with events, with its count eps set to 0:
    the empty window's mask sums to 0, 0/0 in the loss on that window."""
    ev, bundle = fire("make_flownet", tmp_path, loss_kw={"count_eps": 0.0}, empty=29)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    assert origin(rep) == (True, "loss", "<loss>", "aten.div", "nan", [5]), rep["origin"]
    assert rep["origin"]["source"] == line_of("per = (epe * mask).sum((1, 2)) / (mask.sum"), rep
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "the eps added to that input is exactly 0" in h, h
    assert "Sample(s) 5 are empty records: args[2] (0/1 data)" in h, h


def test_time_surface_with_tau_0_names_the_attribute_built_as_0(tmp_path):
    """``exp(-(t_ref - t) / tau)`` with ``tau = 0`` from the constructor: at each window's
    freshest pixel ``t_ref - t`` is 0 too, 0/0 in every window at step 0. The replay names
    the module's ``tau``, 0 since it was built (the loop never set it)."""
    ev, bundle = fire("make_flownet_tau0", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", "surface"), ev
    rep = nanreplay_json(bundle)
    assert origin(rep) == (True, "forward", "surface", "aten.div", "nan",
                           list(range(8))), rep["origin"]
    assert rep["origin"]["source"] == line_of("ts = torch.exp(-(t_ref - t_last) / self.tau)")
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "0 by the number 0" in h, h
    assert "Here surface's attribute tau is 0, as it was when the recorder attached" in h, h


def test_microsecond_timestamps_underflow_the_time_surface_before_its_max(tmp_path):
    """One recording's timestamps left in microseconds: ``exp(-(t_end - t) / 0.03)`` is
    exp(-1e3..1e6), 0 in float32 at every pixel, and the surface scaled by its max is 0/0 on
    that window. Underflow, with the out-of-scale timestamps named."""
    ev, bundle = fire("make_flownet_by_max", tmp_path, raw_us=29)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        3, "forward", "surface", [5]), ev
    rep = nanreplay_json(bundle)
    assert origin(rep) == (True, "forward", "surface", "aten.div", "nan", [5]), rep["origin"]
    assert rep["origin"]["source"] == line_of("ts = ts / ts.amax((1, 2), keepdim=True)"), rep
    h = rep["hint"]
    assert rep["cause"] == "underflow" and "below float32's smallest normal" in h, h
    assert "sample(s) 5 of args[1] reach 5e+04" in h and "out of scale" in h, h


def test_microsecond_timestamps_overflow_exp_of_the_ratio_form(tmp_path):
    """The same decay written ``exp(t / tau) / exp(t_ref / tau)``: microsecond timestamps make
    both exps +inf on that window. The replay names the exp, overflow, and the out-of-scale
    timestamps, without the exp's generic 'lower the learning rate' (nothing learned reaches
    timestamps)."""
    ev, bundle = fire("make_flownet_ratio", tmp_path, raw_us=29)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        3, "forward", "surface", [5]), ev
    rep = nanreplay_json(bundle)
    assert origin(rep) == (True, "forward", "surface", "aten.exp", "+inf", [5]), rep["origin"]
    assert rep["origin"]["source"] == line_of("ts = torch.exp(t_last / self.tau) / torch.exp"), rep
    h = rep["hint"]
    assert rep["cause"] == "overflow" and "clamp the exponent" in h, h
    assert "made of the batch's data alone" in h and "out of scale" in h, h
    assert "learning rate" not in h, h


def test_nan_timestamp_from_a_bad_file_is_an_input_event(tmp_path):
    """A corrupt packet leaves a NaN timestamp in one recording: the latest-timestamp map
    holds it, an input event on that window before the model ran."""
    ev, bundle = fire("make_flownet", tmp_path, nan_t=29)
    assert (ev["step"], ev["phase"], ev["samples"]) == (3, "input", [5]), ev
    rep = nanreplay_json(bundle)
    assert (rep["origin"]["phase"], rep["origin"]["samples"], rep["cause"]) == (
        "input", [5], "input"), rep
    assert "the batch itself holds NaN/Inf" in rep["hint"], rep["hint"]


def test_hot_pixel_count_overflows_float16_in_the_first_conv(tmp_path):
    """Raw event counts under float16 autocast: a hot pixel's 70000 events exceed float16's
    65504 when the first conv casts its input."""
    ev, bundle = fire("make_flownet_counts", tmp_path, amp=True, hot=29)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        3, "forward", "enc1.0", [5]), ev
    rep = nanreplay_json(bundle)
    assert origin(rep) == (True, "forward", "enc1.0", "aten._to_copy", "+inf",
                           [5]), rep["origin"]
    h = rep["hint"]
    assert rep["cause"] == "overflow" and "float16's largest value" in h, h
    assert "out of scale" in h and "--try drop=5" in h, h


def test_charbonnier_without_eps_is_a_backward_sqrt_at_the_masked_flow(tmp_path):
    """The smoothness term on the flow kept at pixels with events: between pixels with none
    the differences are exactly 0, and ``sqrt(d^2 + 0)``'s gradient there is NaN."""
    ev, bundle = fire("make_flownet", tmp_path, loss_kw={"eps": 0.0})
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    rep = nanreplay_json(bundle)
    assert origin(rep)[:4] == (True, "backward", "<loss>", "SqrtBackward0"), rep["origin"]
    assert rep["origin"]["source"] == line_of("tv = torch.sqrt(dx ** 2 + self.eps ** 2)"), rep
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "the eps added to that input is exactly 0" in h, h


def test_adam_with_eps_0_names_the_update_of_a_dead_channel(tmp_path):
    """Adam with ``eps=0``: weights of channels a ReLU left dead have gradients exactly 0, so
    m / sqrt(v) is 0/0 in the first update: an optimizer event, with eps named (the bundle
    holds the weights after the update, so nothing is re-run: exit 1)."""
    ev, bundle = fire("make_flownet", tmp_path, adam_eps=0.0)
    assert (ev["step"], ev["phase"], ev["params"][0]) == (0, "optimizer", "enc2.0.weight"), ev
    rep = nanreplay_json(bundle, code=1)  # (the weights after the update: not re-run)
    assert (rep["origin"]["phase"], rep["origin"]["param"], rep["cause"]) == (
        "optimizer", "enc2.0.weight", "optimizer"), rep
    assert "with eps=0" in rep["hint"] and "set eps > 0" in rep["hint"], rep["hint"]


def test_healthy_run_raises_nothing_and_trains_the_same(tmp_path):
    """The FlowNet with its count floor and eps's, an empty window among them: no event,
    bit-identical
    weights with and without the recorder."""
    recorded = train("make_flownet", tmp_path, empty=29)
    plain = train("make_flownet", tmp_path, record=False, empty=29)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
