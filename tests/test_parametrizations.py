"""PyTorch's parametrizations as training code uses them (``parametrization_models``): the new
``parametrizations.weight_norm``, ``spectral_norm`` and ``orthogonal``, a user's own
``register_parametrization`` (an ``exp`` positivity, a symmetric weight), the forward under
``parametrize.cached()``, and the old hook-based ``nn.utils.weight_norm`` for contrast.

Each loop is a real one (a DataLoader over a synthetic dataset, an optimizer, a loss module)
recorded with a factory. Healthy runs raise no event and lose nothing to the recorder (the
losses are bit-identical to the loop without it); each planted bug is named where its first
non-finite value is made.

Where a parametrization makes the weight, the module to name is the parametrization itself
(``<layer>.parametrizations.<tensor>.0``): torch calls it through ``__call__`` from inside the
layer's forward when the layer reads ``self.weight``, and the op that makes the NaN runs in it,
on the parameter ``original`` the user trains, before the layer's own ``F.linear`` sees any
value. Naming the layer would send the user to its matmul, whose inputs were already NaN.
The ops were checked with a ``TorchDispatchMode`` on the same planted weights: weight_norm's
``torch._weight_norm`` dispatches ``aten._weight_norm_interface`` on the CPU (0/0 in the row
whose direction is 0), spectral_norm's ``weight / sigma`` is ``aten.div`` of 0 by 0 (its power
iteration's ``F.normalize`` clamps its norms to eps, and stays finite), and the ``exp``
parametrization is ``aten.exp`` of a parameter above log(float32 max) = 88.7.
"""

from __future__ import annotations

import math
from pathlib import Path

import parametrization_models as P
import pytest
import torch
from bundles import nanreplay_json
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

pytestmark = pytest.mark.usefixtures("in_tests_dir")
K = 3  # the step at which each planted bug is planted
N, BATCH = 96, 16


def loader(regression: bool = False) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, P.D_IN, generator=g)
    y = x[:, :2].sum(1) if regression else (x[:, 0] > 0).long() + (x[:, 1] > 1).long()
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True,
                      generator=torch.Generator().manual_seed(2))


def run(factory: str, out_dir: Path | None, *, plant=None, cached: bool = False,
        steps: int = 6, lr: float = 0.05, given: bool = True) -> list[float]:
    """Train ``parametrization_models.<factory>()`` for ``steps`` steps (under the recorder when
    ``out_dir`` is given, told the factory when ``given``); ``plant(model, step, batch)`` may
    break something before a step's forward. Returns the losses."""
    model = getattr(P, factory)()
    regression = factory == "make_variance_net"
    binary = "discriminator" in factory  # (real/fake: one logit)
    crit = nn.GaussianNLLLoss() if regression else \
        nn.BCEWithLogitsLoss() if binary else nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses: list[float] = []

    def loop():
        for step, (x, y) in enumerate(loader(regression)):
            if step == steps:
                break
            if plant:
                plant(model, step, y)
            opt.zero_grad()
            if cached:
                with parametrize.cached():
                    out = model(x)
            else:
                out = model(x)
            loss = crit(out[0], y, out[1]) if regression else \
                crit(out.squeeze(1), (y > 0).float()) if binary else crit(out, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())

    if out_dir is None:
        loop()
    else:
        named = {"factory": f"parametrization_models:{factory}"} if given else {}
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, **named):
            loop()
    return losses


def crash(factory: str, out_dir: Path, plant, **kw) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        run(factory, out_dir, plant=plant, **kw)
    return info.value


@pytest.mark.parametrize("factory, cached", [
    ("make_weight_norm", False), ("make_weight_norm", True), ("make_old_weight_norm", False),
    ("make_discriminator", False), ("make_old_discriminator", False),
    ("make_orthogonal", False), ("make_orthogonal", True),
    ("make_variance_net", False), ("make_symmetric", False)])
def test_healthy_parametrized_runs_raise_nothing_and_change_no_loss(out_dir, factory, cached):
    plain = run(factory, None, cached=cached)
    recorded = run(factory, out_dir, cached=cached)
    assert len(plain) == 6 and all(math.isfinite(v) for v in plain)
    assert recorded == plain  # bit for bit
    assert not out_dir.exists() or not list(out_dir.iterdir())


