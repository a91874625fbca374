"""Linear-algebra-heavy training, end to end: each test trains a model from ``linalg_models``
as its domain writes it (a Glow flow, an exact GP's marginal likelihood, ...) until the
recorder raises, runs ``nanreplay BUNDLE --json`` and asserts the step, phase, module, op,
samples, cause and that the hint names the fix."""

from __future__ import annotations

import copy
from pathlib import Path

import linalg_models as M
import pytest
import torch
import torch.nn.functional as F
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

K = 3  # the step at which a planted batch fires


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def origin_of(rep: dict) -> tuple:
    o = rep["origin"]
    return rep["event"]["step"], o["phase"], o["module"], o["op"], o["samples"], rep["cause"]


def train_glow(tmp_path, factory: str, steps: int) -> NonFiniteError:
    """Train ``linalg_models.<factory>()`` with Adam on Gaussian batches of 8 until the
    recorder raises; returns its error."""
    model = getattr(M, factory)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.flow_nll, out_dir=tmp_path,
                            factory=f"linalg_models:{factory}") as rec:
            for step in range(steps):
                x = torch.randn(8, M.C, generator=torch.Generator().manual_seed(step))
                opt.zero_grad()
                rec.loss_fn(model(x)).backward()
                opt.step()
    return info.value


def test_glow_logdet_of_a_rotation_with_determinant_minus_one_names_logdet(tmp_path):
    """Glow's invertible 1x1 convolution initialised as a QR rotation (determinant -1 here),
    its log-Jacobian written ``torch.logdet(W)`` instead of ``slogdet``'s logabsdet: NaN at the
    first forward. Beneath the dispatcher logdet is ``where(sign == -1, nan, ...)``, so the aten
    op that makes the NaN is a ``scalar_tensor(nan)`` constant; the report used to name that,
    with the generic 'clamp the input' hint. It names ``aten.logdet``, the negative
    determinant, and slogdet."""
    assert torch.linalg.det(M.make_glow().conv0.weight) < 0  # (QR's rotation, as Glow draws it)
    rep = nanreplay_json(train_glow(tmp_path, "make_glow", steps=4).bundle_path)
    assert origin_of(rep)[:4] == (0, "forward", "conv0", "aten.logdet"), rep["origin"]
    assert rep["cause"] == "invalid" and rep["reproduced"] is True
    src = rep["origin"]["source"]
    assert src.startswith("linalg_models.py:"), src
    assert "torch.logdet(self.weight)" in rep["source_lines"][src], rep["source_lines"]
    hint = rep["hint"]
    assert "determinant is negative (-1)" in hint and "slogdet(W).logabsdet" in hint, hint
    assert "scalar_tensor" not in str(rep) and "clamp_min" not in hint, hint


def _gp_batches(step: int, seed: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's training set; at step K (drawn with ``seed``) it holds one record twice."""
    x = torch.randn(16, 2, generator=torch.Generator().manual_seed(seed if step == K else step))
    if step == K:
        x[5] = x[11]  # the loader drew one record twice
    return x, torch.sin(x).sum(1)


def _train_gp(factory: str, out_dir: Path, seed: int = K):
    model = getattr(M, factory)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=out_dir, factory=f"linalg_models:{factory}"):
            for step in range(6):
                x, y = _gp_batches(step, seed)
                opt.zero_grad()
                model(x, y).backward()
                opt.step()
    return model, info.value


def _fails_at_log(model, x, y, dtype) -> bool:
    """Whether ExactGP's forward (its ops, in its order) in ``dtype`` reaches its log or
    logdet with finite values and makes NaN there, the steps before it finite."""
    ls, noise = (F.softplus(p).to(dtype) for p in (model.raw_lengthscale, model.raw_noise))
    x, y = x.to(dtype), y.to(dtype)
    k = torch.exp(-0.5 * torch.cdist(x / ls, x / ls).pow(2)) + noise * torch.eye(len(x),
                                                                                dtype=dtype)
    try:
        if model.logdet:
            alpha, last = torch.linalg.solve(k, y), torch.logdet(k)
        else:
            chol = torch.linalg.cholesky_ex(k).L
            alpha = torch.cholesky_solve(y.unsqueeze(-1), chol)
            last = chol.diagonal().log()
    except torch.linalg.LinAlgError:
        return False
    return bool(torch.isfinite(alpha).all()) and not bool(torch.isfinite(last).all())


