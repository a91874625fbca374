"""End to end on hypernetworks and the regularizers written with ``torch.func``
(``hypernetworks_models``: siren's set-encoder hypernetwork, a hand-written spectral norm, a
per-sample hypernetwork run by ``vmap(functional_call)`` on a main network built on the meta
device, FiLM, a contractive penalty by ``vmap(jacrev(...))`` in the forward), trained under the
recorder until a planted bug fires, then replayed with the CLI."""

from __future__ import annotations

import json

import hypernetworks_models as M
import pytest
import torch
import torch.nn.functional as F
from bundles import invoke_cli, nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("hypernetworks_models.py", text)


def fit(out_dir, factory: str, loss_fn, batches, opt=torch.optim.Adam, rewind=None, **kw):
    """Train ``factory``'s model on ``batches`` ((args, loss targets) per step) under the
    recorder (``rewind``: its window); the NonFiniteError, or None when the run ended without
    one."""
    model = getattr(M, factory)(**kw)
    optimizer = opt(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    try:
        with FlightRecorder(model, optimizer, loss_fn=loss_fn, out_dir=out_dir,
                            lr_scheduler=sched, factory=f"hypernetworks_models:{factory}",
                            factory_kwargs=kw, rewind=rewind) as rec:
            for args, targets in batches:
                loss = rec.loss_fn(model(*args), *targets)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                sched.step()
    except NonFiniteError as e:
        return e
    return None


def siren_batches(empty_at: int | None, steps: int = 5):
    g = torch.Generator().manual_seed(0)
    for s in range(steps):
        cx, cy, mask, qx, qy = M.siren_batch(g, empty=(2, 4) if s == empty_at else ())
        yield (cx, cy, mask, qx), (qy,)


def critic_batches(steps: int = 3):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        yield (torch.randn(8, 8, generator=g),), (torch.tensor([1.0, -1.0] * 4),)


def cond_batches(big_at: int | None, steps: int = 4):
    g = torch.Generator().manual_seed(0)
    for s in range(steps):
        x, c = torch.randn(8, 4, generator=g), torch.rand(8, 2, generator=g)
        y = x.sum(1) * c[:, 0]
        if s == big_at:
            c[6] *= 1e3  # a condition given in other units (mK for K)
        yield (x, c), (y,)


def task_batches(big_at: int | None, steps: int = 4):
    """One task descriptor per batch, shared by its samples (no batch dimension)."""
    g = torch.Generator().manual_seed(0)
    for s in range(steps):
        x, c = torch.randn(8, 4, generator=g), torch.rand(2, generator=g)
        y = x.sum(1) * c[0]
        if s == big_at:
            c *= 1e4  # this task's descriptor not normalised as the others'
        yield (x, c), (y,)


def film_batches(empty_at: int | None, steps: int = 4, batch: int = 6):
    """A DataLoader over (image, instruction, answer); the instruction of sample 4 of batch
    ``empty_at`` is empty (all padding)."""
    g = torch.Generator().manual_seed(0)
    n = steps * batch
    images, answers = torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)
    tokens = torch.randint(1, 20, (n, 5), generator=g)
    tokens[:, 3:] = 0  # padding
    if empty_at is not None:
        tokens[empty_at * batch + 4] = 0
    loader = DataLoader(TensorDataset(images, tokens, answers), batch_size=batch)
    for image, instruction, answer in loader:
        yield (image, instruction), (answer,)


def cae_batches(blank_at: int | None, steps: int = 4):
    g = torch.Generator().manual_seed(0)
    for s in range(steps):
        x = torch.randn(8, 10, generator=g)
        keep = (torch.rand(8, 10, generator=g) < 0.8).float()
        if s == blank_at:
            keep[5] = 0  # a record with every feature missing
        yield (x, keep), (x,)