def prune_rows(rows, attr):
    """At step K the user's structured pruning zeroes the *direction* of two hidden units,
    the mistake with weight norm (their magnitude g stays, g * 0 / |0| is 0/0)."""
    def plant(model, step, y):
        if step == K:
            with torch.no_grad():
                attr(model[0])[rows] = 0.0
    return plant


@pytest.mark.parametrize("cached", [False, True])
def test_weight_norm_direction_rows_pruned_to_zero(out_dir, cached):
    """``parametrizations.weight_norm``: rows 3 and 9 of ``original1`` (the direction v) zeroed
    at step K. The weight ``g * v / |v|`` is made by the parametrization's
    ``torch._weight_norm`` (``aten._weight_norm_interface``), 0/0 in those rows: an
    ``invalid`` op in ``0.parametrizations.weight.0``, whose hint names the direction's zero
    rows and the magnitude ``original0`` as the one to zero instead. Under
    ``parametrize.cached()`` torch still calls the parametrization on the layer's first read of
    its weight, so nothing changes."""
    err = crash("make_weight_norm", out_dir,
                prune_rows([3, 9], lambda m: m.parametrizations.weight.original1),
                cached=cached)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (K, "forward",
                                                        "0.parametrizations.weight.0"), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], rep["cause"], rep["reproduced"]) == (
        "0.parametrizations.weight.0", "aten._weight_norm_interface", "invalid", True), o
    # (the weight's 16 rows are hidden units, as many as the batch's 16 samples: every
    # sample meets units 3 and 9, none is named for a row of the weight)
    assert o["samples"] == list(range(BATCH)) and o["all_samples"] is True, o
    hint = rep["hint"]
    assert "0.parametrizations.weight.original1, which has 2 of its 16 rows all 0: [3, 9]" \
        in hint, hint
    assert "zero the same rows of the magnitude 0.parametrizations.weight.original0" in hint
    assert "initialise" not in hint, hint  # (the rows were trained, then pruned)


def test_old_weight_norm_direction_rows_pruned_to_zero(out_dir):
    """The old ``nn.utils.weight_norm`` makes the same ``g * v / |v|`` in the Linear's forward
    pre-hook, not in a module of its own: the module is the Linear ``0`` (its hook ran inside
    its call), the op ``aten._weight_norm_interface``, and the hint names ``weight_v``'s zero
    rows and ``weight_g`` as the one to zero instead."""
    err = crash("make_old_weight_norm", out_dir, prune_rows([3, 9], lambda m: m.weight_v))
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (K, "forward", "0"), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], rep["cause"]) == (
        "0", "aten._weight_norm_interface", "invalid"), o
    assert o["samples"] == list(range(BATCH)), o
    hint = rep["hint"]
    assert "0.weight_v, which has 2 of its 16 rows all 0: [3, 9]" in hint, hint
    assert "zero the same rows of the magnitude 0.weight_g" in hint, hint
    assert "initialise" not in hint, hint


def test_spectral_norm_of_a_discriminator_head_reset_to_zero(out_dir):
    """A GAN discriminator under ``parametrizations.spectral_norm``; at step K the user resets
    its head (``2``) to zeros. The power iteration's normalisations clamp a zero norm to eps
    (u, v become 0, finite); sigma = u . W v = 0, and ``weight / sigma`` is ``aten.div`` of 0
    by 0 in ``2.parametrizations.weight.0``: ``invalid``, with a hint naming the
    parametrization's parameter ``original`` all 0."""
    def plant(model, step, y):
        if step == K:
            with torch.no_grad():
                model[2].parametrizations.weight.original.zero_()

    err = crash("make_discriminator", out_dir, plant)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (K, "forward",
                                                        "2.parametrizations.weight.0"), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], rep["cause"]) == (
        "2.parametrizations.weight.0", "aten.div", "invalid"), o
    hint = rep["hint"]
    assert "2.parametrizations.weight.original" in hint and "is all 0" in hint, hint
    assert "SpectralNorm" in hint, hint


