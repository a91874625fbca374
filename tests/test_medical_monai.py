"""End to end: medical image segmentation with MONAI as its users train it (``medical_monai_models``:
MONAI's 3-D ``UNet`` on 16^3 CT-like volumes, dict samples through MONAI's transforms,
``CacheDataset`` and ``DataLoader``, MONAI's Dice, generalized Dice and focal losses), run by
MONAI's ignite-based ``SupervisedTrainer`` (gradient accumulation included) or a plain loop
under float16 autocast with a ``GradScaler`` — under ``FlightRecorder`` until a planted bug
fires, then replayed with the CLI. Step numbers are checked against the engine's iteration."""

from __future__ import annotations

import pytest

pytest.importorskip("monai")
pytest.importorskip("ignite")

import medical_monai_models as M  # noqa: E402
import torch  # noqa: E402
from bundles import nanreplay_json, source_line  # noqa: E402
from monai.data import DataLoader  # noqa: E402
from monai.engines import SupervisedTrainer  # noqa: E402

from recorder import FlightRecorder, NonFiniteError  # noqa: E402

pytestmark = pytest.mark.usefixtures("in_tests_dir")

B = 2  # batch size
CPU = torch.device("cpu")


def trainer(model, opt, loss, data, epochs=1, **kw):
    loader = DataLoader(data, batch_size=B, shuffle=False)
    return SupervisedTrainer(device=CPU, max_epochs=epochs, train_data_loader=loader,
                             network=model, optimizer=opt, loss_function=loss, **kw)


def fire(tmp_path, t, model, opt, loss):
    """``t.run()`` under the recorder until the event: its JSON report and the event."""
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path / "b",
                            factory="medical_monai_models:make_unet"):
            t.run()
    return nanreplay_json(info.value.bundle_path, code=None), info.value.event


def origin(rep):
    o = rep["origin"]
    return o["phase"], o["module"], o["op"], rep["event"]["step"], rep["cause"], o["samples"]


def adam(model, lr=1e-2):
    return torch.optim.Adam(model.parameters(), lr=lr)


def healthy_run(tmp_path, record):
    """Two epochs of DiceCE on ``MetaTensor`` samples (MONAI's default), accumulating over 2
    iterations."""
    model, loss = M.make_unet(), M.dice_ce()
    opt = adam(model)
    t = trainer(model, opt, loss, M.dataset(M.cases(8), track_meta=True), epochs=2,
                accumulation_steps=2)
    if record:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path / "b") as rec:
            t.run()
        assert rec.event is None and rec.step == t.state.iteration // 2 == 4
        assert list((tmp_path / "b").glob("*.nan")) == []
    else:
        t.run()
    return model.state_dict()


def test_healthy_run_raises_nothing_and_trains_identically(tmp_path):
    plain = healthy_run(tmp_path / "plain", record=False)
    recorded = healthy_run(tmp_path / "rec", record=True)
    assert plain.keys() == recorded.keys()
    assert all(torch.equal(plain[k], recorded[k]) for k in plain)


def test_a_nan_voxel_in_one_case_is_an_input_event_on_that_case(tmp_path):
    """Case 5 holds NaN voxels: the third iteration's batch (cases 4, 5), sample 1."""
    model, loss = M.make_unet(), M.dice_ce()
    opt = adam(model)
    t = trainer(model, opt, loss, M.dataset(M.cases(8, nan_at=[5]), track_meta=True))
    rep, ev = fire(tmp_path, t, model, opt, loss)
    assert t.state.iteration - 1 == ev["step"]
    assert origin(rep) == ("input", None, None, 2, "input", [1])


def test_under_accumulation_the_nan_case_is_named_in_its_micro_batch(tmp_path):
    """``accumulation_steps=2``: case 7 is in iteration 4, the second micro-batch of step 1."""
    model, loss = M.make_unet(), M.dice_ce()
    opt = adam(model)
    t = trainer(model, opt, loss, M.dataset(M.cases(8, nan_at=[7])), accumulation_steps=2)
    rep, ev = fire(tmp_path, t, model, opt, loss)
    assert (ev["step"], ev["micro_batch"], t.state.iteration) == (1, 1, 4)
    assert origin(rep) == ("input", None, None, 1, "input", [1])
    assert rep["origin"]["micro_batch"] == 1


def test_generalized_dice_of_an_empty_label_map_without_smoothing_is_0_by_0(tmp_path):
    """Case 3's label map is all background; with ``include_background=False`` every class
    of it is absent, MONAI's weights 1/volume^2 are all inf and replaced by 0, and with
    ``smooth_nr = smooth_dr = 0`` its Dice is 0/0: a loss event on sample 1 of step 1, whose
    hint names the classes the label map (of class indices, one-hot encoded by the loss) lacks
    in that sample only, and the loss's smoothing attributes of 0 that its code adds."""
    model, loss = M.make_unet(), M.gdl_no_smoothing()
    opt = adam(model)
    t = trainer(model, opt, loss, M.dataset(M.cases(8, empty_at=[3])))
    rep, _ = fire(tmp_path, t, model, opt, loss)
    assert origin(rep) == ("loss", "<loss>", "aten.div", 1, "invalid", [1])
    assert rep["origin"]["source"].endswith(f"monai/losses/dice.py:{M.GDL_DIVISION_LINE}")
    assert "0 by 0" in rep["hint"] and "eps added to that input is exactly 0" in rep["hint"]
    assert "Sample(s) 1 hold no entry of loss_args[1] class 1, 2 (a label map of class " \
        "indices, one-hot encoded in the loss" in rep["hint"]
    assert rep["hint"].endswith(
        "Here the loss's attributes smooth_nr and smooth_dr, which its code adds (+ self.smooth_nr"
        ", + self.smooth_dr), are 0.0: that eps of 0 is one of them; build the loss with "
        "smooth_nr > 0 and smooth_dr > 0")


