"""Numerical failure modes in depth, end to end: each test trains a model from
``numerics_models`` as a user would until the recorder raises, runs ``nanreplay BUNDLE --json``
and asserts the step, phase, module, op, samples, cause and that the hint names the fix."""

from __future__ import annotations

from pathlib import Path

import numerics_models as M
import pytest
import torch
import torch.nn.functional as F
from bundles import nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError

K = 3  # the step at which every planted bug fires


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train(factory: str, make, out_dir: Path, loss_fn, steps: int = 6) -> NonFiniteError:
    """Train ``numerics_models.<factory>()`` with Adam until the recorder raises;
    ``make(step)`` gives ``(model args, target)``."""
    model = getattr(M, factory)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                            factory=f"numerics_models:{factory}") as rec:
            for step in range(steps):
                args, target = make(step)
                opt.zero_grad()
                rec.loss_fn(model(*args), target).backward()  # (a function is wrapped)
                opt.step()
    assert info.value.event["step"] == K
    return info.value


def origin_of(rep: dict) -> tuple:
    o = rep["origin"]
    return rep["event"]["step"], o["phase"], o["module"], o["op"], o["samples"], rep["cause"]


def test_logsumexp_pooling_of_an_empty_bag_is_the_masked_row_not_the_layer_after(tmp_path):
    """Multiple-instance learning with a masked logsumexp pooling: a bag whose instances were
    all filtered out is a row of -inf only (the mask, intentional), logsumexp makes -inf of it,
    and the classifier after the pooling makes NaN (-inf times weights of both signs). The op
    to blame is the logsumexp in ``pool`` on that bag, not the classifier's addmm."""

    def make(s):
        g = torch.Generator().manual_seed(10 + s)
        x = torch.randn(8, M.BAG, M.D_IN, generator=g)
        lens = torch.randint(1, M.BAG + 1, (8,), generator=g)
        if s == K:
            lens[6] = 0  # bag 6 is empty
        mask = torch.arange(M.BAG) < lens[:, None]
        return (x, mask), (x[..., 0] > 1).any(1).float()

    err = train("make_bag_net", make, tmp_path, nn.BCEWithLogitsLoss())
    rep = nanreplay_json(err.bundle_path)
    assert origin_of(rep) == (K, "forward", "pool", "aten.logsumexp", [6], "invalid"), rep
    assert rep["reproduced"] is True and rep["origin"]["made"] == "-inf"
    chain = rep["origin"]["chain"]
    assert [(c["op"], c["intentional"]) for c in chain] == [
        ("aten.masked_fill", True), ("aten.logsumexp", False)], chain
    assert "fully masked row" in rep["hint"] and "skip or fill empty rows" in rep["hint"]


@pytest.mark.parametrize("factory, node, op", [
    ("make_eigh_whiten_net", "LinalgEighBackward0", "eigh"),
    ("make_svd_whiten_net", "LinalgSvdBackward0", "svd")])
def test_whitening_a_batch_of_identical_samples_names_the_repeated_values(tmp_path, factory,
                                                                         node, op):
    """ZCA whitening through eigh (or svd) of the batch covariance: a batch that repeats one
    sample has a covariance of eps * I, all of whose eigenvalues are equal; the gradient of
    the eigenvectors divides by their differences. Backward event in ``white``, invalid, and
    the hint says the values are repeated and what removes the term (eps * I does not)."""

    def make(s):
        g = torch.Generator().manual_seed(20 + s)
        x = torch.randn(16, M.D_IN, generator=g)
        if s == K:
            x[:] = x[0]  # the sampler repeated one record for the whole batch
        return (x,), (x[:, 0] > 0).long() + (x[:, 1] > 0).long()

    err = train(factory, make, tmp_path, nn.CrossEntropyLoss())
    assert err.event["phase"] == "backward"
    rep = nanreplay_json(err.bundle_path)
    assert origin_of(rep)[:4] == (K, "backward", "white", node) and rep["cause"] == "invalid"
    assert rep["reproduced"] is True
    hint = rep["hint"]
    assert f"gradient of {op}'s vectors divides by the differences" in hint, hint
    assert "repeated" in hint and "Newton-Schulz" in hint and "eps * I does not" in hint, hint