def test_siren_hypernetwork_names_the_context_sets_without_a_point(tmp_path):
    """siren's SetEncoder pools the context points by ``mean * (n / mask.sum())``: a context
    set with every point masked out divides by 0 (+inf), times its 0 embedding (NaN), and the
    hypernetwork makes that sample's whole SIREN from it."""
    err = fit(tmp_path, "make_siren_hyper", M.siren_loss, siren_batches(empty_at=3))
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (3, "forward",
                                                                            "encoder")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "encoder", "aten.reciprocal", "+inf", [2, 4]), rep
    assert o["source"] == line_of("torch.sum(ctxt_mask, dim=-2))")
    assert "add an eps to the denominator" in rep["hint"], rep["hint"]


def test_hand_written_spectral_norm_names_its_written_parameters_not_the_factory(tmp_path):
    """christiancosgrove's SpectralNorm keeps u and v as parameters without gradient and sets
    ``u.data``/``v.data`` in every forward; around a zero-initialised last layer, sigma is 0
    and ``w / sigma`` 0/0 at step 0. The bundle holds u and v as that forward left them, so the
    re-run differs from training at the first layer: the fidelity line names them and says to
    keep them in buffers (was: the factory builds a different model, pass
    --factory-kwargs)."""
    err = fit(tmp_path, "make_sn_critic", M.hinge_loss, critic_batches(),
              opt=lambda p, lr: torch.optim.Adam(p, lr=2e-4, betas=(0.0, 0.9)))
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (0, "forward", "head")
    rep = nanreplay_json(err.bundle_path, code=1)
    fid = rep["fidelity"]
    assert (fid["matches"], fid["module"], fid["micro_batch"]) == (False, "body.0", 0), fid
    assert {"body.0.module.weight_u", "body.0.module.weight_v"} <= set(fid["frozen_written"])
    assert all(n.endswith(("_u", "_v")) for n in fid["frozen_written"]), fid
    assert (rep["reproduced"], rep["cause"], rep["origin"]["module"]) == (False, None, "head")
    text = json.dumps(rep)
    assert "forward writes parameters the bundle holds as that forward left them" in \
        rep["hint"], rep["hint"]
    assert "factory builds a different model" not in text and "factory-kwargs" not in text
    fidelity_line = next(ln for ln in invoke_cli(err.bundle_path).stdout.splitlines()
                         if ln.startswith("  fidelity"))
    assert "body.0.module.weight_u" in fidelity_line, fidelity_line
    assert "keep such state in buffers (self.register_buffer(" in fidelity_line, fidelity_line

    # recorded again with u and v in buffers, as the fidelity line says: the step re-runs, and
    # the 0/0 is w / sigma in the critic's head
    err = fit(tmp_path / "buffers", "make_sn_critic", M.hinge_loss, critic_batches(),
              opt=lambda p, lr: torch.optim.Adam(p, lr=2e-4, betas=(0.0, 0.9)), buffers=True)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"]) == (
        True, "invalid", "head", "aten.div", "nan"), rep
    assert o["source"] == line_of("w / sigma.expand_as(w)")
    assert rep["fidelity"]["matches"] is True, rep["fidelity"]
    # (a weight 0 everywhere, zero-initialised: the init or an eps on the divisor, which
    # keeps the layer at 0; replay.zero_param_rows)
    assert "it was initialised or re-initialised to zeros" in rep["hint"], rep["hint"]
    assert "or clamp the divisor (w.norm(dim, keepdim=True).clamp_min(eps)" in rep["hint"]


def test_power_iteration_started_at_zeros_names_its_vector_not_an_eps(tmp_path):
    """The same critic with u and v in buffers, but the second layer's u started at zeros (not
    a random unit vector): every power iteration keeps it 0 (l2normalize's eps or not), sigma
    is 0 and ``w / sigma`` infinite. An eps on sigma would scale the layer by 1e12: the hint
    names the buffer to start nonzero (was: 'add an eps to the denominator')."""
    err = fit(tmp_path, "make_sn_critic", M.hinge_loss, critic_batches(),
              opt=lambda p, lr: torch.optim.Adam(p, lr=2e-4, betas=(0.0, 0.9)),
              zero_last=False, buffers=True, u_zero=True)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (0, "forward",
                                                                            "body.2")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"]) == (
        True, "invalid", "body.2", "aten.div", "+inf"), rep
    assert o["source"] == line_of("w / sigma.expand_as(w)")
    assert "divisor comes from buffer body.2.module.weight_u, all 0" in rep["hint"], rep["hint"]
    assert "start it nonzero" in rep["hint"] and "add an eps" not in rep["hint"], rep["hint"]


