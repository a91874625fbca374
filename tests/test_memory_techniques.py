"""Memory- and weight-transforming training techniques under the recorder: activation
checkpointing (``torch.utils.checkpoint``, Hugging Face's ``gradient_checkpointing_enable()``),
pruning, parametrizations, weight averaging, LR schedulers. Each test trains a real loop as the
README says, plants a real bug, and checks the event and what ``nanreplay`` says about it."""

from __future__ import annotations

from pathlib import Path

import memory_models as M
import pytest
import torch
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay import replay

K = 3  # the step at which the planted bugs fire


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _train_encoder(out_dir: Path, reentrant: bool) -> NonFiniteError:
    model = M.make_checkpointed_encoder(reentrant)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="memory_models:make_checkpointed_encoder",
                            factory_kwargs={"reentrant": reentrant}):
            for step in range(6):
                tok, pad, y = M.documents(step, empty_at=K)
                opt.zero_grad()
                crit(model(tok, pad), y).backward()
                opt.step()
    return info.value


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_blocks_bisection_over_the_forwards_calls(tmp_path, reentrant):
    """The NaN is made by the forward's last call (the root's own mean over an empty document)
    while the blocks' recomputation in backward adds calls after it: the bisection searches the
    calls a forward-only probe makes, finds the root and agrees with the instrumented pass
    (it used to search past the forward's end, where no probe reaches, and disagree)."""
    err = _train_encoder(tmp_path, reentrant)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"], ev["call"]) == (K, "forward", "", 0)
    assert ev["samples"] == [3]
    rep = replay(err.bundle_path)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    o = rep["origin"]
    assert (o["phase"], o["module"], o["call"], o["op"]) == ("forward", "", 0, "aten.div")
    assert o["samples"] == [3]
    forward_calls = 1 + 1 + 3 * (1 + 2 + 2 + 1 + 4 + 1) + 1  # root, emb, 3 blocks, head
    b = rep["bisection"]
    assert b["agrees"] is True and b["calls"] == forward_calls
    assert b["probes"] <= b["limit"]


@pytest.mark.parametrize("reattach", [False, True])
def test_iterative_pruning_of_a_cosine_head(tmp_path, reattach):
    """Iterative magnitude pruning in the loop (``prune.ln_structured`` over the head's rows at
    step K, after the recorder attached, from a factory that builds the unpruned model): a
    whole class row is pruned and the cosine head divides its zero norm by itself. The
    pruning re-registers ``head.weight`` as ``head.weight_orig`` beside a ``head.weight_mask``
    buffer: the bundle holds them under those names (it held the unpruned values as
    ``head.weight`` and no mask, and the replay said NOT reproduced), and the replay prunes the
    factory's model with the bundle's mask and names the division."""
    import torch.nn.utils.prune as prune

    model = M.make_prunable_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="memory_models:make_prunable_net") as rec:
            for step in range(6):
                if step == K:
                    prune.ln_structured(model.head, "weight", amount=0.3, n=2, dim=0)
                    if reattach:  # as the guide says to do after changing the model
                        rec.detach()
                        rec.attach()
                x, y = M.features(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["call"]) == (K, "forward", "head", 0)
    rep = replay(info.value.bundle_path)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    o = rep["origin"]
    assert (o["phase"], o["module"], o["call"], o["op"]) == ("forward", "head", 0, "aten.div")
    assert o["samples"] == list(range(16))
    assert any("pruned 'head.weight'" in p for p in rep["problems"])


@pytest.mark.parametrize("reentrant", [False, True])
def test_whole_model_checkpointed_by_the_loop_backward_nan(tmp_path, reentrant):
    """The loop checkpoints the whole model (``checkpoint(model, x, c)``): its forward runs
    again inside backward, a second root forward of the step. That recomputation starts before
    the backward wrote any gradient, which is no ``zero_grad`` between micro-batches (the
    recorder marked it ``grads_dropped`` with ``use_reentrant=False``, the replay dropped the
    step's gradients and said NOT reproduced). A count of 0 makes sqrt's derivative +inf:
    the replay names ``SqrtBackward0`` in ``root`` on sample 4."""
    from torch.utils.checkpoint import checkpoint

    model, crit = M.make_counts_net(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="memory_models:make_counts_net"):
            for step in range(6):
                x, c, y = M.counts(step, zero_at=K)
                x.requires_grad_(reentrant)  # the reentrant variant needs an input that does
                opt.zero_grad()
                crit(checkpoint(model, x, c, use_reentrant=reentrant), y).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"]) == (K, "backward", ["rate.weight"])
    rep = replay(info.value.bundle_path)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"]) == ("backward", "root", "SqrtBackward0")
    assert o["samples"] == [4]


