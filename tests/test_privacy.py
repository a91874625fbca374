"""Differential privacy as it is written by hand, the Opacus way: Poisson-sampled batches,
per-sample gradients (module hooks keeping ``grad_sample``), per-sample clipping and Gaussian
noise from a ``torch.Generator``; trained under the recorder until it raises, then replayed."""

from __future__ import annotations

import privacy_models as PM
import pytest
import torch
from bundles import invoke_cli, nanreplay_json, one_error_line
from torch import nn

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _data(n: int = 256, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 10, generator=g), torch.randint(0, 2, (n,), generator=g)


def _padded_batch(X, Y, step: int, size: int = 32):
    """Batch ``step`` of an epoch over (X, Y), the last one padded to ``size`` with zero
    records, and the loss weights that leave the padding out (1 for a record, 0 for padding)."""
    x, y = X[step % 4 * size:][:size], Y[step % 4 * size:][:size]
    keep = (torch.arange(size) < len(x)).float()
    return (torch.cat([x, x.new_zeros(size - len(x), x.shape[1])]),
            torch.cat([y, y.new_zeros(size - len(y))]), keep)


def test_an_empty_poisson_batch_is_recorded_and_its_empty_mean_named(out_dir, caplog):
    """Poisson sampling (each record joins the batch with probability q, as Opacus's
    UniformWithReplacementSampler draws) gives a batch of 0 records; CrossEntropyLoss's mean
    over it is 0/0. The recorder's min/max of the empty activations raised ('aminmax(): cannot
    compute aminmax over an empty dimension'), disabled it, and the NaN loss trained on
    unchecked; then the replay's instrumented pass left the empty outputs out and said the
    factory built another model ('did not run in the re-run')."""
    model = PM.make_classifier()
    opt, crit = torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss()
    X, Y = _data()
    g = torch.Generator().manual_seed(2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="privacy_models:make_classifier") as rec:
            for step in range(8):
                keep = torch.rand(len(X), generator=g) < 0.02
                if step == 5:
                    keep[:] = False  # the draw that selects no record (q = 0.02, 256 records)
                opt.zero_grad()
                crit(model(X[keep]), Y[keep]).backward()
                opt.step()
    assert "internal error" not in caplog.text and rec.health.internal_errors == 0
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"], ev["samples"]) == (5, "loss", "nan", [])
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["reproduced"] and rep["cause"] == "invalid", rep
    assert (rep["origin"]["module"], rep["origin"]["op"]) == ("<loss>", "aten.nll_loss_forward")
    assert rep.get("fidelity", {}).get("matches", True), rep["fidelity"]
    assert "a mean over no element is 0/0" in rep["hint"] and "skip such batches" in rep["hint"]


def test_dropping_a_sample_of_an_empty_batch_is_refused(out_dir):
    """A logical batch split into physical micro-batches of at most 16 records, as Opacus's
    BatchMemoryManager does, where Poisson sampling drew too few records for the last one: its
    mean loss is 0/0. '--try drop=0' re-ran and reported 'nan at step 0' as if sample 0 had
    been dropped (a batch size of 0 read as unknown); it is now refused in one line."""
    model = PM.make_classifier()
    opt, crit = torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss()
    X, Y = _data()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="privacy_models:make_classifier"):
            for x, y in zip(X[:20].split(10), Y[:20].split(10)):  # 10 records drawn each step
                for xm, ym in zip(x.tensor_split([8, 16]), y.tensor_split([8, 16])):
                    crit(model(xm), ym).backward()
                opt.step()
                opt.zero_grad()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (0, "loss", 2)
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["cause"], rep["origin"]["micro_batch"]) == ("invalid", 2)
    line = one_error_line(invoke_cli(info.value.bundle_path, "--try", "drop=0"))
    assert line == "nanreplay: --try drop=0: the batch of micro-batch 2 has no sample, so " \
        "there is none to drop"


def _grad_sample_hooks(model: nn.Module) -> None:
    """Opacus's GradSampleModule by hand for Linear layers: the forward hook keeps each
    layer's input, the full backward hook makes each sample's weight and bias gradient from it
    and appends them to ``p.grad_sample`` (virtual batches accumulate over micro-batches)."""
    acts: dict[nn.Module, torch.Tensor] = {}

    def keep(mod, inp, out):
        acts[mod] = inp[0].detach()

    def per_sample(mod, grad_in, grad_out):
        b = grad_out[0].detach()
        for p, gs in ((mod.weight, torch.einsum("ni,nj->nij", b, acts[mod])), (mod.bias, b)):
            old = getattr(p, "grad_sample", None)
            p.grad_sample = gs if old is None else torch.cat([old, gs])

    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(keep)
            m.register_full_backward_hook(per_sample)


