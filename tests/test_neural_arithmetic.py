"""End to end: neural arithmetic units and symbolic regression (``neural_arithmetic_models``:
NALU-pytorch's and stable-nalu's NAC/NALU, iNALU's clipped exponent and sign correction,
stable-nalu's NAU/NMU with their sparsity regulariser, an EQL network with sin/cos/sqrt/log/exp
units, gplearn's protected division and EQL-div's thresholded division output), trained on
stable-nalu's arithmetic task from a DataLoader under the recorder until a planted bug fires,
then replayed with the CLI."""

from __future__ import annotations

import neural_arithmetic_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

BS = 8


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("neural_arithmetic_models.py", text)


class Half(M.Arithmetic):
    """The task's rows cast to float16 (a half-precision data pipeline), targets in float32."""

    def __getitem__(self, i):
        return self.x[i].half(), self.y[i]


def train(out_dir, factory: str, data, steps: int = 6, eql: bool = False, reg: float = 0.0,
          sgd: bool = False):
    """Adam (SGD with momentum for a half model) under a StepLR schedule; MSE, or EQL-div's
    loss with its penalty on small denominators; ``reg`` times the model's sparsity
    regulariser (stable-nalu's ``regualizer``) added to the loss."""
    model = getattr(M, factory)()
    opt = (torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9) if sgd
           else torch.optim.Adam(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
    crit = M.eql_loss if eql else torch.nn.MSELoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory=f"neural_arithmetic_models:{factory}") as rec:
        for step, (x, y) in enumerate(DataLoader(data, batch_size=BS)):
            if step == steps:
                break
            loss = rec.loss_fn(model(x), y)
            if reg:
                loss = loss + reg * model.regualizer()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()


def event(out_dir, *args, **kwargs):
    with pytest.raises(NonFiniteError) as info:
        train(out_dir, *args, **kwargs)
    return info.value.event, nanreplay_json(info.value.bundle_path)


def test_healthy_arithmetic_units_raise_no_event(tmp_path):
    """NALU with NALU-pytorch's eps (also on rows with a blank feature: log(0 + 1e-10) is
    finite), iNALU's clipped exponent, NAU -> NMU with the sparsity regulariser, EQL-div with
    protected units and the guarded divisions on the division task: no event."""
    train(tmp_path, "make_nalu", M.Arithmetic(48, zero_rows=[3, 20]))
    train(tmp_path, "make_inalu", M.Arithmetic(48, zero_rows=[5]))
    train(tmp_path, "make_nau_nmu", M.Arithmetic(48), reg=0.1)
    train(tmp_path, "make_eql", M.Arithmetic(48, op=torch.div, zero_rows=[4, 20]), eql=True)
    assert not list(tmp_path.rglob("*.nan"))


def test_nalu_without_eps_takes_the_log_of_a_blank_feature(tmp_path):
    """eps = 0 in the multiplicative path: log(|0|) = -inf in the first cell, on the one row
    of the third batch whose last feature is 0."""
    ev, rep = event(tmp_path, "make_nalu_eps0", M.Arithmetic(48, zero_rows=[19]))
    assert (ev["step"], ev["phase"]) == (2, "forward")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "layer_1", "aten.log", "-inf", [3]), rep
    assert o["source"] == line_of("log_x = torch.log(torch.abs(x) + self.eps)")
    assert o["input_range"][0] == 0.0
    assert "pole at 0" in rep["hint"] and "add an eps" in rep["hint"], rep["hint"]


def test_nalu_s_eps_lost_in_float16_is_the_fix_not_log_space(tmp_path):
    """NALU-pytorch's eps = 1e-10 is 0 in float16 (the model cast with .half()): the blank
    feature's log is -inf again. The hint must name the lost eps, not log-space rewrites of a
    value that underflowed."""
    ev, rep = event(tmp_path, "make_nalu_half", Half(48, zero_rows=[19]), sgd=True)
    assert (ev["step"], ev["phase"]) == (2, "forward")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["dtype"], o["samples"]) == (
        True, "underflow", "layer_1", "aten.log", "float16", [3]), rep
    assert o["source"] == line_of("log_x = torch.log(torch.abs(x) + self.eps)")
    assert "the eps 1e-10 added to that input is 0 in float16" in rep["hint"], rep["hint"]
    assert "log space" not in rep["hint"] and "log_softmax" not in rep["hint"], rep["hint"]


