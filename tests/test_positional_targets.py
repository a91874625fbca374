"""Models that compute their own loss from targets passed to ``forward`` as plain PyTorch
code passes them (``positional_targets_models``): ``model(x, y)``, nanoGPT's
``model(idx, targets)``, ``model(batch)`` with an ``(x, y)`` pair or a ``"y_true"`` key,
torchvision's ``model(images, targets)``. A class vector given so, sorted by chance
(``[0, 0, 1, 1]``, all 0), read as a graph batch's assignment vector: the batch taken as 2
graphs (or 1) and the planted row named as another sample."""

from __future__ import annotations

import positional_targets_models as M
import pytest
import torch
from bundles import source_line

from recorder import FlightRecorder, NonFiniteError
from replay import replay

pytestmark = pytest.mark.usefixtures("in_tests_dir")

BAD_STEP = 2  # the planted batch is the third


def train(factory, batches, call, out_dir=None):
    """A loop over ``batches`` (``loss = call(model, batch)``), under the recorder when
    ``out_dir`` is given; the losses."""
    model = getattr(M, factory)()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with FlightRecorder(model, opt, out_dir=out_dir, factory=f"positional_targets_models:{factory}") \
            if out_dir else _nothing() as rec:
        for batch in batches:
            opt.zero_grad()
            loss = call(model, batch)
            loss.backward()
            opt.step()
            losses.append(loss.detach().clone())
    assert rec is None or rec.event is None
    return losses


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


SHAPES = {  # name: (factory, batch maker (seed, row) -> batch, call)
    "model(x, y)": ("make_pair", lambda s, r=None, y=None: M.rows(s, zero=r, labels=y),
                    lambda m, b: m(*b)),
    "model((x, y))": ("make_batch", lambda s, r=None, y=None: M.rows(s, zero=r, labels=y),
                      lambda m, b: m(b)),
    'model({"x", "y_true"})': ("make_batch", lambda s, r=None, y=None: M.rows(s, zero=r, labels=y),
                               lambda m, b: m(dict(zip(("x", "y_true"), b)))),
    "model(images, targets)": ("make_detector", lambda s, r=None, y=None: M.detections(s, r),
                               lambda m, b: sum(m(*b).values())),
}


@pytest.mark.parametrize("shape", ["model(x, y)", "model(images, targets)"])
def test_healthy_runs_are_bit_identical_and_quiet(tmp_path, shape):
    factory, make, call = SHAPES[shape]
    batches = [make(s) for s in range(3)]
    recorded = train(factory, batches, call, tmp_path)
    assert recorded == train(factory, batches, call)  # (tensors of one element: exact)
    assert list(tmp_path.glob("*.nan")) == []


@pytest.mark.parametrize("shape,labels,row", [
    ("model(x, y)", [0, 0, 1, 1], 3), ("model(x, y)", [0, 0, 0, 0], 2),
    ("model((x, y))", [0, 0, 1, 1], 3), ('model({"x", "y_true"})', [0, 1, 1, 2], 3),
    ("model(images, targets)", None, 2)])
def test_a_zero_record_is_named_at_its_row(tmp_path, shape, labels, row):
    """Step 2's record ``row`` all zeros, the class labels given to the model sorted."""
    factory, make, call = SHAPES[shape]
    batches = [make(0), make(1), make(2, row, labels), make(3)]
    with pytest.raises(NonFiniteError) as info:
        train(factory, batches, call, tmp_path)
    ev = info.value.event  # (its output a scalar loss: the recorder sees no rows of it)
    assert (ev["step"], ev["phase"], ev["module"]) == (BAD_STEP, "forward", "")
    rep = replay(info.value.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    assert (o["module"], o["op"], o["samples"], o["batch_size"]) == ("", "aten.div", [row], 4)
    assert "norm of the batch's own records" in rep["hint"]  # (not "a number given with")
    text = "img = img / img.norm()" if factory == "make_detector" else "x = x / x.norm("
    assert o["source"].endswith(source_line("positional_targets_models.py", text))


def test_nanogpt_targets_all_ignored(tmp_path):
    """``logits, loss = model(idx, targets)``: step 2's targets all -1 (ignore_index), a
    mean over no target, 0/0 in the loss inside the model."""
    batches = [M.tokens(0), M.tokens(1), M.tokens(2, ignored=True)]
    with pytest.raises(NonFiniteError) as info:
        train("make_gpt", batches, lambda m, b: m(*b)[1], tmp_path)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (BAD_STEP, "forward", "")
    rep = replay(info.value.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    assert (o["module"], o["op"], o["batch_size"]) == ("", "aten.nll_loss_forward", 4)
    assert "every target of the batch is ignore_index (-1)" in rep["hint"]


def test_positional_sorted_labels_leave_embedding_bags_named(tmp_path):
    """A NaN token weight of the last text, the labels sorted and passed positionally: they
    hid the bags' offsets (read as a graph batch's assignment vector), no sample named."""
    model = M.make_bags()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weights = torch.ones(12)
    weights[10] = float("nan")  # a token of the text from offsets[3] on
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, factory="positional_targets_models:make_bags"):
            model(torch.randint(0, 20, (12,)), torch.tensor([0, 3, 5, 9]), weights,
                  torch.tensor([0, 0, 1, 1])).backward()
            opt.step()
    ev = info.value.event
    assert (ev["phase"], ev["tensor"], ev["samples"]) == ("input", "args[2]", [3])
    assert replay(info.value.bundle_path)["origin"]["samples"] == [3]