# (the first layer's input needs no gradient: torch warns, as it does under Opacus)
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_automatic_clipping_of_a_padded_record_names_its_zero_gradient_samples(out_dir):
    """DP-SGD with grad_sample hooks, a logical batch of 32 run as two virtual micro-batches of
    16, and automatic clipping (each per-sample gradient normalised, g / (‖g‖ + gamma)) written
    with gamma = 0. The epoch's last batch is padded to the fixed shape with records whose
    loss weight is 0: their per-sample gradients are exactly 0 and 0/0 is NaN. The replay said
    only that the loop wrote the NaN gradients, naming no sample; it now names the samples
    whose gradient into the model's output was exactly 0, and their micro-batch."""
    model = PM.make_classifier()
    _grad_sample_hooks(model)
    opt, crit = torch.optim.SGD(model.parameters(), lr=0.1), PM.MaskedCrossEntropy()
    X, Y = _data(124)  # 3 full batches of 32, then 28 records and 4 rows of padding
    noise = torch.Generator().manual_seed(3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="privacy_models:make_classifier"):
            for step in range(8):
                x, y, keep = _padded_batch(X, Y, step)
                for xm, ym, km in zip(x.split(16), y.split(16), keep.split(16)):
                    crit(model(xm), ym, km).backward()
                gs = [p.grad_sample for p in model.parameters()]
                norms = torch.stack([g.flatten(1).norm(dim=1) for g in gs]).norm(dim=0)
                for p, g in zip(model.parameters(), gs):
                    clipped = g / norms.view(-1, *[1] * (g.dim() - 1))  # gamma = 0
                    p.grad = (clipped.sum(0) + 0.5 * torch.randn(p.shape, generator=noise)) / 32
                    p.grad_sample = None
                opt.step()
                opt.zero_grad()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "backward", "nan")
    padded = (keep == 0).nonzero().flatten()  # rows 28-31 of the batch: 12-15 of the second
    mb, rows = divmod(int(padded[0]), 16)
    rep = nanreplay_json(info.value.bundle_path, code=1)
    assert (rep["cause"], rep["origin"]["phase"]) == ("not_reproduced", "backward")
    assert (rep["origin"]["micro_batch"], rep["origin"]["samples"]) == \
        (mb, list(range(rows, 16))), rep["origin"]
    assert "loop's own code" in rep["hint"]
    assert f"sample(s) [{rows}-15] of micro-batch {mb} sent back a gradient of exactly 0" \
        in rep["hint"] and "add an eps to the norm" in rep["hint"], rep["hint"]


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_an_empty_poisson_batch_divided_by_its_size_is_said(out_dir):
    """Poisson sampling with grad_sample hooks, Opacus's clip (C / (‖g‖ + 1e-6), at most 1) and
    Gaussian noise, the noised sum divided by the batch's actual size instead of the expected
    q * N: the draw of no record makes noise / 0 = ±inf. The hint named only 'a division by a
    norm that is 0'; it now says the step's batch held no sample and what to divide by."""
    model = PM.make_classifier()
    _grad_sample_hooks(model)
    opt, crit = torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(reduction="sum")
    X, Y = _data()
    g, noise = torch.Generator().manual_seed(2), torch.Generator().manual_seed(3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="privacy_models:make_classifier"):
            for step in range(8):
                keep = torch.rand(len(X), generator=g) < 0.05
                if step == 4:
                    keep[:] = False  # the draw that selects no record
                x, y = X[keep], Y[keep]
                crit(model(x), y).backward()
                gs = [p.grad_sample for p in model.parameters()]
                norms = torch.stack([s.flatten(1).norm(dim=1) for s in gs]).norm(dim=0)
                factor = (1.0 / (norms + 1e-6)).clamp(max=1.0)
                for p, s in zip(model.parameters(), gs):
                    clipped = (s * factor.view(-1, *[1] * (s.dim() - 1))).sum(0)
                    p.grad = (clipped + 0.5 * torch.randn(p.shape, generator=noise)) / len(x)
                    p.grad_sample = None
                opt.step()
                opt.zero_grad()
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (4, "backward") and ev["kind"] in ("+inf", "-inf")
    rep = nanreplay_json(info.value.bundle_path, code=1)
    assert (rep["cause"], rep["origin"]["phase"], rep["origin"]["samples"]) == \
        ("not_reproduced", "backward", [])
    assert "the step's batch held no sample" in rep["hint"]
    assert "divide the summed, noised gradients by the expected batch size" in rep["hint"]


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_ghost_clipping_s_second_backward_names_the_padded_samples(out_dir):
    """Ghost clipping (book-keeping): a first backward of the per-sample losses, whose hooks
    make each sample's gradient norm from ‖a‖²·‖b‖² without per-sample gradients, then a
    second backward of the losses reweighted by 1 / norm (automatic clipping, gamma = 0). A
    padding row's loss is 0 and its norm 0: 0 * inf = NaN enters the model's output, from a
    loss the loop computed outside loss_fn. Pinned: the replay feeds the recorded gradient of
    that second backward, names the padded samples and says the loss lies outside loss_fn."""
    model = PM.make_classifier()
    acts: dict[nn.Module, torch.Tensor] = {}
    sq: dict[nn.Module, torch.Tensor] = {}

    def keep_input(mod, inp, out):
        acts[mod] = inp[0].detach()

    def norm_sq(mod, grad_in, grad_out):  # (a Linear's weight and bias, one sample per row)
        b2 = grad_out[0].detach().pow(2).sum(1)
        sq[mod] = acts[mod].pow(2).sum(1) * b2 + b2

    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(keep_input)
            m.register_full_backward_hook(norm_sq)
    opt, crit = torch.optim.SGD(model.parameters(), lr=0.1), PM.PerSampleMaskedCrossEntropy()
    X, Y = _data(124)
    noise = torch.Generator().manual_seed(3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="privacy_models:make_classifier"):
            for step in range(8):
                x, y, keep = _padded_batch(X, Y, step)
                losses = crit(model(x), y, keep)
                losses.sum().backward(retain_graph=True)
                norms = sum(sq.values()).sqrt()
                opt.zero_grad()
                (losses / norms).sum().backward()
                for p in model.parameters():
                    p.grad = (p.grad + 0.5 * torch.randn(p.shape, generator=noise)) / 32
                opt.step()
                opt.zero_grad()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "backward", "nan")
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["reproduced"] and rep["origin"]["phase"] == "loss", rep["origin"]
    assert rep["origin"]["samples"] == (keep == 0).nonzero().flatten().tolist()
    assert rep["cause"] is None and "computed outside it" in rep["hint"], rep["hint"]