def test_actnorm_data_dependent_init_on_a_constant_feature_is_its_log_not_bad_weights(tmp_path):
    """Glow's ActNorm initialises its parameters from the first batch inside the forward; a
    feature constant in that batch has std 0 and the scale -log(0) = +inf is written into the
    parameter. The weights were finite when the step began, so this is no ``weights`` event
    (which would send the user hunting for a checkpoint loader): the forward of ``norm0``
    makes it, and the replay, re-running the init from the pre-step buffer, names aten.log of 0
    in it, ``invalid``, and says the parameters were written by the step's own code."""
    K0 = 0  # the init runs on the first batch

    def make(s):
        x = torch.randn(16, M.D_IN, generator=torch.Generator().manual_seed(30 + s))
        if s == K0:
            x[:, 2] = 1.0  # a feature constant in the first batch (a padding column)
        return (x,), torch.zeros(16)

    model = M.make_flow()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.flow_nll, out_dir=tmp_path,
                            factory="numerics_models:make_flow") as rec:
            for step in range(3):
                (x,), y = make(step)
                opt.zero_grad()
                rec.loss_fn(model(x), y).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (K0, "forward", "norm0"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], rep["cause"]) == (
        "forward", "norm0", "aten.log", "invalid"), rep
    assert rep["reproduced"] is True and "log has a pole at 0" in rep["hint"], rep["hint"]
    assert any("norm0.log_scale" in p and "data-dependent" in p for p in rep["problems"]), rep


def test_a_softplus_concentration_below_float64s_range_is_underflow_not_invalid(tmp_path):
    """Gamma regression, softplus in the loss: an outlier record drives the raw output to
    about -4000, softplus of it is positive in exact arithmetic but 0 in float32 and float64
    alike, and lgamma(0) is +inf. The loss event names aten.lgamma on that sample, and the
    cause is ``underflow`` (the 0 came from softplus), not ``invalid`` ("exact arithmetic
    makes it too", which it does not)."""
    model = M.make_regression_head()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.gamma_nll, out_dir=tmp_path,
                            factory="numerics_models:make_regression_head") as rec:
            for step in range(6):
                g = torch.Generator().manual_seed(40 + step)
                x = torch.randn(16, M.D_IN, generator=g)
                y = torch.rand(16, generator=g) * 3 + 0.1
                if step == K:  # an outlier record, along the concentration's weights
                    x[5] = -1000 * model.lin.weight[0].detach().sign()
                opt.zero_grad()
                rec.loss_fn(model(x), y).backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    assert origin_of(rep) == (K, "loss", "<loss>", "aten.lgamma", [5], "underflow"), rep
    assert "softplus" in rep["hint"] and "below float64's range" in rep["hint"], rep["hint"]


def test_a_loss_logsumexp_over_no_positive_is_the_masked_row(tmp_path):
    """A multi-label loss takes logsumexp over each record's positive tags (the others masked
    to -inf): an untagged record is a row of -inf only, logsumexp makes -inf of it and the loss
    +inf. The loss event names that logsumexp, after the intentional fill in the chain, on
    that record, with the fully-masked-row hint (not the label-smoothing advice for a -inf
    the model output was allowed to hold)."""

    def make(s):
        g = torch.Generator().manual_seed(50 + s)
        x = torch.randn(8, M.D_IN, generator=g)
        y = (torch.rand(8, 5, generator=g) < 0.4).float()
        y[:, 0] = 1.0
        if s == K:
            y[2] = 0.0  # an untagged record
        return (x,), y

    err = train("make_tagger", make, tmp_path, M.multi_positive_loss)
    rep = nanreplay_json(err.bundle_path)
    assert origin_of(rep) == (K, "loss", "<loss>", "aten.logsumexp", [2], "invalid"), rep
    chain = rep["origin"]["chain"]
    assert [(c["op"], c["intentional"]) for c in chain] == [
        ("aten.masked_fill", True), ("aten.logsumexp", False)], chain
    assert "fully masked row" in rep["hint"] and "label smoothing" not in rep["hint"], rep


