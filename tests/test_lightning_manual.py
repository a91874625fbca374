"""End to end: PyTorch Lightning training as its users write it (``lightning_manual_models``):
a GAN under manual optimization (``self.optimizers()``, ``toggle_optimizer``,
``manual_backward``, ``clip_gradients``) with a ``FlightRecorder`` attached in
``on_train_start`` to the network to watch; a heteroscedastic regressor under automatic
optimization (two parameter groups, a per-step ``LambdaLR`` warmup, ``bf16-mixed``, gradient
accumulation and clipping, ``ModelCheckpoint``, ``EarlyStopping``, a ``LightningDataModule``)
recorded by ``FlightRecorderCallback``. Each planted bug is replayed with the CLI."""

from __future__ import annotations

import json

import pytest

L = pytest.importorskip("lightning")

import lightning_manual_models as M  # noqa: E402
import torch  # noqa: E402
from bundles import nanreplay_json, source_line  # noqa: E402
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint  # noqa: E402

from recorder import NonFiniteError  # noqa: E402
from recorder.lightning import FlightRecorderCallback  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("in_tests_dir"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
]


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)  # the modules' initial weights


def line_of(text: str) -> str:
    return source_line("lightning_manual_models.py", text)


def fit_regressor(out, module, data, factory, record=True, max_steps=12, extra=None,
                  **trainer_args):
    torch.manual_seed(0)
    cbs = [EarlyStopping("val_loss", patience=50), ModelCheckpoint(dirpath=out,
                                                                   monitor="val_loss")]
    cbs += [extra] if extra is not None else []
    if record:
        cbs.append(FlightRecorderCallback(module="model", loss_fn="criterion", out_dir=out,
                                          factory=f"lightning_manual_models:{factory}"))
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=cbs,
                        val_check_interval=4, num_sanity_val_steps=0, **trainer_args)
    trainer.fit(module, datamodule=data)
    return trainer


def fit_gan(module, data, max_steps=40):
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=M.B))
    return trainer


def report(fit, *args, step, phase, **kw) -> tuple[dict, dict]:
    with pytest.raises(NonFiniteError) as info:
        fit(*args, **kw)
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (step, phase), ev
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["reproduced"] is True, json.dumps(rep, indent=1)
    return rep, rep["origin"]


BF16 = {"precision": "bf16-mixed", "accumulate_grad_batches": 2, "gradient_clip_val": 1.0}


def test_healthy_bf16_fit_raises_nothing_and_trains_bit_identically(tmp_path):
    runs = []
    for record in (False, True):
        torch.manual_seed(0)
        module = M.Regressor()
        trainer = fit_regressor(tmp_path / str(record), module, M.RowsData(), "make_mlp",
                                record=record, **BF16)
        runs.append((trainer.global_step, [p.detach().clone() for p in module.parameters()]))
    (s0, w0), (s1, w1) = runs
    assert s0 == s1 == 12
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert not list(tmp_path.rglob("*.nan"))


def test_healthy_gan_watched_either_side_raises_nothing(tmp_path):
    weights = []
    for watch in (None, "gen", "disc"):
        torch.manual_seed(0)
        module = M.GAN(tmp_path, watch=watch)
        fit_gan(module, M.real_images())
        weights.append([p.detach().clone() for p in module.parameters()])
    assert all(torch.equal(a, b) for w in weights[1:] for a, b in zip(weights[0], w))
    assert not list(tmp_path.glob("*.nan"))


