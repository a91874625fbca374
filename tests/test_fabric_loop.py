"""End to end: a custom training loop written with Lightning Fabric as its docs write it —
``Fabric(accelerator="cpu", devices=1, precision="bf16-mixed" or "32-true")``, ``launch``,
``fabric.setup(model, optimizer)`` (a ``_FabricModule`` whose forward enters the precision's
autocast, and a ``_FabricOptimizer``), ``setup_dataloaders``, gradient accumulation under
``no_backward_sync``, ``fabric.backward``, ``fabric.clip_gradients`` once per update,
``fabric.log``, ``fabric.save``/``fabric.load`` — under ``FlightRecorder`` given the objects
``setup`` returned (or the originals, before ``setup``), until a planted bug fires, then
replayed with the CLI. Step numbers are checked against the loop's count of updates."""

from __future__ import annotations

import pytest

fabric_mod = pytest.importorskip("lightning.fabric")

import fabric_loop_models as M  # noqa: E402
import torch  # noqa: E402
from bundles import invoke_cli, nanreplay_json, source_line  # noqa: E402

from recorder import FlightRecorder, NonFiniteError  # noqa: E402

pytestmark = pytest.mark.usefixtures("in_tests_dir")

ACC, BS, K = 4, 2, 2  # micro-batches per update, rows per micro-batch, the planted update
PER_UPDATE = ACC * BS


def record(k: int, micro: int, row: int) -> int:
    """The dataset index of ``row`` of micro-batch ``micro`` of update ``k``."""
    return k * PER_UPDATE + micro * BS + row


def line_of(text: str) -> str:
    return source_line("fabric_loop_models.py", text)


class Loop:
    """The documented Fabric loop; ``updates`` counts the optimizer updates that ran."""

    def __init__(self, data, *, precision="32-true", rec=True, out=None, raw=False,
                 factory="make_regressor", clip_error=False, before=None, at_update=None,
                 crit=None):
        self.fabric = fabric_mod.Fabric(accelerator="cpu", devices=1, precision=precision)
        self.fabric.launch()
        torch.manual_seed(0)
        model = getattr(M, factory)()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.crit = crit or M.MaskedMSE()
        self.rec, self.clip_error = None, clip_error

        def recorder(model, opt):
            return FlightRecorder(model, opt, loss_fn=self.crit, out_dir=out,
                                  factory=f"fabric_loop_models:{factory}") if rec else None
        if raw:  # attached before setup, to the model and optimizer as the user built them
            self.rec = recorder(model, opt)
        self.model, self.opt = self.fabric.setup(model, opt)
        self.loader = self.fabric.setup_dataloaders(
            torch.utils.data.DataLoader(data, batch_size=BS))
        if before:
            before(self)
        if not raw:
            self.rec = recorder(self.model, self.opt)
        self.updates, self.at_update = 0, at_update or {}

    def train(self):
        fabric, model, opt = self.fabric, self.model, self.opt
        for i, b in enumerate(self.loader):
            accumulating = (i + 1) % ACC != 0
            with fabric.no_backward_sync(model, enabled=accumulating):
                loss = self.crit(model(b["x"], b["valid"]), b["y"], b["label_mask"])
                fabric.backward(loss / ACC)
            if not accumulating:
                fabric.clip_gradients(model, opt, max_norm=1.0,
                                      error_if_nonfinite=self.clip_error)
                opt.step()
                opt.zero_grad()
                self.updates += 1
                fabric.log("train/loss", loss.item(), step=self.updates)
                if self.updates in self.at_update:
                    self.at_update[self.updates](self)

    def run(self):
        if self.rec is None:
            return self.train()
        with self.rec:
            self.train()


def fire(loop: Loop, raises=NonFiniteError):
    with pytest.raises(raises):
        loop.run()
    del loop.loader
    rep = nanreplay_json(loop.rec.bundle_path, "--json", code=None)
    return rep, loop.rec.event


def origin(rep):
    o = rep["origin"]
    return (rep["event"]["step"], o["phase"], o["module"], o["op"], o.get("micro_batch"),
            o.get("samples"), rep["cause"])


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_healthy_loop_raises_nothing_and_trains_identically(tmp_path, precision):
    """Eight updates of four micro-batches: no event, the recorder's step is the update
    count, the weights are bit-identical with and without the recorder."""
    weights = []
    for rec in (False, True):
        loop = Loop(M.SensorWindows(64), precision=precision, rec=rec, out=tmp_path / "b")
        loop.run()
        weights.append({k: v.clone() for k, v in loop.model.state_dict().items()})
        if rec:
            assert loop.rec.event is None and loop.rec.step == loop.updates == 8
    assert list(tmp_path.glob("b/*.nan")) == []
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.parametrize("raw", [False, True])
def test_a_nan_reading_inside_the_accumulation_window(tmp_path, raw):
    """A sensor dropout in row 1 of micro-batch 2 of update 2, recorded through the objects
    ``fabric.setup`` returned (was: the bundle held the ``_FabricModule``'s
    ``_forward_module.``-prefixed names and a ``FabricAdamW``, and the replay refused the
    factory's model) or through the originals (``raw``)."""
    loop = Loop(M.SensorWindows(64, nan={record(K, 2, 1)}), out=tmp_path, raw=raw)
    rep, ev = fire(loop)
    assert loop.updates == K and ev["step"] == K
    assert origin(rep) == (K, "input", None, None, 2, [1], "input")
    assert (rep["origin"]["tensor"], rep["origin"]["arg"]) == ("args[0]", "x")
    assert "data pipeline" in rep["hint"]