def test_exp_variance_parametrization_overflows_after_an_outlier(out_dir):
    """A heteroscedastic regressor's variance is the user's ``exp`` parametrization of
    ``noise.var``. At step K one target is 1e4: the Gaussian NLL's gradient in the variance's
    parameter, 0.5 * (1 - r² / var) / B, is about -3e6, and SGD moves the parameter by about
    lr * 3e6, far above log(float32 max) = 88.7. The next forward's ``exp`` overflows: step
    K + 1, ``aten.exp`` in the user's parametrization ``noise.parametrizations.var.0``,
    ``overflow``."""
    def plant(model, step, y):
        if step == K:
            y[0] = 1e4

    err = crash("make_variance_net", out_dir, plant)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (
        K + 1, "forward", "noise.parametrizations.var.0"), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], rep["cause"]) == (
        "noise.parametrizations.var.0", "aten.exp", "overflow"), o
    assert o["samples"] == list(range(BATCH)), o  # (one variance, expanded over the batch)
    hint = rep["hint"]
    # the parameter is torch's storage of the parametrization; the place to bound it is the
    # user's Exp.forward, not a use of that name (which the model never writes)
    assert "input is the parameter noise.parametrizations.var.original" in hint, hint
    assert "the parametrization that makes noise.var (Exp in noise.parametrizations.var): " \
        "bound it in that parametrization's forward" in hint, hint
    assert "var.original.clamp" not in hint, hint
    assert f"the gradient norm had jumped at step {K}" in hint, hint  # (the outlier's step)


def record_without_factory(factory: str, out_dir: Path, plant) -> NonFiniteError:
    """The loop of ``run`` recorded with no ``factory=`` (a notebook's model)."""
    return crash(factory, out_dir, plant, given=False)


@pytest.mark.parametrize("factory, storage, module", [
    ("make_weight_norm", lambda m: m.parametrizations.weight.original1,
     "0.parametrizations.weight.0"),
    ("make_old_weight_norm", lambda m: m.weight_v, "0")])
def test_parametrized_stock_model_is_rebuilt_without_a_factory(out_dir, factory, storage,
                                                               module):
    """An ``nn.Sequential`` of torch's modules with torch's own weight_norm on its first layer,
    recorded with no factory: the README's promise for a model of torch.nn's own modules holds
    for it too. The bundle describes the layer as the ``Linear`` it is, with the weight_norm
    applied to it, so the replay rebuilds it, loads ``original0``/``original1`` (or
    ``weight_g``/``weight_v``) and re-runs the step: the same module, op and cause as with the
    factory. (Before, the new API's ``ParametrizedLinear`` was no torch.nn class and nothing was
    re-run; the old API's Linear was rebuilt without its hook, and refused as "built without
    its 'weight_g', 'weight_v' ...: the constructor argument that makes it is kept in no
    attribute".)"""
    err = record_without_factory(factory, out_dir, prune_rows([3, 9], storage))
    assert (err.event["step"], err.event["module"]) == (K, module), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], rep["cause"], rep["reproduced"]) == (
        module, "aten._weight_norm_interface", "invalid", True), (o, rep["problems"])
    assert any("rebuilt from the bundle's description" in p for p in rep["problems"])


def test_a_users_own_parametrization_is_no_stock_model(out_dir):
    """A ``Symmetric`` parametrization of the user's own is user code that no description
    rebuilds: the bundle describes no stock model, and the replay asks for a factory (the
    planted bug: a bad checkpoint writes the symmetric weight to 3e38 and the first layer's
    bias to 10, so every hidden value is tanh(~10) ~ 1 and each of the symmetric layer's sums
    of 16 terms is ~4.8e38, above float32's max 3.4e38)."""
    def plant(model, step, y):
        if step == K:
            with torch.no_grad():
                model[2].parametrizations.weight.original.fill_(3e38)
                model[0].bias.fill_(10.0)

    err = record_without_factory("make_symmetric", out_dir, plant)
    assert (err.event["step"], err.event["phase"]) == (K, "forward"), err.event
    assert "stock" not in read_bundle(err.bundle_path)[0]["model"]
    rep = nanreplay_json(err.bundle_path, code=None)
    assert rep["reproduced"] is False and rep["origin"]["op"] is None, rep
    assert any("pass --factory" in p for p in rep["problems"]), rep["problems"]


