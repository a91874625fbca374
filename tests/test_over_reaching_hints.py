"""End to end: hints that added a confident, false sentence to an otherwise right report.
A class label of 0 passed to ``nn.CrossEntropyLoss`` at the sample an RMSNorm without eps
divided 0 by 0 was read as a record's length of 0 ("Sample(s) 3 are empty records:
loss_args[1] (one count per sample: a length) is 0"): a count is now a length only where
it bounds the padding of other data of the batch. A multi-label BCE target with no class set
there was read as a mask with no valid position: data the forward never took now explains
its 0/0 only as a mask of positions (one run a row, or over a model input's positions). (A buffer's infinity made by a division
while the factory built the model, ALiBi's slope ``1 / 0``, read as a mask's:
``test_higher_order_ops``.)"""

from __future__ import annotations

import over_reaching_models as M
import pytest
import torch
from bundles import source_line

from recorder import FlightRecorder, NonFiniteError
from replay import replay

pytestmark = pytest.mark.usefixtures("in_tests_dir")
STEP, ROW, BATCH = 2, 3, 8


def fire(tmp_path, criterion, target):
    """SGD until step 2, whose record 3 reads one constant value: centred, its row is 0 and
    the RMSNorm's mean square 0 (eps 0). ``target(g, plant)``: the batch's targets, those
    of the planted batch with record 3's the class 0 or no class at all."""
    torch.manual_seed(0)
    model = M.CentredNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    rec = FlightRecorder(model, opt, loss_fn=criterion, out_dir=tmp_path)
    with pytest.raises(NonFiniteError) as info, rec:
        for step in range(STEP + 1):
            x = torch.randn(BATCH, M.FEATURES, generator=g)
            y = target(g, step == STEP)
            if step == STEP:
                x[ROW] = 5.0  # (the plant: a constant record)
            opt.zero_grad()
            rec.loss_fn(model(x), y).backward()
            opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        STEP, "forward", "norm", [ROW]), ev
    rep = replay(info.value.bundle_path, factory=M.CentredNet)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"], rep["cause"]) == (
        True, "norm", "aten.div", [ROW], "invalid"), o
    assert o["source"] == source_line("over_reaching_models.py", "x / torch.sqrt"), o
    assert "0 by 0" in rep["hint"] and "norm's attribute eps" in rep["hint"], rep["hint"]
    return rep["hint"]


def _labels(g, plant):
    y = torch.randint(1, M.CLASSES, (BATCH,), generator=g)  # (class 0 at the plant alone)
    return y.index_fill(0, torch.tensor([ROW]), 0) if plant else y


def _multi_labels(g, plant):
    y = (torch.rand(BATCH, M.CLASSES, generator=g) < 0.5).float().index_fill(1, torch.tensor(
        [0]), 1.0)  # (every record of some class, but the plant's: of none)
    return y.index_fill(0, torch.tensor([ROW]), 0.0) if plant else y


def test_a_class_label_of_0_at_the_normed_zero_row_is_no_record_length(tmp_path):
    """Record 3's label is class 0, every other sample's a class above 0: the label was read
    as a length of 0, no padded data of the batch bounding it."""
    hint = fire(tmp_path, torch.nn.CrossEntropyLoss(), _labels)
    assert "empty records" not in hint and "a length" not in hint, hint


def test_a_multi_label_target_of_no_class_at_the_normed_zero_row_is_no_empty_mask(tmp_path):
    """Record 3 is of no class (its BCE target row all 0), every other of some: the target,
    which the forward never took, was read as a mask with no valid position."""
    hint = fire(tmp_path, torch.nn.BCEWithLogitsLoss(), _multi_labels)
    assert "empty records" not in hint and "(0/1 data)" not in hint, hint