def test_a_coupling_scale_that_overflows_exp_says_to_bound_the_exponent(tmp_path):
    """RealNVP's affine coupling scales by exp(s) of a learned s: a record 1000x too large
    makes s large enough that exp overflows float32 (float64 holds it). The forward event
    names aten.exp in the coupling, on that record, ``overflow``, and the hint gives the fix a
    flow uses, bounding the exponent (tanh), beside rescaling or a wider type."""

    def make(s):
        x = torch.randn(16, M.D_IN, generator=torch.Generator().manual_seed(60 + s))
        if s == K:
            x[9] *= 1e3  # a record in the wrong unit
        return (x,), torch.zeros(16)

    err = train("make_flow", make, tmp_path, M.flow_nll)
    rep = nanreplay_json(err.bundle_path)
    assert origin_of(rep) == (K, "forward", "coup0", "aten.exp", [9], "overflow"), rep
    assert "float64 holds it" in rep["hint"] and "tanh(s)" in rep["hint"], rep["hint"]


def test_acos_of_a_cosine_rounded_to_one_is_precision_and_the_clamp(tmp_path):
    """ArcFace without a clamp: a sample's embedding lies exactly along its class's weight, the
    cosine of the two unit vectors rounds to 1.0 in float32 and acos's derivative is -inf
    there (float64 rounds it just below 1: finite). Not an overflow that float64 fixes: the
    cosine must be clamped inside (-1, 1)."""
    model, crit = M.make_arcface_net(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="numerics_models:make_arcface_net"):
            for step in range(6):
                g = torch.Generator().manual_seed(step)
                x, y = torch.randn(32, 16, generator=g), torch.randint(0, 10, (32,), generator=g)
                if step == K:  # a class's weight along one sample's embedding
                    planted = _plant_parallel_weight(model, x, y)
                loss = crit(model(x, y), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], o["samples"]) == \
        (K, "backward", "head", "AcosBackward0", [planted])
    assert rep["cause"] == "precision" and rep["reproduced"] is True
    assert "rounded to exactly +-1, the edge of acos's domain" in rep["hint"]
    assert "cos.clamp(-1 + eps, 1 - eps)" in rep["hint"]


def _plant_parallel_weight(model, x, y) -> int:
    """Set one class's weight to a multiple of a sample's embedding whose float32 cosine,
    computed as the head computes it for this batch, is exactly 1.0, and return the sample.
    Which multiple of which sample rounds to 1.0 depends on how the CPU's kernels sum (3x of
    sample 3's does on AMD EPYC, not on Intel Xeon), so the first that does here is taken. A
    multiple that is not a power of two rounds the weight off the exact direction: float64
    keeps the cosine below 1."""
    with torch.no_grad():
        emb = model.backbone(x)
        for i in (3, *range(len(x))):
            row = model.head.W[y[i]].clone()
            for c in (k / 4 for k in range(12, 400) if k & (k - 1)):  # (3x first)
                model.head.W[y[i]] = c * emb[i]
                cos = F.linear(F.normalize(emb), F.normalize(model.head.W))
                if cos[i, y[i]].item() == 1.0 and (cos <= 1.0).all():
                    return i
            model.head.W[y[i]] = row
    pytest.fail("no multiple of an embedding gives a float32 cosine of exactly 1.0 here")


def test_float16_overflow_prints_the_value_and_the_limit_apart(tmp_path):
    """Under float16 autocast, sample 1 is an image of raw 16-bit values (up to 65535, not
    scaled to [0, 1]): autocast's cast of it for the patch convolution rounds 65535 to +inf.
    The hint said the true result 'up to 6.55e+04' is 'beyond float16's largest value
    6.55e+04', the same number twice; both now get the digits that tell them apart."""

    def make(s):
        g = torch.Generator().manual_seed(s)
        img = torch.rand(4, 3, 16, 16, generator=g)
        if s == K:
            img[1] = torch.round(img[1] * 65535.0)
            img[1, 0, 0, 0] = 65535.0
        return (img,), torch.randint(0, 10, (4,), generator=g)

    model, crit = M.make_patch_net(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="numerics_models:make_patch_net"):
            for step in range(6):
                (img,), y = make(step)
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = crit(model(img), y)
                loss.backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    assert origin_of(rep) == (K, "forward", "patch", "aten._to_copy", [1], "overflow"), rep
    assert rep["origin"]["made"] == "+inf" and rep["reproduced"] is True
    assert "(up to 6.554e+04) is finite but beyond float16's largest value 6.55e+04" \
        in rep["hint"], rep["hint"]