def test_a_nan_feature_from_the_datamodule_is_an_input_event_at_its_step(tmp_path):
    """Item 21 (row 5 of the third batch) holds NaN at feature 2; two batches are accumulated
    per optimizer step, so it is step 1 = ``trainer.global_step`` then. The batch was masked
    with ``x * mask`` (-0 at the odd rows' missing features): the hint said those -0s were a
    missing-value code "10x any observed entry" (the NaN made the comparison pass) and told to
    zero them, which the loop already did; it now leaves them out."""
    seen = {}

    class GlobalStep(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen[batch_idx] = trainer.global_step

    rep, o = report(fit_regressor, tmp_path, M.Regressor(), M.RowsData(nan_at=[21]),
                    "make_mlp", extra=GlobalStep(), step=1, phase="input", **BF16)
    assert seen[2] == 1 and rep["event"]["step"] == seen[2]
    assert (o["samples"], o["made"], rep["cause"]) == ([5], "nan", "input"), rep
    assert "sample 5 at feature(s) 2 (of 16)" in rep["hint"], rep["hint"]
    assert "missing values coded as" not in rep["hint"], rep["hint"]


def test_a_nan_validation_row_stops_the_fit_before_early_stopping_sees_a_nan_metric(tmp_path):
    """Validation item 10 (row 2 of the second batch) holds NaN; ``EarlyStopping`` on
    ``val_loss`` would stop on its NaN metric with no word of where it came from. The recorder
    checks the validation forward (after 4 steps: ``val_check_interval=4``) and names the
    row."""

    class Data(M.RowsData):
        def setup(self, stage=None):
            super().setup(stage)
            self.val = M.rows(16, seed=1, nan_at=[10])

    rep, o = report(fit_regressor, tmp_path, M.Regressor(), Data(), "make_mlp", step=4,
                    phase="input")
    assert rep["event"]["evaluation"] is True
    assert (o["samples"], o["made"], rep["cause"]) == ([2], "nan", "input"), rep
    assert "sample 2 at feature(s) 2 (of 16)" in rep["hint"], rep["hint"]


def test_a_relu_variance_head_is_log_of_0_in_the_loss_of_two_outputs(tmp_path):
    """The Gaussian NLL takes the model's mean and variance; the variance head is a ReLU,
    exactly 0 for rows 0, 1, 3, 5, 6 and 7 at the first step."""
    rep, o = report(fit_regressor, tmp_path, M.Regressor("relu"), M.RowsData(),
                    "make_relu_mlp", gradient_clip_val=1.0, step=0, phase="loss")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.log", "-inf", [0, 1, 3, 5, 6, 7], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("return (0.5 * (torch.log(var) + (y - mean) ** 2 / var))")
    assert "made by aten.relu" in rep["hint"] and "softplus(x) + eps" in rep["hint"]


def test_an_uncapped_warmup_is_named_as_the_schedule_still_rising(tmp_path):
    """``LambdaLR(start ** (1 - step / warmup))`` without ``min(step, warmup)``: the rate keeps
    growing 3.16x per step past its base, until the loss's square overflows at step 19. The
    hint blamed AdamW's ``lr * weight_decay`` and advised a lower weight decay or base rate; it
    now says first that the schedule's rise never ended."""
    rep, o = report(fit_regressor, tmp_path, M.Regressor(clamp=False, lr=0.05),
                    M.RowsData(n=512), "make_mlp", max_steps=60, step=19, phase="loss")
    assert (o["module"], o["op"], o["made"], o["all_samples"], rep["cause"]) == (
        "<loss>", "aten.pow", "+inf", True, "overflow"), json.dumps(rep, indent=1)
    assert "learning rate (group 0) rose at each of the 19 steps from step 0 to step 19, " \
           "about 3.16x per step" in rep["hint"], rep["hint"]
    assert "min(step, warmup_steps) left out of a LambdaLR's lambda" in rep["hint"]


def test_a_pairwise_distance_with_its_diagonal_is_nan_in_backward_only(tmp_path):
    """The generator's mode-seeking term takes ``sqrt`` of every pair's squared distance,
    each fake's distance to itself (0) included: finite forward, +-inf derivative."""
    module = M.GAN(tmp_path, diversity=0.1)
    rep, o = report(fit_gan, module, M.real_images(), step=0, phase="backward")
    assert module.steps == [(1, 0)]  # the discriminator stepped first: global_step 1
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "<loss>", "SqrtBackward0", list(range(M.B)), "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("dist = ((fake[:, None] - fake[None]) ** 2).sum(-1).sqrt()")
    assert "torch.linalg.vector_norm" in rep["hint"], rep["hint"]


def test_raw_pixels_round_the_discriminators_probability_to_1(tmp_path):
    """Real images left at 0..255 (no ``Normalize``): the discriminator's logits of the real
    rows (0-7 of its batch of real and fake rows) are 15 to 27 at once; above 16.6 sigmoid
    rounds to 1 (rows 0, 2, 4, 5, 6, 7), and the hand-written BCE's ``log(1 - p)`` is -inf
    there."""
    module = M.GAN(tmp_path, watch="disc")
    rep, o = report(fit_gan, module, M.real_images(pixels=True), step=0, phase="loss")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.log", "-inf", [0, 2, 4, 5, 6, 7], "precision"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("return -(labels * torch.log(p) + (1 - labels)")
    assert "binary_cross_entropy_with_logits" in rep["hint"], rep["hint"]


def test_a_minibatch_std_over_the_last_batch_of_one_is_named_with_drop_last(tmp_path):
    """65 images in batches of 8: the ninth batch holds one image, and the discriminator's
    minibatch-std layer, inside the generator's loss, takes ``std`` of one row (n - 1 = 0).
    Step 8 is the generator's ninth update; Lightning's ``global_step``, which counts both
    optimizers' steps, is 17 there. The hint listed sums over the batch's other samples
    (InfoLOOB's negatives, a leave-one-out mean) as what a batch of one empties; it now names
    the std as the batch's spread."""
    module = M.GAN(tmp_path, mbstd=True)
    rep, o = report(fit_gan, module, M.real_images(n=65), step=8, phase="loss")
    assert module.steps[-1] == (17, 8)
    assert (o["module"], o["op"], o["made"], rep["cause"]) == (
        "<loss>", "aten.std", "nan", "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("s = h.std(0).mean()")
    assert "the micro-batch holds 1 sample" in rep["hint"]
    assert "aten.std reduces over the batch's samples" in rep["hint"], rep["hint"]
    assert "drop_last=True" in rep["hint"], rep["hint"]


def test_a_nan_real_image_breaks_the_discriminator_the_generators_loss_holds(tmp_path):
    """Real image 20 (the third batch) holds a NaN pixel: the discriminator's own update, which
    the generator's recorder does not watch, writes NaN into its weights; the generator's loss
    through it is NaN at that same batch's generator step, and the report names the
    discriminator's parameters and who can record them."""
    data = M.real_images()
    data.tensors[0][20, 3] = float("nan")
    module = M.GAN(tmp_path)
    rep, o = report(fit_gan, module, data, step=2, phase="loss")
    assert module.steps[-1] == (5, 2)
    assert (o["module"], o["op"], o["made"], rep["cause"]) == (
        "<loss>", "aten.t", "nan", "weights"), json.dumps(rep, indent=1)
    assert "the loss's 'disc.body.0.weight' holding nan" in rep["hint"], rep["hint"]
    assert "FlightRecorder(disc, its optimizer, ...)" in rep["hint"], rep["hint"]


def test_the_minibatch_std_in_the_recorded_discriminators_own_forward(tmp_path):
    """The same last batch of one, the discriminator recorded itself: its forward in the
    generator's loss of batch 8 opens its step 9 (after its 9th update) and makes the NaN. The
    hint gave only the op's advice; it now says the output is finite on the sample given
    twice, and drop_last."""
    module = M.GAN(tmp_path, mbstd=True, watch="disc")
    rep, o = report(fit_gan, module, M.real_images(n=65), step=9, phase="forward")
    assert module.steps[-1] == (17, 9)
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "", "aten.std", "nan", [0], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("s = h.std(0).mean()")
    assert "the model's output is finite on that sample given twice: aten.std reduces over " \
           "the batch's samples" in rep["hint"], rep["hint"]
    assert "drop_last=True" in rep["hint"], rep["hint"]


def test_a_warmup_that_ends_on_time_is_not_named_as_still_rising():
    """``replay.rising_lr`` on ring histories: an exponential warmup from 1e-3 of the base
    rate over 10 steps is still rising at an event inside it (1000x), which is no fault of
    the schedule; the same warmup uncapped reaches 1e5x by step 15."""
    from replay.rising_lr import rising_lr_text

    def hist(event, clamp):
        lam = M.warmup_lambda(10, start=1e-3, clamp=clamp)
        steps = list(range(event + 1))
        return {"steps": steps, "lr": [[lam(s)] for s in steps], "event_step": event}

    assert rising_lr_text(hist(9, clamp=True)) is None
    assert rising_lr_text(hist(30, clamp=True)) is None
    assert rising_lr_text(hist(15, clamp=False)).startswith(
        "the learning rate rose at each of the 15 steps from step 0 to step 15, about 2x per "
        "step, to 31.62 (3.16e+04x its 0.001 at step 0)")
