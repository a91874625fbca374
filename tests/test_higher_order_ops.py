"""End to end: higher-order ops and tensor subclasses in a training forward
(``higher_order_models``), recorded in a real loop, then replayed. The replay's watching
modes met ``flex_attention`` and ``torch.cond`` as one higher-order op each: 'no rule
registered for HigherOrderOperator', or, once such a call had failed under a mode, dynamo
refusing every later eager flex_attention (a raw ``Unsupported`` traceback). A pass-through
``__torch_function__`` subclass's handler was named as the op's source line."""

from __future__ import annotations

import higher_order_models as M
import pytest
import torch
from bundles import source_line

from recorder import FlightRecorder, NonFiniteError
from replay import replay

pytestmark = pytest.mark.usefixtures("in_tests_dir")
ROW = 2


def train(out_dir, factory: str, plant=None, steps: int = 3, record: bool = True):
    """Losses of ``steps`` SGD steps, and the NonFiniteError (None when clean); ``plant(x)``
    writes the bad record into step 1's batch."""
    torch.manual_seed(0)
    model = getattr(M, factory)()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    g = torch.Generator().manual_seed(1)
    flex = factory.startswith("make_flex")
    losses, loss_fn = [], torch.nn.functional.mse_loss
    rec = FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                         factory=f"higher_order_models:{factory}") if record else None
    try:
        with rec or torch.enable_grad():
            for step in range(steps):
                x = torch.randn(M.B, M.SEQ, 4, generator=g) if flex else torch.randn(
                    6, 4, generator=g)
                y = torch.randn(x.shape[:-1], generator=g)
                if plant is not None and step == 1:
                    plant(x)
                opt.zero_grad()
                loss = (rec.loss_fn if rec else loss_fn)(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
    except NonFiniteError as e:
        return losses, e
    return losses, None


def replayed(err, factory, step, module):
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (
        step, "forward", module), err.event
    rep = replay(err.bundle_path, factory=getattr(M, factory))
    assert rep["reproduced"] is True, rep
    return rep, rep["origin"]


def test_flex_attention_alibi_slope_table_holding_inf_names_the_score_mod_product(tmp_path):
    _, err = train(tmp_path, "make_flex_alibi_inf_slope")
    rep, o = replayed(err, "make_flex_alibi_inf_slope", 0, "attn")
    # (the diagonal's kv_idx - q_idx is 0: inf * 0 in every sample)
    assert (o["module"], o["op"], rep["cause"]) == ("attn", "aten.mul", "invalid"), rep
    assert o["samples"] == list(range(M.B)), rep
    assert o["source"] == source_line("higher_order_models.py", "slopes[h] * (kv_idx"), rep
    # (the slope's inf is 1 / 0 of the factory's table, no mask put in on purpose)
    hint = rep["hint"]
    assert "on purpose (a mask" not in hint and "finfo(dtype).min" not in hint, hint
    built = source_line("higher_order_models.py", "1.0 / torch.arange(HEADS")
    assert f"Buffer attn.slopes holds an infinity a division of finite values made when the " \
        f"factory built the model at {built}" in hint, hint


def test_flex_attention_out_of_scale_record_names_the_scores_overflow_and_its_sample(
        tmp_path):
    _, err = train(tmp_path, "make_flex_alibi", lambda x: x[ROW].mul_(1e20))
    rep, o = replayed(err, "make_flex_alibi", 1, "attn")
    assert (o["op"], rep["cause"]) == ("aten.matmul", "overflow"), rep
    assert o["samples"] == [ROW] == err.event["samples"], rep
    assert f"sample(s) {ROW} of batch" in rep["hint"], rep["hint"]


def _zero_record(x):
    x[ROW].zero_()  # a blank record: its activations 0, their std 0


@pytest.mark.parametrize("factory, line", [("make_cond_norm", "no eps: branch"),
                                           ("make_subclass_norm", "no eps: subclass")])
def test_standardisation_in_cond_branch_or_on_subclass_names_the_division(tmp_path, factory,
                                                                           line):
    _, err = train(tmp_path, factory, _zero_record)
    rep, o = replayed(err, factory, 1, "norm")
    assert (o["op"], o["samples"], rep["cause"]) == ("aten.div", [ROW], "invalid"), rep
    # (the subclass's handler passes the op on: the source is the line that wrote it)
    assert o["source"] == source_line("higher_order_models.py", line), rep


@pytest.mark.parametrize("factory", ["make_flex_softcap", "make_cond_norm",
                                     "make_subclass_norm", "make_wrapped_norm"])
def test_healthy_runs_are_bit_identical_and_silent(tmp_path, factory):
    recorded, err = train(tmp_path, factory)
    assert err is None and not list(tmp_path.iterdir())
    assert recorded == train(tmp_path, factory, record=False)[0]
