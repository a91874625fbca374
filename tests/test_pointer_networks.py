"""End to end on pointer networks (``pointer_networks_models``): a Ptr-Net sorting numbers and
finding convex hulls, teacher-forced, its chosen positions and padding masked before
``log_softmax``, and See et al.'s pointer-generator on an LSTM with coverage and the source
padding mask passed into ``forward``, trained from a DataLoader with Adam (Adagrad as See et
al. use it), gradient clipping and, for some runs, float16 autocast with a GradScaler. Each
planted bug fires under the recorder and is replayed with the CLI."""

from __future__ import annotations

import pointer_networks_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "pointer_networks_models.py"
BATCH = 4


def call(model, loss_fn, batch):
    if isinstance(model, M.PointerGenerator):
        src, src_ext, src_mask, tgt_in, tgt_out, n_oov = batch
        return loss_fn(model(src, src_ext, src_mask, tgt_in, n_oov), tgt_out)
    pts, lens, target = batch
    return loss_fn(model(pts, lens, target), target)


def train(make, data, loss_fn, out_dir=None, amp=None, adagrad=False, **rec_kw):
    """One epoch over ``data`` (batches of BATCH), clipped at 2, under float16 autocast with a
    GradScaler when ``amp``; under the recorder when ``out_dir`` is given."""
    torch.manual_seed(1)
    model = getattr(M, make)()
    if adagrad:  # See et al.'s optimiser, ported with neither TF's 0.1 start nor an eps
        opt = torch.optim.Adagrad(model.parameters(), lr=0.15, initial_accumulator_value=0.0,
                                  eps=0.0)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=amp is not None)
    collate = M.collate_copy if make == "make_pointer_generator" else M.collate_points
    rec = None
    if out_dir is not None:
        rec = FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir, scaler=scaler,
                             factory=f"pointer_networks_models:{make}", **rec_kw).attach()
        loss_fn = rec.loss_fn
    try:
        for batch in DataLoader(data, batch_size=BATCH, collate_fn=collate):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp is not None):
                loss = call(model, loss_fn, batch)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            scaler.step(opt)
            scaler.update()
        if rec is not None:
            rec.end_step()
    finally:
        if rec is not None:
            rec.detach()
    return model


def replay(tmp_path, make, data, loss_fn, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, data, loss_fn, tmp_path, **kw)
    rep = nanreplay_json(info.value.bundle_path, code=None)
    return info.value.event, rep, rep["origin"]


def where(rep) -> tuple:
    o = rep["origin"]
    return rep["event"]["step"], o["phase"], o["module"], o["op"], o["made"], o["samples"]


# ---------------------------------------------------------------------------------------------
# healthy


def test_healthy_pointer_networks_raise_nothing_and_train_the_same(tmp_path):
    # a padded batch of shorter sorting instances, hulls, the pointer-generator's extended
    # vocabulary and coverage: the same weights bit for bit with and without the recorder
    for make, data, loss_fn in (("make_sorter", M.sort_data(8, shorter=2), M.ptr_loss),
                                ("make_hull", M.hull_data(8), M.ptr_loss),
                                ("make_pointer_generator", M.copy_corpus(8), M.PointerGenLoss())):
        plain = train(make, data, loss_fn).state_dict()
        recorded = train(make, data, loss_fn, tmp_path).state_dict()
        assert not list(tmp_path.glob("*.nan")), make
        for name, t in plain.items():
            assert torch.equal(t, recorded[name]), (make, name)


# ---------------------------------------------------------------------------------------------
# planted bugs


def test_a_missing_value_in_one_sorting_instance_is_input_not_a_per_slice_standardisation(
        tmp_path):
    """Instance 9 lost one number (NaN). Its values are ``(N, 1)``: each slice along the
    points is one number, so one missing number is no "whole slice" of a per-channel
    standardisation; the replay said it was one, and asked for an eps in a std."""
    ev, rep, o = replay(tmp_path, "make_sorter", M.sort_data(16, nan_at={9}), M.ptr_loss)
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (2, "input", "args[0]", [1])
    assert (rep["reproduced"], rep["cause"], o["samples"]) == (True, "input", [1]), rep
    assert rep["hint"].startswith("the batch itself holds NaN/Inf: check the data pipeline"), \
        rep["hint"]
    assert "whole slices" not in rep["hint"] and "std" not in rep["hint"], rep["hint"]