def test_per_sample_hypernetwork_by_vmap_functional_call_is_recorded_and_replayed(tmp_path):
    """hypnettorch's HMLP makes every weight of the main network per sample, which runs by
    ``vmap(functional_call(self.target, ...))`` on a main network built on the meta device (it
    holds no weights). Recording must not run on that placeholder (training crashed: the
    step's statistics were on meta), nor the replay read the vmapped calls' wrapped tensors
    (it crashed), nor its rewind window and what-ifs the placeholder's values (they
    crashed): one condition 1000x out of scale overflows that sample's variance."""
    err = fit(tmp_path, "make_cond_hyper", M.gaussian_nll, cond_batches(big_at=2), rewind=2)
    assert err is not None
    assert (err.event["step"], err.event["phase"], err.event["samples"]) == (2, "forward", [6])
    assert not any(n.startswith("target.") for n in err.event.get("params") or [])
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "overflow", "", "aten.exp", "+inf", [6]), rep
    assert rep["window"]["reproduced"] is True, rep["window"]
    tried = {w["try"]: w for w in rep["what_if"]}
    assert tried["drop=6"]["finite"] is True and not tried["drop=6"]["inconclusive"], tried
    assert tried["lr=0.1x"]["finite"] is False, tried  # (the data, not the rate)
    assert o["source"] == line_of("torch.exp(log_var)")
    assert "out of scale" in rep["hint"] and "drop=6" in rep["hint"], rep["hint"]
    assert rep["fidelity"]["matches"] is True, rep["fidelity"]


def test_a_task_descriptor_out_of_scale_is_said_to_be_the_data_not_the_learning_rate(tmp_path):
    """The same hypernetwork conditioned on one task descriptor per batch (no batch
    dimension), run by a plain functional_call: a descriptor 1e4x out of scale overflows the
    main network's exp. No row of the batch stands out, but every layer's absmax jumped at
    this very step from the first layer on: the hint says the data is at fault (was: 'clamp
    the exponent ... or lower the learning rate' only)."""
    err = fit(tmp_path, "make_cond_hyper", M.gaussian_nll, task_batches(big_at=2))
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (2, "forward",
                                                                            "target")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"]) == (
        True, "overflow", "target", "aten.exp", "+inf"), rep
    assert o["source"] == line_of("torch.exp(log_var)")
    assert "But the data fed to this step is out of scale" in rep["hint"], rep["hint"]
    assert "at this very step" in rep["hint"], rep["hint"]


def test_contractive_penalty_by_vmap_jacrev_names_the_sqrt_of_a_zero_jacobian(tmp_path):
    """The encoder's Jacobian per record by ``vmap(jacrev(...))`` in the forward, its Frobenius
    norm as ``sqrt(sum(J**2))`` without an eps: a record with every feature missing has J = 0
    and sqrt's derivative there is infinite (NaN in the gradients). The replay names
    SqrtBackward0 on its line and the record (was: a crash reading the transform's wrapped
    tensors; then 'a value no check names', no line)."""
    err = fit(tmp_path, "make_cae", M.cae_loss, cae_batches(blank_at=2))
    assert (err.event["step"], err.event["phase"]) == (2, "backward"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["phase"], o["op"], o["module"], o["samples"]) == (
        True, "invalid", "backward", "SqrtBackward0", "", [5]), rep
    assert o["source"] == line_of("penalty = torch.sqrt(")  # (the forward's, first)
    assert "sqrt(x + eps)" in rep["hint"], rep["hint"]