@pytest.mark.parametrize("raw", [False, True])
def test_bf16_exp_pooling_overflows_on_a_record_in_the_wrong_unit(tmp_path, raw):
    """A record's readings 1e4x: the hand-written attention pooling's exp overflows under
    Fabric's bf16 autocast, inf / inf in the normalisation."""
    loop = Loop(M.SensorWindows(64, loud={record(K, 1, 0)}), precision="bf16-mixed",
                out=tmp_path, raw=raw)
    rep, ev = fire(loop)
    assert loop.updates == K
    assert origin(rep) == (K, "forward", "pool", "aten.exp", 1, [0], "overflow")
    assert rep["origin"]["dtype"] == "bfloat16"
    assert rep["origin"]["source"] == line_of("w = torch.exp(self.score(h)")
    assert "subtract the row max" in rep["hint"] and "out of scale" in rep["hint"]


def test_a_micro_batch_without_labelled_targets_divides_the_loss_by_zero(tmp_path):
    unlabelled = {record(K, 3, 0), record(K, 3, 1)}
    loop = Loop(M.SensorWindows(64, unlabelled=unlabelled), out=tmp_path)
    rep, ev = fire(loop)
    assert loop.updates == K and (ev["phase"], ev["micro_batch"]) == ("loss", 3)
    assert origin(rep) == (K, "loss", "<loss>", "aten.div", 3, [], "invalid")
    assert rep["origin"]["source"] == line_of("return err.sum() / label_mask.sum()")
    assert "label_mask" in rep["hint"] and "clamp_min" in rep["hint"]


def test_clip_gradients_error_if_nonfinite_on_a_backward_only_nan(tmp_path):
    """The encoded path length ``sqrt`` of a sum of squares is 0 between two padded steps: a
    finite forward, an infinite derivative. ``fabric.clip_gradients(...,
    error_if_nonfinite=True)`` raises before ``step()``; the recorder still writes the bundle
    at the first micro-batch's backward."""
    loop = Loop(M.SensorWindows(64), out=tmp_path, factory="make_path_regressor",
                clip_error=True)
    rep, ev = fire(loop, raises=RuntimeError)
    assert loop.updates == 0 and (ev["step"], ev["phase"]) == (0, "backward")
    assert origin(rep)[:4] == (0, "backward", "", "SqrtBackward0")
    assert rep["cause"] == "invalid"
    assert rep["origin"]["source"] == line_of("step = (h[:, 1:] - h[:, :-1])")
    assert "vector_norm" in rep["hint"]
    # micro-batch 0 of the window's four, whose rows the samples are (the text left it out,
    # as for a step of one micro-batch)
    assert (rep["origin"]["micro_batch"], rep["origin"]["samples"]) == (0, [0, 1])
    assert rep["event"]["micro_batches"] == ACC
    text = invoke_cli(loop.rec.bundle_path).stdout.splitlines()
    assert text[1] == "  origin     backward: nan made by SqrtBackward0 in <root>, micro-batch 0"


def corrupt_checkpoint(tmp_path):
    """``fabric.save`` of a fresh run, whose model state then holds a NaN in row 3 of
    ``encoder.2.weight`` (a corrupt save)."""
    ck = tmp_path / "ckpt.pt"
    loop = Loop(M.SensorWindows(8), rec=False)
    loop.fabric.save(ck, {"model": loop.model, "optimizer": loop.opt})
    state = torch.load(ck, weights_only=True)
    state["model"]["encoder.2.weight"][3] = float("nan")
    torch.save(state, ck)
    del loop.loader
    return ck


