"""End to end on hand-written neural processes (``neural_processes_models``): a CNP with the
masked mean over padded context sets, the latent NP's ELBO with a closed-form Gaussian KL, the
ANP's masked cross-attention, an off-the-grid ConvCNP's SetConv, and a Gaussian NP's joint
predictive (Cholesky in the loss), meta-trained on GP functions from a ``Dataset`` through a
``DataLoader`` whose ``collate`` pads each batch's context and target sets. Each planted bug of
the domain fires under the recorder and is replayed with the CLI; the healthy versions raise
no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import neural_processes_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

BAD_TASK, BAD_STEP, BAD_ROW = 19, 2, 3  # task 19 is row 3 of the third batch of 8


def line_of(text: str) -> str:
    return source_line("neural_processes_models.py", text)


def step_args(kind: str, batch):
    """(model args, loss args after the model's outputs) of one padded batch."""
    x_c, y_c, m_c, x_t, y_t, m_t = batch
    if kind == "latent":
        return (x_c, y_c, m_c, x_t, y_t, m_t), (y_t, m_t)
    if kind == "gnp":
        return (x_c, y_c, m_c, x_t, m_t), (y_t, m_t)
    return (x_c, y_c, m_c, x_t), (y_t, m_t)


LOSSES = {"latent": M.elbo_loss, "gnp": M.gnp_loss}


def train(kind: str, make: str, out_dir, steps: int = 4, record: bool = True, **data):
    """Adam with a cosine schedule and gradient clipping over a DataLoader of GP tasks, as the
    NP family's meta-training loops run. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    crit = LOSSES.get(kind, M.gaussian_nll)
    loader = torch.utils.data.DataLoader(M.GPTasks(8 * steps, seed=0, **data), batch_size=8,
                                         collate_fn=M.collate)
    torch.manual_seed(1)  # (the latent NP's reparameterisation)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"neural_processes_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for batch in loader:
            args, targets = step_args(kind, batch)
            loss = loss_fn(*model(*args), *targets)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(kind: str, make: str, tmp_path, **data):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, tmp_path, **data)
    return info.value.event, info.value.bundle_path


def first_batch():
    """The first padded batch of every run (step 0's)."""
    loader = torch.utils.data.DataLoader(M.GPTasks(8, seed=0), batch_size=8,
                                         collate_fn=M.collate)
    return next(iter(loader))


def test_cnp_task_without_context_names_the_masked_mean_and_its_task(tmp_path):
    """A task whose context set is empty: the masked mean's ``sum / count`` is 0/0 in its row.
    The report names the division on the masked mean's line, in the CNP's own code, that task
    only, and says to guard the denominator."""
    ev, bundle = fire("cnp", "make_cnp", tmp_path, empty=BAD_TASK)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        BAD_STEP, "forward", "", [BAD_ROW]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.div", "nan", [BAD_ROW]), o
    assert o["source"] == line_of("mask.sum(1, keepdim=True)  # the bug"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "clamp_min(eps)" in rep["hint"], rep["hint"]


def test_anp_task_without_context_names_the_fully_masked_attention_row(tmp_path):
    """The same empty task in the ANP: every key of its cross-attention is padding, the softmax
    row is all -inf. The report names ``_softmax`` in ``cross``, the task, the intentional
    -inf fill before it, and the key_padding_mask all True in that task."""
    ev, bundle = fire("anp", "make_anp", tmp_path, empty=BAD_TASK)
    assert (ev["step"], ev["module"], ev["samples"]) == (BAD_STEP, "cross", [BAD_ROW]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("cross", "aten._softmax", [BAD_ROW]), o
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]
    assert "keep at least one key per row" in rep["hint"], rep["hint"]
    assert f"key_padding_mask is True (masked) at every position of samples [{BAD_ROW}]" in (
        rep["hint"]), rep["hint"]


def test_anp_where_after_the_attention_still_fires_at_the_softmax(tmp_path):
    """Zeroing the context-less task's r with ``torch.where`` after the attention keeps the
    loss finite, but the softmax's NaN still reaches the weights through its backward (an
    unrecorded run ends with NaN weights). The recorder stops at the attention's output and the
    replay names the same softmax row."""
    model = train("anp", "make_anp_where", tmp_path, record=False, empty=BAD_TASK)
    assert not all(torch.isfinite(p).all() for p in model.parameters())
    ev, bundle = fire("anp", "make_anp_where", tmp_path, empty=BAD_TASK)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (
        BAD_STEP, "forward", "cross", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("cross", "aten._softmax", [BAD_ROW]), o
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]


def test_latent_np_kl_of_underflowed_scales_names_the_zero_floor_and_the_unit_error(tmp_path):
    """A latent NP whose z scale is ``floor + (1 - floor) * sigmoid(.)`` with the floor set to
    0, and one task whose x are in milliseconds: both scales of that task underflow to 0 and the
    KL's ``log(sp / sq)`` is 0/0. The report names the division on the KL's line, the task, an
    underflow, the floor as an eps of exactly 0, and the task's out-of-scale input."""
    ev, bundle = fire("latent", "make_latent_no_floor", tmp_path, big=BAD_TASK)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        BAD_STEP, "forward", "", [BAD_ROW]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "", "aten.div", "nan", [BAD_ROW]), o
    assert o["source"] == line_of("torch.log(sp / sq)"), o
    assert rep["cause"] == "underflow", rep["cause"]
    assert "the eps added to that input is exactly 0" in rep["hint"], rep["hint"]
    assert f"sample(s) {BAD_ROW} of args[0]" in rep["hint"], rep["hint"]
    assert f"--try drop={BAD_ROW}" in rep["hint"], rep["hint"]


def test_cnp_sigma_without_floor_names_the_gaussian_nll_backward(tmp_path):
    """``sigma = softplus(.)`` without the 0.1 floor, and a task in milliseconds: its sigma is
    tiny (not 0), the loss is finite but huge, and the Gaussian NLL's ``(y - mu)^2 / sigma^2``
    overflows in backward. The report names the division's backward in the loss, on the
    log_prob line, the task, an overflow of a softplus-made denominator, and the unit error."""
    ev, bundle = fire("cnp", "make_cnp_no_floor", tmp_path, big=BAD_TASK)
    assert (ev["step"], ev["phase"]) == (BAD_STEP, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == (
        "backward", "<loss>", "DivBackward0", [BAD_ROW]), o
    assert o["source"] == line_of(".log_prob(y_t)"), o
    assert rep["cause"] == "overflow", rep["cause"]
    assert "softplus" in rep["hint"] and "clamp_min(eps)" in rep["hint"], rep["hint"]
    assert f"--try drop={BAD_ROW}" in rep["hint"], rep["hint"]


def empty_density_rows() -> list[int]:
    """The tasks of the first batch with a grid point no context point's RBF reaches in
    float32 (the SetConv's density 0 there), counted on an unrecorded model."""
    x_c, y_c, m_c, *_ = first_batch()
    with torch.no_grad():
        density = M.make_convcnp().encoder(x_c, y_c, m_c)[:, 0]
    return torch.nonzero((density == 0).any(1)).flatten().tolist()


def test_convcnp_setconv_without_eps_names_the_density_normalisation(tmp_path):
    """ConvCNP's SetConv divides the signal channel by the density channel; with eps 0 the
    density of a grid point far from every context point underflows to 0 and the division is
    0/0 at step 0. The report names the division in ``encoder``, exactly the tasks whose
    density is 0 somewhere (counted independently), an underflow and the eps of 0."""
    rows = empty_density_rows()
    assert rows and len(rows) < 8, rows
    ev, bundle = fire("cnp", "make_convcnp", tmp_path)
    assert (ev["step"], ev["module"], ev["samples"]) == (0, "encoder", rows), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("encoder", "aten.div", rows), o
    assert o["source"] == line_of("signal / (density + self.eps)"), o
    assert rep["cause"] == "underflow", rep["cause"]
    assert "the eps added to that input is exactly 0" in rep["hint"], rep["hint"]


def test_gnp_low_rank_covariance_without_noise_names_the_cholesky_and_its_tasks(tmp_path):
    """A Gaussian NP whose predictive covariance is ``f f^T / k`` without its noise term: a
    task with more targets than k features has a singular covariance and the loss's Cholesky
    raises. The report names the Cholesky in the loss, the tasks whose factorisation fails
    (checked with ``cholesky_ex`` on an unrecorded copy), and a ridge as the fix."""
    mu, cov = M.make_gnp()(*step_args("gnp", first_batch())[0])
    rows = torch.nonzero(torch.linalg.cholesky_ex(cov.detach()).info).flatten().tolist()
    assert rows and len(rows) < 8, rows
    with pytest.raises(torch.linalg.LinAlgError):  # (the recorder lets the exception through)
        train("gnp", "make_gnp", tmp_path)
    bundle = next(tmp_path.glob("*.nan"))
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], o["module"], o["op"], o["samples"]) == (
        0, "<loss>", "aten.linalg_cholesky_ex", rows), o
    assert o["source"] == line_of("chol = torch.linalg.cholesky(cov)"), o
    assert rep["cause"] == "invalid" and "add a ridge to the diagonal" in rep["hint"], rep


@pytest.mark.parametrize("kind,make,data", [
    ("cnp", "make_cnp_clamped", {"empty": BAD_TASK}),
    ("latent", "make_latent", {"big": BAD_TASK}),
    ("anp", "make_anp", {}),
    ("cnp", "make_convcnp_eps", {}),
])
def test_guarded_neural_processes_raise_nothing_and_train_the_same(tmp_path, kind, make, data):
    """The guarded versions on the same data (an empty context set under a clamped count, the
    floored latent scale on the task in milliseconds, the ANP's padded contexts whose -inf
    masks stay inside the softmax, the SetConv with eps): no event, and the weights are
    bit-identical with and without the recorder."""
    recorded = train(kind, make, tmp_path, **data)
    plain = train(kind, make, tmp_path, record=False, **data)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.isfinite(a).all() and torch.equal(a, b), name


def test_latent_np_normal_refusing_a_zero_scale_names_the_sigmoid_that_made_it(tmp_path):
    """The same zero floor with the latent path as ``torch.distributions.Normal`` objects:
    ``Normal`` refuses the task's scale of 0. The 0 was made by ``sigmoid`` (its input, from
    the task in milliseconds, is far below -88), not by the ``mul`` and ``add`` of the floor
    after it, which only passed it on: the report names the sigmoid, the task, an underflow, a
    floor as the fix, and the unit error."""
    with pytest.raises(ValueError):
        train("latent", "make_latent_dist_no_floor", tmp_path, big=BAD_TASK)
    rep = nanreplay_json(next(tmp_path.glob("*.nan")))
    o = rep["origin"]
    assert (rep["event"]["step"], o["module"], o["op"], o["made"], o["samples"]) == (
        BAD_STEP, "latent", "aten.sigmoid", "0", [BAD_ROW]), o
    assert o["source"] == line_of("(1 - self.floor) * torch.sigmoid(raw)"), o
    assert rep["cause"] == "underflow" and "add a floor" in rep["hint"], rep["hint"]
    assert f"--try drop={BAD_ROW}" in rep["hint"], rep["hint"]


def test_latent_np_task_without_targets_names_the_per_task_mean_of_the_nll(tmp_path):
    """A task whose every point was drawn into the context: its target mask is all 0 and the
    NLL's per-task mean ``sum / count`` is 0/0 in the loss (the model output is finite). The
    report names the loss's division on its line, that task, and a guard of the count."""
    ev, bundle = fire("latent", "make_latent", tmp_path, full=BAD_TASK)
    assert (ev["step"], ev["phase"], ev["module"]) == (BAD_STEP, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == (
        "loss", "<loss>", "aten.div", [BAD_ROW]), o
    assert o["source"] == line_of("(ll * mask_t).sum(1) / mask_t.sum(1)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]


def train_accumulated(out_dir, make: str, **data):
    """bf16 autocast on CPU, two micro-batches of 4 tasks accumulated per AdamW step."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(M.GPTasks(32, seed=0, **data), batch_size=4,
                                         collate_fn=M.collate)
    with FlightRecorder(model, opt, loss_fn=M.gaussian_nll, out_dir=out_dir,
                        factory=f"neural_processes_models:{make}") as rec:
        for i, (x_c, y_c, m_c, x_t, y_t, m_t) in enumerate(loader):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                mu, sigma = model(x_c, y_c, m_c, x_t)
            (rec.loss_fn(mu.float(), sigma.float(), y_t, m_t) / 2).backward()
            if i % 2 == 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()


def test_anp_under_bf16_accumulation_names_the_micro_batch_of_the_empty_task(tmp_path):
    """The ANP's empty task under bf16 autocast with two accumulated micro-batches of 4: task
    19 is row 3 of the first micro-batch of step 2. The event and the report say so."""
    with pytest.raises(NonFiniteError) as info:
        train_accumulated(tmp_path, "make_anp", empty=BAD_TASK)
    ev = info.value.event
    # (the event's rows are the model output's: [3] on the AMD EPYC; on an Intel Xeon the
    # decoder's bf16 matmuls carry row 3's NaN into row 2 of the output too, [2, 3]; the
    # replay's origin, the cross-attention's softmax, is row 3 on both)
    assert (ev["step"], ev["micro_batch"], ev["module"]) == (2, 0, "cross"), ev
    assert ev["samples"] in ([3], [2, 3]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["micro_batch"], o["module"], o["op"], o["samples"]) == (
        0, "cross", "aten._softmax", [3]), o
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]


def test_anp_under_bf16_accumulation_with_padded_contexts_raises_nothing(tmp_path):
    """Every task with a context: the -inf of the padded keys stays inside the bf16 softmax
    under accumulation, and no event is raised."""
    train_accumulated(tmp_path, "make_anp")
    assert not list(tmp_path.glob("*.nan"))


def test_latent_np_logvar_kl_names_the_exp_overflow_before_the_nan(tmp_path):
    """The latent NP in log-variance with the task in milliseconds: the log-variances reach
    ~160, ``exp`` overflows in both the numerator and the denominator of the KL, and their
    ratio is NaN. The report names the exp (the +inf it made, then the div's NaN), the task,
    an overflow, a bound on the learned exponent, and the unit error."""
    ev, bundle = fire("latent", "make_latent_logvar", tmp_path, big=BAD_TASK)
    assert (ev["step"], ev["module"], ev["samples"]) == (BAD_STEP, "", [BAD_ROW]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "", "aten.exp", "+inf", [BAD_ROW]), o
    assert o["source"] == line_of("(lq.exp() + (mq - mp) ** 2) / lp.exp()"), o
    assert rep["cause"] == "overflow" and "bound a learned exponent" in rep["hint"], rep
    assert f"--try drop={BAD_ROW}" in rep["hint"], rep["hint"]