def test_a_jacobian_nan_made_inside_jacrev_names_the_derivative_of_the_forward_op(tmp_path):
    """The encoder takes the record's norm as a feature (``sqrt(sum(x**2))``, no eps): its
    value at a record of zeros is 0, its derivative 0/0, so the Jacobian that
    ``vmap(jacrev(...))`` takes in the forward is NaN there (a forward event). The replay finds
    the op in SqrtBackward0, run by jacrev inside the forward, and names the sqrt's line as
    the pole (was: a crash on the transform's wrapped tensors)."""
    err = fit(tmp_path, "make_cae", M.cae_loss, cae_batches(blank_at=2), radial=True)
    assert (err.event["step"], err.event["phase"], err.event["samples"]) == (2, "forward", [5])
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["node"], o["samples"]) == (
        True, "invalid", "aten.div", "SqrtBackward0", [5]), rep
    assert o["source"] == line_of("jac = vmap(jacrev(")
    assert o["node_source"] == line_of("torch.sqrt((x ** 2).sum(-1, keepdim=True))")
    assert "torch.func's jacrev" in rep["hint"], rep["hint"]
    assert "not at the division the backward does" in rep["hint"], rep["hint"]


def test_contractive_penalty_taken_in_the_loss_given_the_model_names_it_in_the_loss(tmp_path):
    """The same penalty taken by the loss, given the model (``loss_fn(recon, x, keep,
    model)``): the replay passes its own model, whose encoder the loss runs under
    ``vmap(jacrev(...))``; it names SqrtBackward0 in the loss, on its line (was: the same
    crash on the transform's wrapped tensors)."""
    model = M.make_cae(in_forward=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.cae_model_loss, out_dir=tmp_path,
                            factory="hypernetworks_models:make_cae",
                            factory_kwargs={"in_forward": False}) as rec:
            for (x, keep), _ in cae_batches(blank_at=2):
                loss = rec.loss_fn(model(x, keep), x, keep, model)
                opt.zero_grad()
                loss.backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (2, "backward"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["module"], o["samples"]) == (
        True, "invalid", "SqrtBackward0", "<loss>", [5]), rep
    assert o["source"] == line_of("penalty = torch.sqrt(jac.pow(2).sum((1, 2)))  # (as in")


def test_film_on_an_empty_instruction_names_that_sample_not_the_batch(tmp_path):
    """FiLM's generator embeds the instruction by a masked mean over its tokens: an empty one
    is 0/0. BatchNorm in the FiLMed block spreads it to every sample (the recorder sees all
    rows), the replay names the one sample and the line."""
    err = fit(tmp_path, "make_film", F.cross_entropy, film_batches(empty_at=2))
    assert (err.event["step"], err.event["module"]) == (2, "film_gen"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "film_gen", "aten.div", [4]), rep
    assert o["source"] == line_of("/ mask.sum(1)")
    assert "0/0" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("factory, loss_fn, batches, kw", [
    ("make_siren_hyper", M.siren_loss, lambda: siren_batches(None), {}),
    ("make_sn_critic", M.hinge_loss, critic_batches, {"zero_last": False}),
    ("make_sn_critic", M.hinge_loss, critic_batches, {"zero_last": False, "buffers": True}),
    ("make_cond_hyper", M.gaussian_nll, lambda: cond_batches(None), {}),
    ("make_cond_hyper", M.gaussian_nll, lambda: task_batches(None), {}),
    ("make_film", F.cross_entropy, lambda: film_batches(None), {}),
    ("make_cae", M.cae_loss, lambda: cae_batches(None), {}),
    ("make_cae", M.cae_loss, lambda: cae_batches(None), {"radial": True}),
])
def test_healthy_hypernetworks_are_not_stopped(tmp_path, factory, loss_fn, batches, kw):
    """The same loops without the planted bug: no event (meta placeholders, frozen parameters
    the forward writes, calls under torch.func transforms are no evidence of one)."""
    assert fit(tmp_path, factory, loss_fn, batches(), **kw) is None
    assert not list(tmp_path.glob("*.nan"))