def test_a_wrapper_recorded_around_the_factory_s_model_is_named(out_dir):
    """The model handed to the recorder is the one make_private returned, Opacus's
    GradSampleModule holding the factory's model as ``_module``; a record with an inf feature
    raises an input event. The replay refused with 'the factory builds a different model: it
    cannot see the run's configuration (command-line flags, ...)', which sent the user after
    factory_kwargs; it now says the bundle's parameters are the factory's under '_module' and
    to record the inner model, and doing so replays the event."""
    X, Y = _data()
    X[70, 3] = float("inf")  # record 70: sample 6 of the batch of step 2

    def train(wrap: bool) -> NonFiniteError:
        inner = PM.make_classifier()
        model = PM.GradSampleModule(inner) if wrap else inner
        opt, crit = torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss()
        with pytest.raises(NonFiniteError) as info:
            with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir / str(wrap),
                                factory="privacy_models:make_classifier"):
                for x, y in zip(X.split(32), Y.split(32)):
                    crit((PM.GradSampleModule(inner) if not wrap else model)(x), y).backward()
                    opt.step()
                    opt.zero_grad()
        return info.value

    err = train(wrap=True)
    assert (err.event["step"], err.event["phase"], err.event["samples"]) == (2, "input", [6])
    line = one_error_line(invoke_cli(err.bundle_path, "--json"))
    assert "every parameter the bundle holds is one of the factory's under '_module'" in line
    assert "FlightRecorder(model._module, ...)" in line and "command-line" not in line, line
    rep = nanreplay_json(train(wrap=False).bundle_path)  # the inner model recorded
    assert (rep["cause"], rep["origin"]["phase"], rep["origin"]["samples"]) == \
        ("input", "input", [70 - 2 * 32])