def test_a_gated_out_multiplicative_path_overflowing_on_extrapolation_rows_is_its_exp(
        tmp_path):
    """A NALU that learned addition (gate at exactly 1) still computes exp(W log|x|): on the
    extrapolation row of scale 1e10 it is +inf, and (1 - g) * inf = 0 * inf is NaN. The origin
    is the exp's overflow (iNALU's fix: clip the exponent), the mul is only the chain's end."""
    ev, rep = event(tmp_path, "make_nalu_converged_add",
                    M.Arithmetic(48, big_rows=[26], big=1e10))
    assert (ev["step"], ev["phase"]) == (3, "forward")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "overflow", "layer_1", "aten.exp", "+inf", [2]), rep
    assert o["source"] == line_of("m = torch.exp(self.nac(log_x))")
    assert [(c["op"], c["made"]) for c in o["chain"]] == [("aten.exp", "+inf"),
                                                          ("aten.mul", "nan")], o["chain"]
    assert o["chain"][1]["source"] == line_of("return g * a + (1 - g) * m")
    assert "bound a learned exponent" in rep["hint"], rep["hint"]
    assert "--try drop=2" in rep["hint"], rep["hint"]


def test_gplearn_s_protected_division_by_a_blank_variable_sends_nan_through_the_where(
        tmp_path):
    """where(|d| > 0.001, z / d, 1) hides z / 0 in the forward; the backward still divides
    the masked 0 gradient by d = 0 (0 / 0) into the hidden layer's weights, on the two rows
    of the third batch whose last variable is 0."""
    ev, rep = event(tmp_path, "make_eql_unguarded",
                    M.Arithmetic(48, op=torch.div, zero_rows=[20, 22]), eql=True)
    assert (ev["step"], ev["phase"]) == (2, "backward")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "hidden", "DivBackward0", [4, 6]), rep
    assert o["param"] == "hidden.linear.weight", o
    assert o["source"] == line_of("ratio = torch.where(ok, z[:, 8:9] / d, torch.ones_like(d))")
    assert "divisor is exactly 0" in rep["hint"], rep["hint"]
    assert "torch.where(den > 0, den, 1)" in rep["hint"], rep["hint"]


def test_an_unprotected_log_unit_of_a_negative_pre_activation_asks_to_clamp_it(tmp_path):
    """EQL's log unit without DeepSymRegTorch's protection: log of the linear layer's negative
    outputs, at the first step, on the rows where that unit's argument is below 0."""
    ev, rep = event(tmp_path, "make_eql_unprotected", M.Arithmetic(48, op=torch.div), eql=True)
    assert (ev["step"], ev["phase"]) == (0, "forward")
    o = rep["origin"]
    z = M.make_eql_unprotected().hidden.linear(M.Arithmetic(48, op=torch.div).x[:BS])
    negative = [i for i in range(BS) if z[i, 6] < 0]
    assert negative, "the planted bug needs a negative argument"
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "hidden", "aten.log", "nan", negative), rep
    assert o["source"] == line_of("log = torch.log(z[:, 6:7])")
    assert "log of a negative number" in rep["hint"], rep["hint"]
    assert "clamp the op's input into its domain" in rep["hint"], rep["hint"]


class HalfTargets(M.Arithmetic):
    """The rows and their targets cast to the half model's dtype."""

    def __getitem__(self, i):
        return self.x[i].half(), self.y[i].half()


