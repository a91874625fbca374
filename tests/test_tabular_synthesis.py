"""End to end: synthetic tabular data as SDV's CTGAN and TVAE train it
(``tabular_synthesis_models``: mode-specific normalisation of the continuous columns, one-hot
categories, training-by-sampling's conditional vector, a gumbel-softmax generator, a PacGAN
critic under WGAN-GP, TVAE's ELBO with per-column sigmas, Adam with betas (0.5, 0.9)),
trained under the recorder from a DataLoader until a planted bug of the domain fires, then
replayed with the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tabular_synthesis_models as M
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

BATCH = 64


def line_of(text: str) -> str:
    return source_line("tabular_synthesis_models.py", text)


def encoded(table=None, **transformer) -> torch.Tensor:
    """The table encoded by a transformer fitted on the clean table."""
    t = M.DataTransformer(**transformer).fit(M.customers())
    return t.transform(table if table is not None else M.customers())


def fit_tvae(data, model, opt, loss, rec=None, clamp: bool = True) -> list[float]:
    """One TVAE epoch; ``clamp``: TVAE's ``sigma.data.clamp_(0.01, 1.0)`` after each step."""
    call = rec.loss_fn if rec is not None else loss
    losses = []
    for (x,) in DataLoader(TensorDataset(data), batch_size=BATCH):
        opt.zero_grad()
        value = call(*model(x), x)
        value.backward()
        opt.step()
        if clamp:
            model.sigma.data.clamp_(0.01, 1.0)
        losses.append(float(value.detach()))
    return losses


def fit_gan(data, gen, critic, g_opt, d_opt, rec=None, recorded="critic", anneal=None,
            eps=1e-12, g_loss=M.GeneratorLoss) -> list[tuple[float, float]]:
    """One CTGAN epoch: a condition per row sampled from the log frequencies, a critic step
    on (real, fake) with the gradient penalty, a generator step; ``anneal(step)`` sets the
    gumbel temperature."""
    d_loss, gen_loss = M.WGANGPLoss(critic, eps=eps), g_loss(critic)
    if rec is not None:
        d_loss, gen_loss = (rec.loss_fn, gen_loss) if recorded == "critic" else \
            (d_loss, rec.loss_fn)
    log_freq, g = M.log_frequency(data), torch.Generator().manual_seed(0)
    losses = []
    for step, (real,) in enumerate(DataLoader(TensorDataset(data), batch_size=BATCH)):
        if anneal is not None:
            gen.tau = anneal(step)
        cond = M.sample_cond(log_freq, len(real), g)
        real_c = torch.cat([real, cond], 1)
        fake, _ = gen(torch.randn(len(real), M.Z), cond)
        fake_c = torch.cat([fake, cond], 1).detach()
        d_opt.zero_grad()
        dl = d_loss(critic(real_c), critic(fake_c), real_c, fake_c)
        dl.backward()
        d_opt.step()
        g_opt.zero_grad()
        fake, raw = gen(torch.randn(len(real), M.Z), cond)
        gl = gen_loss(fake, raw, cond)
        gl.backward()
        g_opt.step()
        losses.append((float(dl.detach()), float(gl.detach())))
    return losses


def tvae_run(tmp_path: Path, data, recorded: bool = True, epochs: int = 1, lr: float = 1e-3,
             clamp: bool = True):
    torch.manual_seed(3)
    model, loss = M.make_tvae(), M.TVAELoss()
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.5, 0.9))
    if not recorded:
        return [fit_tvae(data, model, opt, loss, clamp=clamp) for _ in range(epochs)], model
    with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path,
                        factory="tabular_synthesis_models:make_tvae") as rec:
        return [fit_tvae(data, model, opt, loss, rec, clamp) for _ in range(epochs)], model


def gan_run(tmp_path: Path, data, recorded: str | None = "critic", critic: str = "make_critic",
            kept: list | None = None, **kw):
    gen, net = M.make_generator(), getattr(M, critic)()
    g_opt = torch.optim.Adam(gen.parameters(), lr=2e-4, betas=(0.5, 0.9))
    d_opt = torch.optim.Adam(net.parameters(), lr=2e-4, betas=(0.5, 0.9))
    torch.manual_seed(3)
    if recorded is None:
        return fit_gan(data, gen, net, g_opt, d_opt, **kw), (gen, net)
    model, opt, factory = (net, d_opt, critic) if recorded == "critic" else \
        (gen, g_opt, "make_generator")
    loss = M.WGANGPLoss(net, eps=kw.get("eps", 1e-12)) if recorded == "critic" else \
        kw.get("g_loss", M.GeneratorLoss)(net)
    if kept is not None:
        kept.append(loss)
    with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path,
                        factory=f"tabular_synthesis_models:{factory}") as rec:
        return fit_gan(data, gen, net, g_opt, d_opt, rec, recorded, **kw), (gen, net)


