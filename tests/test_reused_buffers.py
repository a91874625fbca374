"""Gradient accumulation through static buffers the loop reuses for every micro-batch
(``sx.copy_(x); sy.copy_(y)``, as loops prepared for CUDA graphs or pinned-memory prefetching
keep). The loss's targets, and integer inputs (token ids), were the same tensor in every
micro-batch, unwatched, so the bundle held the last micro-batch's for all of them: a NaN label
in an earlier micro-batch was gone and the replay said NOT reproduced; a padding-only row of
token ids was gone and the replay blamed the factory for building another model."""

from __future__ import annotations

import pytest
import torch
from bundles import replay_report
from torch import nn

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def make_regressor() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _train(out_dir, nan_at=None, recorder=True, steps=6):
    """Two micro-batches a step through one input and one target buffer; ``nan_at``: the
    (step, micro-batch) whose label 2 is missing (NaN)."""
    model = make_regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crit = nn.MSELoss()
    sx, sy = torch.zeros(4, 8), torch.zeros(4, 1)
    g = torch.Generator().manual_seed(1)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="test_reused_buffers:make_regressor")
    with rec if recorder else torch.enable_grad():
        for step in range(steps):
            opt.zero_grad()
            for mb in range(2):
                x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
                if (step, mb) == nan_at:
                    y[2] = float("nan")
                sx.copy_(x)
                sy.copy_(y)
                (crit(model(sx), sy) / 2).backward()
            opt.step()
    return model


def test_a_nan_label_in_a_reused_target_buffer_is_replayed_and_named(out_dir):
    """The first step shows the buffer written over (its version moved before the next
    micro-batch began); from then on the recorder keeps a copy of each micro-batch's targets,
    so the NaN label of step 3, micro-batch 0, row 2 is in the bundle and the replay names it."""
    with pytest.raises(NonFiniteError) as info:
        _train(out_dir, nan_at=(3, 0))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["tensor"], ev["samples"]) == \
        (3, "input", 0, "loss_args[1]", [2]), ev
    rep, code = replay_report(info.value.bundle_path)
    o = rep["origin"]
    assert code == 0 and rep["reproduced"] is True, rep
    assert (rep["cause"], o["tensor"], o["samples"]) == ("input", "loss_args[1]", [2]), rep


def test_targets_overwritten_before_the_recorder_saw_the_reuse_are_not_replayed(out_dir):
    """At the very first step the write comes after the loss took micro-batch 0's labels:
    the bundle holds micro-batch 1's. The event says so and the replay does not re-run the
    step from them (a re-run would compute another loss and call the event not reproduced)."""
    with pytest.raises(NonFiniteError) as info:
        _train(out_dir, nan_at=(0, 0))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (0, "loss", 0), ev
    assert "wrote into the loss's targets after the loss took them" in ev["detail"], ev
    rep, code = replay_report(info.value.bundle_path)
    assert code == 1 and rep["not_rerun"] == "loss targets written after the loss", rep
    assert "sy.copy_(y)" in rep["hint"] and rep["cause"] != "not_reproduced", rep


def test_copying_the_targets_leaves_training_unchanged(tmp_path):
    """The copies are the recorder's own: the weights after six steps are bit-identical with
    and without it."""
    with_rec = _train(tmp_path, recorder=True)
    without = _train(tmp_path, recorder=False)
    for (name, a), b in zip(with_rec.state_dict().items(), without.state_dict().values()):
        assert torch.equal(a, b), name


def _bank_loss(out, y, bank):
    """A regression loss plus a term against a memory bank of earlier outputs (as a
    contrastive loss takes its queue)."""
    return nn.functional.mse_loss(out, y) + 0.01 * (out @ bank.T).logsumexp(dim=1).mean()


def test_a_memory_bank_updated_before_step_is_kept_as_the_loss_took_it(out_dir):
    """One micro-batch a step; the loop writes the outputs into the bank the loss took after
    backward, before ``step()`` (a MoCo-style enqueue). The first step's close shows the write;
    from then on the bank is copied when the loss takes it, so the NaN label of step 4 is
    replayed from the bank that step's loss saw, and named."""
    model = make_regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    bank = torch.zeros(8, 1)
    g = torch.Generator().manual_seed(1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=_bank_loss, out_dir=out_dir,
                            factory="test_reused_buffers:make_regressor") as rec:
            for step in range(8):
                x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
                if step == 4:
                    y[1] = float("nan")
                opt.zero_grad()
                out = model(x)
                rec.loss_fn(out, y, bank).backward()
                bank.copy_(torch.cat([bank[4:], out.detach()]))  # enqueue, before step()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == \
        (4, "input", "loss_args[1]", [1]), ev
    rep, code = replay_report(info.value.bundle_path)
    assert code == 0 and rep["reproduced"] is True and rep["cause"] == "input", rep
    assert (rep["origin"]["tensor"], rep["origin"]["samples"]) == ("loss_args[1]", [1]), rep


class MaskedMeanPool(nn.Module):
    """Token embeddings averaged over the non-padding positions: a row of padding only is
    0/0."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, idx):
        mask = (idx != 0).unsqueeze(-1).float()
        return self.head((self.emb(idx) * mask).sum(1) / mask.sum(1))


def test_token_ids_copied_into_one_reused_buffer_are_replayed_as_they_ran(out_dir):
    """Token ids go through one static ``long`` buffer; step 3's first micro-batch has a row of
    padding only (row 2). Integer inputs are now watched for writes like floating ones and
    copied once the reuse shows, so the replay re-runs that micro-batch's own tokens."""
    model = MaskedMeanPool()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    sx = torch.zeros(4, 6, dtype=torch.long)
    g = torch.Generator().manual_seed(1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="test_reused_buffers:MaskedMeanPool"):
            for step in range(6):
                opt.zero_grad()
                for mb in range(2):
                    x = torch.randint(1, 50, (4, 6), generator=g)
                    y = torch.randint(0, 2, (4,), generator=g)
                    if (step, mb) == (3, 0):
                        x[2] = 0
                    sx.copy_(x)
                    (crit(model(sx), y) / 2).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["samples"]) == \
        (3, "forward", 0, [2]), ev
    rep, code = replay_report(info.value.bundle_path)
    o = rep["origin"]
    assert code == 0 and rep["reproduced"] is True, rep
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("", "aten.div", [2], "invalid"), rep