def _failing_seed(factory: str, first: int) -> int:
    """A seed of step K's batch (``first`` if it does) whose repeated record makes the
    model's float32 forward NaN at its log (or logdet), and its float64 one finite, with the
    weights of K steps of the same training: whether rounding leaves a kernel that is singular
    in exact arithmetic a negative pivot, a tiny positive one or an exact 0 is the CPU's
    (seeds K and 12 did on the AMD EPYC, not on an Intel Xeon)."""
    model = getattr(M, factory)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(K):
        x, y = _gp_batches(step)
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    wide = copy.deepcopy(model).double()
    with torch.no_grad():
        for seed in (first, *range(300)):
            x, y = _gp_batches(K, seed)
            if _fails_at_log(model, x, y, torch.float32) and torch.isfinite(
                    wide(x.double(), y.double())):
                return seed
    raise AssertionError("no batch of a repeated record fails at the log in float32 only")


def test_exact_gp_cholesky_ex_of_a_kernel_with_a_repeated_input_is_the_failed_factor(tmp_path):
    """Exact GP regression, the negative log marginal likelihood through ``cholesky_ex`` (no
    error check, no host sync) with a noise of 2e-9, below float32's resolution next to the
    kernel's diagonal of 1: a batch holding one record twice makes K singular in float32, the
    factorisation fails silently, and the factor's diagonal holds the negative pivot, whose log
    is NaN. Float64 factors K fine: ``precision``. The hint used to say 'catastrophic
    cancellation, as in a variance' and recommend torch.var; it names the failed Cholesky, its
    info and the jitter the dtype can hold. The sample is the row of the failed pivot."""
    seed = _failing_seed("make_exact_gp", K)
    model, err = _train_gp("make_exact_gp", tmp_path, seed)

    def failed_pivot(dtype) -> int:
        x, _ = _gp_batches(K, seed)
        with torch.no_grad():
            x, ls, noise = (t.to(dtype) for t in (x, F.softplus(model.raw_lengthscale),
                                                   F.softplus(model.raw_noise)))
            kxx = torch.exp(-0.5 * torch.cdist(x / ls, x / ls) ** 2) + noise * torch.eye(len(x))
            return int(torch.linalg.cholesky_ex(kxx).info) - 1

    # the failed pivot, from the weights the step ran with (the update was not applied)

    pivot = failed_pivot(torch.float32)
    assert pivot >= 0 and failed_pivot(torch.float64) == -1
    rep = nanreplay_json(err.bundle_path)
    assert origin_of(rep) == (K, "forward", "", "aten.log", [pivot], "precision"), rep
    hint = rep["hint"]
    assert "Cholesky factor's diagonal" in hint and "cholesky_ex met a pivot <= 0" in hint, hint
    assert "check info" in hint and "jitter" in hint and "torch.var" not in hint, hint


def test_exact_gp_logdet_of_a_kernel_float32_made_indefinite_is_precision_and_jitter(tmp_path):
    """The textbook GP marginal likelihood, ``solve(K, y)`` and ``torch.logdet(K)``, on a batch
    holding one record twice, with a noise float32 rounds away: K is singular up to rounding,
    float32's LU gives it a determinant of -1e-34 (solve does not notice), and logdet is NaN;
    in float64 it is positive. The report used to name the decomposition's
    ``aten.scalar_tensor``; it names ``aten.logdet`` of a negative determinant, ``precision``,
    and says to keep K positive-definite with a jitter (not torch.var's advice)."""
    _, err = _train_gp("make_exact_gp_logdet", tmp_path, _failing_seed("make_exact_gp_logdet", 12))
    rep = nanreplay_json(err.bundle_path)
    assert origin_of(rep)[:4] == (K, "forward", "", "aten.logdet"), rep["origin"]
    assert rep["cause"] == "precision" and rep["reproduced"] is True, rep
    hint = rep["hint"]
    assert "determinant is negative" in hint and "jitter" in hint, hint
    assert "Cholesky factor" in hint and "torch.var" not in hint, hint