def fire(run, *args, **kw) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        run(*args, **kw)
    return info.value


def report(err: NonFiniteError, step: int, phase: str) -> tuple[dict, dict]:
    assert (err.event["step"], err.event["phase"]) == (step, phase), err.event
    rep = nanreplay_json(err.bundle_path)
    assert rep["reproduced"] is True, json.dumps(rep, indent=1)
    return rep, rep["origin"]


def params(modules) -> list[torch.Tensor]:
    return [p.detach().clone() for m in modules for p in m.parameters()]


@pytest.mark.parametrize("kind", ["tvae", "critic", "generator"])
def test_healthy_synthesizers_raise_nothing_and_train_bit_identically(tmp_path, kind):
    data = encoded()
    runs = []
    for recorded in (False, True):
        if kind == "tvae":
            losses, model = tvae_run(tmp_path, data, recorded, epochs=2)
            runs.append((losses, params([model])))
        else:
            losses, nets = gan_run(tmp_path, data, kind if recorded else None)
            runs.append((losses, params(nets)))
    (plain, w0), (watched, w1) = runs
    assert plain == watched
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert not list(tmp_path.glob("*.nan"))


def test_a_zero_inflated_columns_spike_mode_with_sigma_0_is_named_as_a_group_of_records(
        tmp_path):
    """The balance column's zeros (a third of the customers) form a mixture mode whose values
    are all equal: sigma_k = 0, and the normaliser written without an eps encodes each of them
    as (0 - 0) / (4 * 0), NaN at exactly the records whose mode one-hot (feature 5) is 1. The
    hint called them missing values never imputed ('a genotype call not made', impute the
    feature's mean); it now says the NaN follow that group, a per-group scale of 0."""
    data = encoded(eps_of={"balance": 0.0})
    zeros = [i for i in range(BATCH) if data[i, 5] == 1]
    err = fire(tvae_run, tmp_path, data)
    rep, o = report(err, 0, "input")
    assert (o["samples"], o["made"], rep["cause"]) == (zeros, "nan", "input"), rep
    assert len(zeros) == 18
    assert "in feature 4 (of 16) of exactly the samples whose feature 5 is 1 (18 of 64" in \
        rep["hint"], rep["hint"]
    assert "sigma_g = 0" in rep["hint"] and "genotype" not in rep["hint"], rep["hint"]


def test_an_income_in_the_wrong_unit_overflows_the_reparameterisation_at_that_record(tmp_path):
    """A shard whose record 9 of its second batch holds an income in cents (3e9) beyond the
    fitted modes: its alpha is ~7e4, the encoder's logvar huge, ``exp(0.5 * logvar)``
    overflows at that record; the hint says the record is out of scale."""
    table = M.customers()
    table["income"][BATCH + 9] = 3e9
    err = fire(tvae_run, tmp_path, encoded(table))
    rep, o = report(err, 1, "forward")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "", "aten.exp", "+inf", [9], "overflow"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("std = torch.exp(0.5 * logvar)")
    assert "the data of these samples is out of scale" in rep["hint"], rep["hint"]