def test_class_weights_from_inverse_frequencies_with_an_absent_class(tmp_path):
    """The checkpointed encoder (a bystander) trained with ``CrossEntropyLoss(weight=...)``
    whose class weights are inverse frequencies counted on a sample where class 2 is absent
    (1/0 = inf). The first batch holding class 2 makes the loss NaN: a loss event on that
    sample, and the replay says the loss's ``weight`` held inf at index 2 when the step began
    (cause ``weights``), where it used to send the user looking for an op that made an
    infinity ("find the op that made the first infinity"), which no op did."""
    model = M.make_checkpointed_encoder()
    seen = torch.cat([M.documents(s)[2] for s in range(2)]).clamp_max(1)  # no class 2 yet
    counts = torch.bincount(seen, minlength=M.CLASSES).float()
    crit = nn.CrossEntropyLoss(weight=counts.sum() / counts)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="memory_models:make_checkpointed_encoder"):
            for step in range(6):
                tok, pad, y = M.documents(step)
                y = y.clamp_max(1)
                if step == K:
                    y[5] = 2  # the rare class
                opt.zero_grad()
                crit(model(tok, pad), y).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (K, "loss", "<loss>")
    rep = replay(info.value.bundle_path)
    assert rep["reproduced"] is True and rep["cause"] == "weights"
    o = rep["origin"]
    assert (o["phase"], o["op"], o["samples"]) == ("loss", "aten.nll_loss_forward", [5])
    assert "the loss's 'weight' holding inf at index 2" in rep["hint"]


def test_parametrization_registered_after_attach_is_named(tmp_path):
    """A parametrization registered by the loop after the recorder attached (sqrt of the
    trained squares of the last layer's weight), which an Adam update drives below 0 at step
    1: NaN in the layer. The bundle holds the weight under the name it has now
    (``2.parametrizations.weight.original``), so the replay of a factory without it says the
    run's model had a parametrization on ``2.weight`` to add in the factory (it held it as
    ``2.weight`` and the replay, running the plain layer, said NOT reproduced)."""
    import torch.nn.utils.parametrize as parametrize

    from replay.errors import ReplayError

    model, crit = M.make_small_mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="memory_models:make_small_mlp"):
            parametrize.register_parametrization(model[2], "weight", M.SqrtPositive())
            for step in range(6):
                x, y = M.tabular(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "forward", "2")
    with pytest.raises(ReplayError, match="the run's model had a parametrization on '2.weight'"):
        replay(info.value.bundle_path)


def test_selective_checkpointing_op_finder_recomputes_nothing(tmp_path):
    """Selective activation checkpointing (torchtitan's policy: save the matmuls, recompute
    the rest): dropout's product inside each block saved its mask, packed by the checkpoint.
    The op finder, asking whether a tensor an op took was positive by construction, read
    that mask: unpacking it re-ran the block inside the forward being watched (its modules'
    pre-hooks, without the post-hooks of the early-stopped recomputation), and the root's
    own 0/0 over an empty document was blamed on ``blocks.2.mlp`` as an ``underflow``. It
    reads no saved value whose read would recompute: the root's ``aten.div``, ``invalid``."""
    model = M.make_selective_encoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="memory_models:make_selective_encoder"):
            for step in range(6):
                tok, pad, y = M.documents(step, empty_at=K)
                opt.zero_grad()
                crit(model(tok, pad), y).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (K, "forward", "", [3])
    rep = replay(info.value.bundle_path)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["samples"]) == ("", 0, "aten.div", [3])
    assert rep["bisection"]["agrees"] is True


class _ShadowEMA:
    """A hand-written EMA of the weights (diffusers' ``EMAModel`` style: shadow copies;
    ``store`` / ``copy_to`` / ``restore`` around validation). The planted bug: its warmup
    decay ``1 - 1/n`` is taken with a tensor at n = 0: -inf, and the shadows are NaN."""

    def __init__(self, params):
        self.shadow = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self, params, n: int):
        decay = 1 - 1 / torch.tensor(float(n))
        for s, p in zip(self.shadow, params):
            s.mul_(decay).add_(p, alpha=float(1 - decay))

    @torch.no_grad()
    def swap_in(self, params):
        params = list(params)
        self.backup = [p.detach().clone() for p in params]
        for s, p in zip(self.shadow, params):
            p.copy_(s)

    @torch.no_grad()
    def restore(self, params):
        for b, p in zip(self.backup, params):
            p.copy_(b)


def test_ema_weights_swapped_in_for_validation_are_no_optimizer_event(tmp_path):
    """The loop validates with the EMA's (NaN) weights copied into the model, under
    ``torch.no_grad()``, after step 2's update. The evaluation forward's check now reads that
    update's evidence too: the update left the weights finite, so they were written outside
    ``optimizer.step()`` (a ``weights`` event naming step 2's update as the last that left them
    finite); it used to blame the optimizer ('optimizer.step() made 4 parameter(s)
    non-finite'), which the replay could not re-run."""
    model, crit = M.make_small_mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ema = _ShadowEMA(model.parameters())
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="memory_models:make_small_mlp"):
            for step in range(6):
                x, y = M.tabular(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
                ema.update(model.parameters(), step)
                if step == 2:
                    ema.swap_in(model.parameters())
                    model.eval()
                    with torch.no_grad():
                        crit(model(x), y)
                    model.train()
                    ema.restore(model.parameters())
    ev = info.value.event
    assert (ev["phase"], ev["evaluation"], ev["last_update_step"]) == ("weights", True, 2)
    assert ev["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    rep = replay(info.value.bundle_path)
    assert rep["reproduced"] is True and rep["cause"] == "weights"
    assert rep["origin"]["phase"] == "weights"