def test_standardising_a_constant_sorting_instance_is_0_over_0(tmp_path):
    ev, rep, o = replay(tmp_path, "make_standardized_sorter",
                        M.sort_data(16, constant_at={9}), M.ptr_loss)
    assert where(rep) == (2, "forward", "", "aten.div", "nan", [1]), o
    assert o["source"] == source_line(
        MODELS, "pts = (pts - pts.mean(1, keepdim=True)) / pts.std(1, keepdim=True)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]


def test_numbers_beyond_float16_under_autocast_overflow_in_the_embedding(tmp_path):
    # numbers up to 2e5 sorted under float16 autocast: the cast of the inputs to half is +inf
    ev, rep, o = replay(tmp_path, "make_sorter", M.sort_data(8, scale=2e5), M.ptr_loss,
                        amp=True)
    assert where(rep) == (0, "forward", "embed", "aten._to_copy", "+inf", [0, 1, 2, 3]), o
    assert rep["cause"] == "overflow" and "float16's largest" in rep["hint"], rep["hint"]


def test_likelihood_as_a_product_of_step_probabilities_underflows(tmp_path):
    # 40 pointer steps of p ~ 1/40: prod p ~ 1e-48 is 0 in float32, its log -inf
    ev, rep, o = replay(tmp_path, "make_sorter", M.sort_data(8, length=40), M.sequence_nll)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "loss", "+inf"), ev
    assert where(rep) == (0, "loss", "<loss>", "aten.log", "-inf", [0, 1, 2, 3]), o
    assert o["source"] == source_line(MODELS, "return -torch.log(p.prod(1)).mean()"), o
    assert rep["cause"] == "underflow" and "a product of 40 nonzero factors" in rep["hint"], \
        rep["hint"]


@pytest.mark.parametrize("guard", [False, True], ids=["after", "guarded"])
def test_adagrad_with_eps_0_and_a_zero_accumulator_is_named_in_its_own_terms(tmp_path, guard):
    """Adagrad's ``grad / (sqrt(sum) + eps)`` over embedding rows absent from the batch, its
    sum started at 0: the hint named Adam's ``m = v = 0`` and Adam's default eps of 1e-8."""
    ev, rep, o = replay(tmp_path, "make_pointer_generator", M.copy_corpus(8), M.PointerGenLoss(),
                        adagrad=True, guard_optimizer=guard)
    assert (ev["step"], ev["phase"], ev["params"]) == (0, "optimizer", ["embedding.weight"]), ev
    assert (rep["reproduced"], rep["cause"], o["op"]) == (
        guard, "optimizer", "aten.addcdiv_" if guard else None), rep
    hint = rep["hint"]
    assert "grad / (sqrt(sum) + eps) is 0/0" in hint and "the default 1e-10" in hint, hint
    assert "initial_accumulator_value=0.1" in hint and "m = v = 0" not in hint, hint


def test_sqrt_distance_to_the_first_point_is_nan_only_in_backward(tmp_path):
    ev, rep, o = replay(tmp_path, "make_anchored_hull", M.hull_data(8), M.ptr_loss)
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    assert where(rep) == (0, "backward", "", "SqrtBackward0", "+inf", [0, 1, 2, 3]), o
    assert o["source"] == source_line(
        MODELS, "dist = ((z - z[:, :1]) ** 2).sum(-1, keepdim=True).sqrt()"), o
    assert rep["cause"] == "invalid" and "torch.linalg.vector_norm" in rep["hint"], rep["hint"]


def test_decoding_a_shorter_instance_past_its_length_masks_every_position(tmp_path):
    """Every third sorting instance has 4 numbers of the batch's 6, the mask is -inf (allowed
    where it is written), and the decoder runs 6 steps for all: by the 5th (call 4) instance 1
    has every position chosen or padding. The hint said the mask might have the other
    convention or the sample be empty; it now says the mask grew over the decoding steps."""
    ev, rep, o = replay(tmp_path, "make_inf_masked_sorter", M.sort_data(8, shorter=2),
                        M.ptr_loss, allow_inf=["", "pointer"])
    assert where(rep) == (0, "forward", "pointer", "aten._log_softmax", "nan", [1]), o
    assert (rep["reproduced"], rep["cause"], o["call"]) == (True, "invalid", 4), rep
    hint = rep["hint"]
    assert "mask grew over the calls of this module" in hint, hint
    assert "left samples [1] 4 position(s) open, by call 4 none" in hint, hint
    assert "other convention (1 = keep" not in hint, hint