def grow_generator(model, step, y):
    """At step K a bad resume writes orthogonal's ``original`` at a scale of 1e12."""
    if step == K:
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            model[2].parametrizations.weight.original.copy_(
                torch.randn(P.HIDDEN, P.HIDDEN, generator=g) * 1e12)


def zero_head(model, step, y):
    """At step K the user resets the discriminator's head to zeros (its trained weight)."""
    if step == K:
        with torch.no_grad():
            head = model[2]
            (head.weight_orig if hasattr(head, "weight_orig")
             else head.parametrizations.weight.original).zero_()


@pytest.mark.parametrize("factory, plant, module, op", [
    ("make_orthogonal", grow_generator, "2.parametrizations.weight.0", "aten.linalg_matrix_exp"),
    ("make_discriminator", zero_head, "2.parametrizations.weight.0", "aten.div"),
    ("make_old_discriminator", zero_head, "2", "aten.div")])
def test_no_factory_replay_names_what_the_factory_replay_names(out_dir, tmp_path, factory,
                                                              plant, module, op):
    """The same planted bug recorded with and without a factory: the rebuilt model (torch's
    orthogonal with its trivialization's ``base`` buffer, spectral_norm with its power
    iteration's ``_u``, ``_v``; the hook-based spectral_norm's ``weight_orig``, ``weight_u``,
    ``weight_v``) re-runs the step to the same origin, cause and hint. (The hook-based
    spectral_norm's ``weight / sigma`` runs in the Linear's forward pre-hook, so its module is
    the Linear ``2``; its op was checked with a TorchDispatchMode: ``aten.div`` of 0 by 0.)"""
    reps = []
    for given, where in ((True, out_dir), (False, tmp_path / "no-factory")):
        with pytest.raises(NonFiniteError) as info:
            run(factory, where, plant=plant, given=given)
        reps.append(nanreplay_json(info.value.bundle_path))
    with_factory, without = reps
    o = without["origin"]
    assert (o["module"], o["op"], without["reproduced"]) == (module, op, True), \
        (o, without["problems"])
    assert (without["cause"], without["hint"]) == (with_factory["cause"], with_factory["hint"])
    assert any("rebuilt from the bundle's description" in p for p in without["problems"])


def test_orthogonal_generator_grown_huge_overflows_matrix_exp(out_dir):
    """``parametrizations.orthogonal`` on a square layer uses ``matrix_exp`` of the
    skew-symmetric ``A = X.tril() - X.tril().T`` of its parameter ``original`` (times the
    ``base`` its trivialization keeps). At step K a bad resume writes ``original`` at a scale
    of 1e12: exp(A) is still orthogonal (its entries within [-1, 1]), but float32's
    scaling-and-squaring overflows on the way and returns NaN, which float64 does not (both
    checked with plain torch.linalg.matrix_exp). The op is ``aten.linalg_matrix_exp`` in
    ``2.parametrizations.weight.0``, the cause ``overflow``; the fix cannot be to rescale
    inside torch's code (no row max to subtract there): the hint says to keep ``original`` in
    range by its updates, or the layer in float64."""
    def plant(model, step, y):
        if step == K:
            with torch.no_grad():
                g = torch.Generator().manual_seed(0)
                model[2].parametrizations.weight.original.copy_(
                    torch.randn(P.HIDDEN, P.HIDDEN, generator=g) * 1e12)

    x = torch.randn(P.HIDDEN, P.HIDDEN, generator=torch.Generator().manual_seed(0)) * 1e12
    a = x.tril() - x.tril().T
    assert not torch.linalg.matrix_exp(a).isfinite().all()  # (float32: NaN on the way)
    assert torch.linalg.matrix_exp(a.double()).isfinite().all()  # (float64 holds it)
    err = crash("make_orthogonal", out_dir, plant)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (K, "forward",
                                                        "2.parametrizations.weight.0"), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], rep["cause"]) == (
        "2.parametrizations.weight.0", "aten.linalg_matrix_exp", "overflow"), o
    assert o["samples"] == list(range(BATCH)), o
    hint = rep["hint"]
    assert "torch's _Orthogonal parametrization of 2.weight, on its parameter " \
        "2.parametrizations.weight.original" in hint, hint
    assert "subtract the row max" not in hint and "keep that parameter in range" in hint, hint