def test_focal_gamma_below_one_makes_a_backward_only_nan_named_with_the_users_call(tmp_path):
    """MONAI's softmax focal loss with gamma = 0.5 inside the user's compound loss: once a
    voxel's p_t rounds to 1, ``(1 - p_t) ** 0.5``'s derivative is infinite there and the
    gradient NaN while the loss is finite (iteration 9). The node's line is MONAI's; the
    report names the user's line that called into MONAI too."""
    model, loss = M.make_unet(), M.DiceFocal()
    opt = adam(model, lr=3e-2)
    t = trainer(model, opt, loss, M.dataset(M.cases(8)), epochs=4)
    rep, ev = fire(tmp_path, t, model, opt, loss)
    assert t.state.iteration - 1 == ev["step"]
    assert origin(rep) == ("backward", "<loss>", "PowBackward0", 8, "precision", [0])
    o = rep["origin"]
    assert o["source"].endswith("monai/losses/focal_loss.py:266")
    assert o["called_from"] == source_line("medical_monai_models.py",
                                           "self.lambda_focal * self.focal(logits, label)")
    assert "focal loss" in rep["hint"] and "clamp_min(eps)" in rep["hint"]


def test_an_unnormalised_site_overflows_float16_autocast_in_the_first_convolution(tmp_path):
    """Raw MR intensities, no ``NormalizeIntensityd``: case 5 comes from a site whose scanner
    writes 90x larger values (up to 6.5e4, still finite in float16), and the first
    convolution's sum overflows under float16 autocast: step 2, sample 1, named as data out
    of scale rather than a type to widen."""
    model, loss = M.make_unet(), M.dice_ce()
    opt = adam(model, lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    loader = DataLoader(M.dataset(M.mr_cases(8, other_site_at=[5], site_scale=90.0),
                                  normalise=False), batch_size=B)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path / "b", scaler=scaler,
                            factory="medical_monai_models:make_unet"):
            for batch in loader:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    out = loss(model(batch["image"]), batch["label"])
                scaler.scale(out).backward()
                scaler.step(opt)
                scaler.update()
    rep = nanreplay_json(info.value.bundle_path, code=None)
    assert origin(rep) == ("forward", "model.0.residual", "aten.convolution", 2, "overflow", [1])
    assert "out of scale" in rep["hint"] and "drop=1" in rep["hint"]


def test_a_learning_rate_blowup_is_an_overflow_the_precursors_trace_to_the_weights(tmp_path):
    """SGD at lr 50: the weights jump at step 1, the loss at step 2, and at step 5 the
    instance norm's backward overflows; the hint says the run was diverging and to lower the
    learning rate, not to widen the type."""
    model, loss = M.make_unet(), M.dice_ce()
    opt = torch.optim.SGD(model.parameters(), lr=50.0)
    t = trainer(model, opt, loss, M.dataset(M.cases(8)), epochs=5)
    rep, ev = fire(tmp_path, t, model, opt, loss)
    assert t.state.iteration - 1 == ev["step"]
    assert origin(rep) == ("backward", "model.1.submodule.2.0.adn.N", "NativeBatchNormBackward0",
                           5, "overflow", [0, 1])
    assert "lower the learning rate" in rep["hint"]
    kinds = {(p["step"], p["kind"]) for p in rep["precursors"]}
    assert {(1, "weight_jump"), (2, "loss_jump")} <= kinds


def test_class_weights_of_the_batch_are_infinite_for_a_class_it_lacks(tmp_path):
    """Cross entropy weighted by 1 / the batch's volume of each class: cases 4 and 5 have no
    lesion, so the third iteration's batch holds none, its weight is 1/0 and the normalised
    weights inf/inf. No sample is to blame: a batch count, named as such."""
    model, loss = M.make_unet(), M.BatchWeightedCE()
    opt = adam(model)
    t = trainer(model, opt, loss, M.dataset(M.cases(8, no_lesion_at=[4, 5])))
    rep, _ = fire(tmp_path, t, model, opt, loss)
    assert origin(rep) == ("loss", "<loss>", "aten.reciprocal", 2, "invalid", [])
    assert rep["origin"]["source"] == source_line("medical_monai_models.py", "w = 1.0 / volume")
    assert "count per class" in rep["hint"] and "no sample is to blame" in rep["hint"]


def test_only_attributes_added_as_a_term_are_read_as_an_eps():
    """``+ self.smooth_dr`` is an eps the function adds; ``+ self.lambda_focal * focal`` (a
    weight of a term) and ``+ self.f(x)`` are not."""
    import monai.losses.dice as dice

    from replay.zero_eps_attribute import _added_attributes

    assert _added_attributes(f"{dice.__file__}:{M.GDL_DIVISION_LINE}") == {"smooth_nr",
                                                                          "smooth_dr"}
    compound = source_line("medical_monai_models.py", "self.lambda_focal * self.focal(")
    assert _added_attributes(compound) == set()