def test_eigh_matrix_sqrt_of_a_singular_covariance_names_the_negative_eigenvalue(tmp_path):
    """A Bures-Wasserstein loss takes the batch covariance's square root through eigh, with
    ``evals.sqrt()`` unclamped. A batch of 5 samples for 8 features (the epoch's last) has a
    singular covariance, whose zero eigenvalues float32 leaves at -3e-9 (float64 at -3e-18):
    ``precision``. The hint used to recommend torch.var and logsigmoid; it names eigh's
    eigenvalue of a singular PSD matrix and the clamp (or eps * I). The values are the
    covariance's eigenvalues, not batch rows: no samples."""
    model = M.make_bures()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.bures_loss, out_dir=tmp_path,
                            factory="linalg_models:make_bures") as rec:
            for step in range(6):
                g = torch.Generator().manual_seed(step)
                x = torch.randn(5 if step == K else 64, M.D_IN, generator=g)
                opt.zero_grad()
                rec.loss_fn(model(x)).backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    assert origin_of(rep) == (K, "forward", "sqrtm", "aten.sqrt", [], "precision"), rep
    hint = rep["hint"]
    assert "eigh's eigenvalue" in hint and "evals.clamp_min(eps)" in hint, hint
    assert "torch.var" not in hint, hint


def test_deep_kernel_gp_under_bf16_autocast_says_the_kernel_was_rounded_to_bf16(tmp_path):
    """Deep kernel learning under bfloat16 autocast: autocast computes the linear kernel
    ``f @ f.T`` in bfloat16, the loop's ``.float()`` and a 1e-4 jitter come after, and the
    matrix (rank 4 for 16 samples) is indefinite by far more than the jitter: cholesky_ex's
    failed pivot is logged at the first step. Float64 (no autocast) factors it: ``precision``.
    The hint used to blame float32 alone ('a jitter float32 can hold, 1e-6'); it says the
    inputs were rounded to bfloat16 under autocast and to compute them in float32."""
    model = M.make_deep_kernel_gp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(16, M.D_IN, generator=torch.Generator().manual_seed(0))
    y = torch.sin(x).sum(1)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        f = model.net(x)
        kxx = (f @ f.T).float() + 1e-4 * torch.eye(16)
    pivot = int(torch.linalg.cholesky_ex(kxx).info) - 1
    assert pivot >= 0
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path,
                            factory="linalg_models:make_deep_kernel_gp"):
            for _ in range(2):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(x, y)
                loss.backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    assert origin_of(rep) == (0, "forward", "", "aten.log", [pivot], "precision"), rep
    hint = rep["hint"]
    assert "Cholesky factor's diagonal" in hint, hint
    assert "ops before it computed in bfloat16 (the step ran under bfloat16 autocast)" in hint
    assert "enabled=False" in hint, hint


def test_newton_schulz_whitening_of_an_unscaled_covariance_is_a_diverging_loop(tmp_path):
    """IterNorm-style whitening by Newton-Schulz iterations, without dividing the covariance by
    its trace first: a batch of unnormalised features (30x the usual scale) gives a spectral
    norm past the iteration's basin, the iterates grow doubly exponentially and an ``mm``
    overflows float32 in the 4th iteration. Float64 holds that one call, so the hint used to
    end at 'or compute it in float64', which only postpones it by an iteration or two; it
    says the op's earlier calls were growing and to scale the matrix so the loop converges."""
    model = M.make_iternorm()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=torch.nn.MSELoss(), out_dir=tmp_path,
                            factory="linalg_models:make_iternorm") as rec:
            for step in range(6):
                x = torch.randn(32, M.D_IN, generator=torch.Generator().manual_seed(step))
                x = x * (9.0 if step == K else 0.3)  # a batch the loader did not normalise
                opt.zero_grad()
                rec.loss_fn(model(x), x.sum(1)).backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    step, phase, module, op, _, cause = origin_of(rep)
    assert (step, phase, module, op, cause) == (K, "forward", "white", "aten.mm", "overflow")
    assert rep["origin"]["all_samples"] is True, rep["origin"]  # (the whole batch's covariance)
    hint = rep["hint"]
    assert "float64 holds it" in hint and "earlier calls here grew from" in hint, hint
    assert "the iterates of a loop were diverging" in hint, hint
    assert "divide it by its trace or Frobenius norm" in hint, hint