def test_an_extrapolation_batch_s_targets_cast_to_float16_name_the_cast(tmp_path):
    """The extrapolation range's products (up to 1.4e6) cast to float16 are +inf in every row
    of the fourth batch. The hint spoke only of a teacher's output, a per-batch std of 0 and
    the data pipeline; the targets are finite data, made infinite by the cast."""
    ev, rep = event(tmp_path, "make_nau_nmu_half",
                    HalfTargets(48, big_rows=range(24, 32), big=300.0), sgd=True)
    assert (ev["step"], ev["phase"]) == (3, "input")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["tensor"], o["made"], o["samples"]) == (
        True, "input", "loss_args[1]", "+inf", list(range(BS))), rep
    assert rep["hint"].startswith("loss_args[1] is float16 and holds +Inf but no NaN: "
                                  "float16's largest value is 65504"), rep["hint"]
    assert "keep it in float32" in rep["hint"], rep["hint"]


def test_a_float16_input_row_beyond_65504_names_the_cast_not_bad_files(tmp_path):
    """One extrapolation row of the fourth batch, scaled by 1e5, is +inf once the pipeline casts
    it to float16: an input event on that sample, whose hint names the cast first."""
    ev, rep = event(tmp_path, "make_nau_nmu_half", Half(48, big_rows=[26], big=1e5), sgd=True)
    assert (ev["step"], ev["phase"]) == (3, "input")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["made"], o["samples"]) == (
        True, "input", "+inf", [2]), rep
    assert "is float16 and holds +Inf but no NaN" in rep["hint"], rep["hint"]
    assert "a value beyond it becomes +Inf when cast to float16" in rep["hint"], rep["hint"]


def test_a_gated_out_exp_factor_s_gradient_overflow_says_to_bound_the_exponent(tmp_path):
    """The same converged NALU on a row of scale 1e8: exp(W log|x|) is 1e32, finite, and the
    gate of exactly 1 drops it from the output; the gate's gradient, grad * m, overflows in the
    backward. The hint said only "rescale its inputs (subtract the row max before exp ...) or
    compute it in float64"; the forward overflow of the same exp says to bound its exponent."""
    ev, rep = event(tmp_path, "make_nalu_converged_add",
                    M.Arithmetic(48, big_rows=[26], big=1e8))
    assert (ev["step"], ev["phase"]) == (3, "backward")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["param"], o["samples"]) == (
        True, "overflow", "layer_1", "MulBackward0", "layer_1.G", [2]), rep
    assert o["source"] == line_of("return g * a + (1 - g) * m")
    assert "a factor an exponential made in the forward" in rep["hint"], rep["hint"]
    assert "bound the exponent (s.clamp(max=...)" in rep["hint"], rep["hint"]
    assert "subtract the row max" not in rep["hint"], rep["hint"]


def test_an_l_half_penalty_after_trimming_names_the_weights_at_its_pole(tmp_path):
    """EQL's L_1/2 penalty sum(|w| ** 0.5), given the model in the loss; the loop's trimming
    phase sets small weights to exactly 0 before the fourth step, whose backward takes
    0.5 * 0 ** -0.5 = inf. The hint spoke of "a forward that masks the value out ...
    torch.where(mask, x, 1)": nothing was masked, the weights sit on the power's pole."""
    model = M.make_eql()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.eql_loss_sparse, out_dir=tmp_path,
                            factory="neural_arithmetic_models:make_eql") as rec:
            loader = DataLoader(M.Arithmetic(48, op=torch.div), batch_size=BS)
            for step, (x, y) in enumerate(loader):
                if step == 3:
                    M.trim(model)
                loss = rec.loss_fn(model(x), y, model)
                opt.zero_grad()
                loss.backward()
                opt.step()
    ev, rep = info.value.event, nanreplay_json(info.value.bundle_path)
    assert (ev["step"], ev["phase"]) == (3, "backward")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["param"]) == (
        True, "invalid", "<loss>", "PowBackward0", "hidden.linear.weight"), rep
    assert o["source"] == line_of("return sum(torch.sum(torch.abs(p) ** 0.5)")
    assert "x ** 0.5 has an infinite derivative at x = 0" in rep["hint"], rep["hint"]
    assert "entries of a parameter" in rep["hint"], rep["hint"]
    assert "Leave the zeros out of the term" in rep["hint"], rep["hint"]
    assert "masks the value out" not in rep["hint"], rep["hint"]