def tvae_first_nan(data, epochs: int, lr: float) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``tvae_run(recorded=False, clamp=False)``'s steps, stopped at the first whose loss is
    not finite: (that step, ``sigma`` then, ``sigma`` before the last update)."""
    torch.manual_seed(3)
    model, loss = M.make_tvae(), M.TVAELoss()
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.5, 0.9))
    step, before = 0, None
    for _ in range(epochs):
        for (x,) in DataLoader(TensorDataset(data), batch_size=BATCH):
            opt.zero_grad()
            value = loss(*model(x), x)
            if not value.isfinite():
                return step, model.sigma.detach().clone(), before
            value.backward()
            before = model.sigma.detach().clone()
            opt.step()
            step += 1
    raise AssertionError("the loss stayed finite")


def test_tvae_sigma_without_its_clamp_is_stepped_below_0_by_adam(tmp_path):
    """TVAE clamps its per-column sigma to [0.01, 1] after each step; without it, the sigma of
    the few-valued ``products`` column (every alpha 0: reconstructed exactly) is chased to 0
    and Adam's step at lr 0.1 crosses it: ``log(sigma)`` of a negative number in the loss.
    The hint named the parameter but not that the last update took it across 0 (from 0.04545
    to -0.0505 at step 44 on the Xeon this was written on, Adam's state run backwards; the
    step and the values are rounding's, so a plain run without the recorder says which): it
    now does, and says to clamp after the step."""
    data = encoded()
    step, sigma, before = tvae_first_nan(data, epochs=12, lr=0.1)  # (the oracle, unwatched)
    alphas = [lo for lo, _, kind in M.SPANS if kind == "alpha"]
    assert [i for i in alphas if sigma[i] <= 0] == [8] and before[8] > 0, (sigma, before)
    err = fire(tvae_run, tmp_path, data, epochs=12, lr=0.1, clamp=False)
    rep, o = report(err, step, "loss")
    assert (o["module"], o["op"], o["made"], rep["cause"]) == (
        "<loss>", "aten.log", "nan", "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("terms.append(torch.log(std) * x.size(0))")
    said = f"aten.log's input is the parameter sigma ({float(sigma[8]):.4g})"
    assert said in rep["hint"], (said, rep["hint"])
    # (sigma[8] was above 0 before the step's update: the update crossed 0; the report
    # computes it from the bundle's weights and Adam's state, the oracle kept it)
    was = re.search(r"the optimizer's last update \(Adam, lr 0\.1, its update (\d+)\) moved "
                    r"sigma\[8\] there from ([-+.\de]+), where the op was defined", rep["hint"])
    assert was and int(was[1]) == step, rep["hint"]
    assert float(was[2]) == pytest.approx(float(before[8]), rel=1e-3), (was[2], before[8])


def test_a_gumbel_temperature_annealed_to_0_divides_by_the_number_0(tmp_path):
    """``tau = max(0, 0.2 - 0.1 * step)`` reaches 0 at step 2: gumbel_softmax's
    ``(logits + g) / tau`` is ±inf, the softmax NaN, in every row."""
    err = fire(gan_run, tmp_path, encoded(), "generator",
               anneal=lambda s: max(0.0, 0.2 - 0.1 * s))
    rep, o = report(err, 2, "forward")
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "", "aten.div", list(range(BATCH)), "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("F.gumbel_softmax(raw[:, lo:hi], tau=self.tau, dim=1)")
    assert "by the number 0" in rep["hint"] and "annealed to 0" in rep["hint"], rep["hint"]


def test_a_conditional_loss_on_gumbel_samples_underflows_at_a_low_temperature(tmp_path):
    """The conditional loss taken as ``log`` of the gumbel-softmax samples instead of the
    logits: at tau 0.05 a region's probability is 2e-52, 0 in float32, and its log -inf."""
    err = fire(gan_run, tmp_path, encoded(), "generator",
               anneal=lambda s: max(0.01, 0.2 * 0.5 ** s), g_loss=M.GeneratorLossOnOutputs)
    rep, o = report(err, 2, "loss")
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.log", "-inf", [36, 44], "underflow"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("ce = -(cond * torch.log(fake[:, lo:hi])).sum(1).mean()")
    assert "log_softmax instead of log(softmax)" in rep["hint"], rep["hint"]


def test_a_gradient_penalty_without_eps_at_a_pack_of_zero_gradient_is_backward_only(tmp_path):
    """A critic two units wide under Dropout(0.5): some pack has every unit of a layer dropped,
    its input gradient is exactly 0, and ``sqrt(sum(grad ** 2) + eps)`` with eps 0 has an
    infinite derivative there: the forward is finite, the backward of the penalty NaN. The
    origin's rows are packs of PAC samples (``grad.reshape(-1, PAC * D)``): the report named
    no samples; it now names the samples of the packs whose gradient was 0, where the view's
    backward unpacks them."""
    kept = []
    err = fire(gan_run, tmp_path, encoded(), "critic", critic="make_narrow_critic", eps=0.0,
               kept=kept)
    packs = (kept[0].last_norm == 0).nonzero().flatten().tolist()
    rows = [p * M.PAC + i for p in packs for i in range(M.PAC)]
    assert 0 < len(packs) < BATCH // M.PAC
    rep, o = report(err, 0, "backward")
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "<loss>", "SqrtBackward0", rows, "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == line_of("norm = torch.sqrt((grad ** 2).sum(1) + self.eps)")
    assert "the eps added to that input is exactly 0" in rep["hint"], rep["hint"]
    # (the penalty's sqrt runs on the critic's gradient but is differentiated once: its
    # first derivative's pole, which vector_norm's masked gradient avoids; it was told that
    # vector_norm is 0/0 to differentiate again, true only of an op the forward's own
    # derivative ran: replay.twice_differentiated)
    assert "torch.linalg.vector_norm(d, dim=-1) takes it with a gradient of 0" in rep["hint"]
    assert "differentiate again" not in rep["hint"], rep["hint"]