def test_conditional_flow_batched_logdet_names_the_samples_with_a_negative_determinant(tmp_path):
    """A conditional linear flow, ``A(c) = I + c W`` per sample, whose log-Jacobian is
    ``torch.logdet(A)`` of the batch of matrices: a batch with two contexts far out flips
    those samples' maps (negative determinants), and only their log-likelihoods are NaN. The
    report names ``aten.logdet`` (not the decomposition's scalar constant) and exactly those
    samples, computed here from the determinants."""
    model = M.make_conditional_flow()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def batch(step):
        g = torch.Generator().manual_seed(step)
        x, c = torch.randn(8, M.C, generator=g), torch.rand(8, generator=g) * 0.2
        if step == K:
            c[[2, 6]] = torch.tensor([-9.0, 7.0])  # contexts far outside the training range
        return x, c

    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.flow_nll, out_dir=tmp_path,
                            factory="linalg_models:make_conditional_flow") as rec:
            for step in range(6):
                opt.zero_grad()
                rec.loss_fn(model(*batch(step))).backward()
                opt.step()
    _, c = batch(K)
    with torch.no_grad():
        dets = torch.linalg.det(model.eye + c[:, None, None] * model.w)
    flipped = (dets < 0).nonzero().flatten().tolist()
    assert flipped and len(flipped) < 8, dets
    rep = nanreplay_json(info.value.bundle_path)
    assert origin_of(rep) == (K, "forward", "", "aten.logdet", flipped, "invalid"), rep
    assert "determinant is negative" in rep["hint"] and "slogdet" in rep["hint"], rep["hint"]


def test_qr_of_learned_directions_that_coincide_is_the_rank_deficient_input(tmp_path):
    """An orthonormal projection made by QR of learned directions: a re-initialisation copies
    one direction onto another, R's diagonal gets a 0 (float32's rounding leaves 5e-7, float64
    1e-15) and QR's backward divides by it: NaN in float32, a finite 1e15-sized gradient in
    float64. The report used to say 'overflow: finite in float64, rescale or compute in
    float64'; it says the input is rank-deficient (invalid), why QR's gradient is infinite
    there, and how to keep the directions independent."""
    model = M.make_ortho_net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=torch.nn.MSELoss(), out_dir=tmp_path,
                            factory="linalg_models:make_ortho_net") as rec:
            for step in range(6):
                x = torch.randn(32, M.D_IN, generator=torch.Generator().manual_seed(step))
                if step == K:  # the loop re-seeds a dead direction from a live one
                    with torch.no_grad():
                        model.proj.dirs[:, 2] = model.proj.dirs[:, 1]
                opt.zero_grad()
                rec.loss_fn(model(x), x.sum(1)).backward()
                opt.step()
    assert info.value.event["phase"] == "backward"
    rep = nanreplay_json(info.value.bundle_path)
    assert origin_of(rep)[:4] == (K, "backward", "proj", "LinalgQrBackward0"), rep["origin"]
    assert rep["cause"] == "invalid" and rep["reproduced"] is True, rep
    hint = rep["hint"]
    assert "divides by the diagonal of its R factor" in hint and "rank-deficient" in hint, hint
    assert "reciprocal of rounding noise" in hint and "compute it in float64" not in hint, hint