def test_resuming_from_a_corrupt_checkpoint_with_fabric_load(tmp_path):
    ck = corrupt_checkpoint(tmp_path)
    loop = Loop(M.SensorWindows(64), out=tmp_path / "b",
                before=lambda lp: lp.fabric.load(ck, {"model": lp.model, "optimizer": lp.opt}))
    rep, ev = fire(loop)
    assert loop.updates == 0 and (ev["step"], ev["phase"]) == (0, "weights")
    o = rep["origin"]
    assert (o["param"], o["module"], o["op"], o["rows"], rep["cause"]) == (
        "encoder.2.weight", "encoder.2", "aten.addmm", [3], "weights")
    assert "at the first step the recorder saw" in rep["hint"]
    assert "whole rows" in rep["hint"] and "fabric.load" in rep["hint"]


def test_a_rollback_with_fabric_load_mid_run_is_a_write_between_updates(tmp_path):
    ck = corrupt_checkpoint(tmp_path)
    loop = Loop(M.SensorWindows(64), out=tmp_path / "b", at_update={
        3: lambda lp: lp.fabric.load(ck, {"model": lp.model, "optimizer": lp.opt})})
    rep, ev = fire(loop)
    assert loop.updates == 3 and (ev["step"], ev["last_update_step"]) == (3, 2)
    o = rep["origin"]
    assert (o["param"], o["module"], o["op"], o["rows"], rep["cause"]) == (
        "encoder.2.weight", "encoder.2", "aten.addmm", [3], "weights")
    assert "between that update and step 3" in rep["hint"] and "fabric.load" in rep["hint"]


def test_bf16_true_one_pass_variance_cancels_below_zero(tmp_path):
    """``precision="bf16-true"`` (Fabric casts the weights and inputs to bfloat16): a
    barometric channel near 1013 hPa, whose one-pass variance ``E[x^2] - E[x]^2`` rounds to
    -4096 in row 1 of the first micro-batch (16 in float64)."""
    data = M.SensorWindows(64, full=True, offset=1013.0)
    loop = Loop(data, precision="bf16-true", out=tmp_path,
                factory="make_standardized_regressor")
    rep, ev = fire(loop)
    assert loop.updates == 0 and ev["micro_batch"] == 0
    assert origin(rep) == (0, "forward", "standardize", "aten.sqrt", 0, [1], "precision")
    assert rep["origin"]["dtype"] == "bfloat16"
    assert rep["origin"]["source"] == line_of("return (x - mean) / torch.sqrt(var + 1e-5)")
    assert "torch.var" in rep["hint"]


def test_a_gaussian_density_written_out_underflows_before_its_log(tmp_path):
    """A user-defined NLL ``-log(exp(-z^2 / 2) / (sigma sqrt(2 pi)))``: a target logged in the
    wrong unit (40 among values near 1) puts ``exp`` below float32's range, then ``log(0)``."""
    data = M.SensorWindows(64)
    data.y[record(K, 3, 0), 1] = 40.0
    loop = Loop(data, precision="bf16-mixed", out=tmp_path, crit=M.GaussianLikelihood())
    rep, ev = fire(loop)
    assert loop.updates == K and (ev["phase"], ev["micro_batch"]) == ("loss", 3)
    assert origin(rep) == (K, "loss", "<loss>", "aten.log", 3, [0], "underflow")
    assert rep["origin"]["source"] == line_of("nll = -torch.log(density) * label_mask")
    assert "log space" in rep["hint"] and "out of scale" in rep["hint"]


def test_resuming_an_optimizer_state_with_nan_moments(tmp_path):
    """``fabric.load`` of a checkpoint whose AdamW ``exp_avg_sq`` holds NaN in row 3 of
    ``encoder.2.weight`` (the weights finite): the first update writes NaN there. The report
    said "finite gradients became non-finite weights: check the learning rate and schedule,
    eps" (the bundle holds the state after the update); it now tells the NaN moment beside a
    finite ``exp_avg`` as state that came in so."""
    ck = tmp_path / "ckpt.pt"
    warm = Loop(M.SensorWindows(8), rec=False)
    warm.run()
    warm.fabric.save(ck, {"model": warm.model, "optimizer": warm.opt})
    del warm.loader
    state = torch.load(ck, weights_only=True)
    state["optimizer"]["state"][2]["exp_avg_sq"][3] = float("nan")  # (encoder.2.weight)
    torch.save(state, ck)
    loop = Loop(M.SensorWindows(64), out=tmp_path / "b",
                before=lambda lp: lp.fabric.load(ck, {"model": lp.model, "optimizer": lp.opt}))
    rep, ev = fire(loop)
    assert (ev["step"], ev["phase"]) == (0, "optimizer")
    assert (rep["origin"]["param"], rep["cause"]) == ("encoder.2.weight", "optimizer")
    assert "exp_avg_sq of encoder.2.weight holds NaN at 16 element(s) where exp_avg is " \
        "finite" in rep["hint"]
    assert "held NaN before this update" in rep["hint"] and "fabric.load" in rep["hint"]
    assert "learning rate" not in rep["hint"]