def test_batched_eigh_normals_of_a_degenerate_patch_name_that_patch(tmp_path):
    """Point-cloud normals by a batched eigh of each patch's covariance: one patch of the batch
    is a single point scanned 16 times, its covariance 0 and its three eigenvalues equal, so
    eigh's backward makes NaN for that patch only (float64 too). Backward event in
    ``normals``, invalid, the repeated eigenvalues named, and the samples are that patch
    (no existing test names a per-sample matrix of a batched decomposition)."""
    model = M.make_normal_net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    up = torch.tensor([0.0, 0.0, 1.0]).expand(8, 3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.normal_loss, out_dir=tmp_path,
                            factory="linalg_models:make_normal_net") as rec:
            for step in range(6):
                g = torch.Generator().manual_seed(step)
                p = torch.randn(8, 16, 3, generator=g) * torch.tensor([1.0, 1.0, 0.05])
                if step == K:
                    p[5] = p[5, 0]  # a patch of one point scanned again and again
                opt.zero_grad()
                rec.loss_fn(model(p), up).backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    assert origin_of(rep) == (K, "backward", "normals", "LinalgEighBackward0", [5],
                              "invalid"), rep["origin"]
    assert "repeated eigenvalues" in rep["hint"], rep["hint"]


def test_glow_slogdet_of_a_zero_initialised_channel_is_a_singular_weight(tmp_path):
    """Glow written with slogdet, but its second 1x1 convolution's last output channel
    zero-initialised: the weight is singular and its log|det| is -inf at the first forward.
    The report used to say '_linalg_slogdet at a pole or outside its domain: clamp the input'
    and, for the parameter, 'learn its log and use .exp()'; it names the singular matrix and
    how an invertible layer stays invertible, with no per-entry advice for the weight."""
    rep = nanreplay_json(train_glow(tmp_path, "make_glow_zero_channel", steps=3).bundle_path)
    assert origin_of(rep)[:4] == (0, "forward", "conv1", "aten._linalg_slogdet"), rep["origin"]
    assert rep["cause"] == "invalid" and rep["origin"]["made"] == "-inf", rep
    hint = rep["hint"]
    assert "of a singular matrix" in hint and "parametrised to stay invertible" in hint, hint
    assert "learn its log" not in hint and "clamp_min" not in hint, hint


@pytest.mark.parametrize("loss_kind", ["module", "function"])
def test_cholesky_in_a_user_loss_on_the_short_last_batch_is_a_loss_event(tmp_path, loss_kind):
    """A multi-output regression whose loss (a module, or a plain function the recorder
    wraps) factors the residuals' covariance: the epoch's last batch has one row, the 3x3
    covariance has rank 1 and Cholesky raises. The recorder used to file the raise as a
    forward event although no module of the model was running; it is the loss's, as the
    replay's origin says, and the cause is the rank-deficient (invalid) matrix."""
    model = M.make_multi_output()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_fn = M.ResidualCovarianceNLL() if loss_kind == "module" else M.residual_covariance_nll
    data = torch.randn(3 * 16 + 1, M.D_IN, generator=torch.Generator().manual_seed(0))
    target = data @ torch.randn(M.D_IN, 3, generator=torch.Generator().manual_seed(1))
    with pytest.raises(torch.linalg.LinAlgError) as info:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=tmp_path,
                            factory="linalg_models:make_multi_output") as rec:
            for x, y in zip(data.split(16), target.split(16)):  # the last batch: one row
                opt.zero_grad()
                rec.loss_fn(model(x), y).backward()
                opt.step()
    assert "a matrix decomposition failed at step 3" in "".join(info.value.__notes__)
    bundle = next(Path(tmp_path).glob("*.nan"))
    rep = nanreplay_json(bundle)
    assert rep["event"]["phase"] == "loss", rep["event"]
    assert origin_of(rep)[:4] == (3, "loss", "<loss>", "aten.linalg_cholesky_ex"), rep["origin"]
    assert rep["cause"] == "invalid" and rep["reproduced"] is True, rep
    assert "not positive-definite in exact arithmetic too" in rep["hint"], rep["hint"]
