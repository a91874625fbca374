"""End to end: deep supervised hashing (HashNet's scaled tanh, DPSH's pairwise likelihood,
GreedyHash's straight-through sign, DSH's contrastive loss, central similarity with Hadamard
centres) written as their repositories write them (``deep_hashing_models``), trained under the
recorder until a planted bug fires, then replayed with the CLI."""

from __future__ import annotations

import functools

import deep_hashing_models as M
import pytest
import torch
from bundles import invoke_cli, nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("deep_hashing_models.py", text)


def codes_loss(loss_fn, model, x, y):
    return loss_fn(model(x), y)


def beta_loss(loss_fn, model, x, y):  # a loss given the hash layer's current scale
    return loss_fn(model(x), y, model.hash_layer.beta)


def centre_loss(loss_fn, model, x, y):
    return loss_fn(model(x, y))


def train(out_dir, factory: str, loss_fn, call=codes_loss, n: int = 32, scale: float = 1.0,
          epochs: int = 3, beta=None, nan_row: int | None = None,
          dup: tuple[int, int] | None = None, adam_eps: float = 1e-8, accum: int = 1,
          amp: bool = False, record: bool = True):
    """HashNet's loop: ``beta`` (a function of the epoch) grows the hash layer's scale at each
    epoch's start; gradients clipped as DeepHash-pytorch's trainers do; ``accum`` micro-batches
    a step, each under bfloat16 autocast with ``amp``. ``scale``: the pixels not divided by
    255 (255); ``nan_row``: a corrupted record; ``dup``: a record duplicated."""
    model = getattr(M, factory)()
    X, Y = M.images(torch.Generator().manual_seed(0), n, scale)
    if nan_row is not None:
        X[nan_row, 3] = float("nan")
    if dup is not None:
        X[dup[1]], Y[dup[1]] = X[dup[0]], Y[dup[0]]
    loader = DataLoader(TensorDataset(X, Y), batch_size=M.BATCH // accum)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=adam_eps)
    rec = FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                         factory=f"deep_hashing_models:{factory}") if record else None
    with rec or torch.enable_grad():
        loss_fn = rec.loss_fn if rec else loss_fn
        for epoch in range(epochs):
            if beta is not None:
                model.hash_layer.beta = beta(epoch)
            for i, (x, y) in enumerate(loader):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    loss = call(loss_fn, model, x, y) / accum
                loss.backward()
                if (i + 1) % accum == 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
                    opt.step()
                    opt.zero_grad()
    return model


def replayed(tmp_path, factory: str, loss_fn, step: int, phase: str, code: int = 0,
             **kw) -> dict:
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, factory, loss_fn, **kw)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (step, phase), err.event
    return nanreplay_json(err.bundle_path, code=code)


def test_healthy_hashnet_has_no_event_and_trains_bit_identically(tmp_path):
    # the balanced pairwise loss over 32 records in batches of 8 (every batch holds similar and
    # dissimilar pairs), beta growing by HashNet's schedule
    grow = functools.partial(pow, 2.0)
    bare = train(tmp_path, "make_hashnet", M.hashnet_balanced_loss, beta=grow, record=False)
    recorded = train(tmp_path, "make_hashnet", M.hashnet_balanced_loss, beta=grow)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(bare.state_dict().items(), recorded.state_dict().values()):
        assert torch.equal(a, b), name
    assert all(torch.isfinite(p).all() for p in recorded.parameters())


def test_unscaled_pixels_overflow_dpsh_likelihoods_exp(tmp_path):
    # pixels left in [0, 255]: GreedyHash's relaxed codes are in the hundreds, and DPSH's
    # log(1 + exp(theta)) of their inner products overflows at the first step
    rep = replayed(tmp_path, "make_greedy", M.greedy_pairwise_loss, 0, "loss", scale=255.0)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "overflow", "<loss>", "aten.exp", list(range(8))), rep
    assert o["source"] == line_of("return F.cross_entropy(logits, y.argmax(1)) + (torch.log"), o
    assert "F.softplus(z)" in rep["hint"], rep["hint"]


def test_log_of_an_underflowed_sigmoid_of_saturated_codes(tmp_path):
    # beta grows 1, 4, 16, 64: at the last epoch the codes are +-1, alpha * <u, u> is 160 and
    # sigmoid(-160) underflows to 0 on the diagonal; log(0) is -inf, times (1 - S) = 0
    loss = functools.partial(M.hashnet_loss, alpha=10.0, symmetric=True)
    rep = replayed(tmp_path, "make_hashnet", loss, 12, "loss", epochs=4,
                   beta=lambda e: 4.0 ** e)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "underflow", "<loss>", "aten.log", list(range(8))), rep
    assert o["source"] == line_of("nll = -(S * torch.log(p) + (1 - S) * torch.log(q))"), o
    assert "below float32's smallest normal" in rep["hint"] and "logsigmoid" in rep["hint"]


def test_batch_without_a_similar_pair_is_a_zero_count_not_a_sample(tmp_path):
    # 20 records in batches of 8: the last batch holds one record of each of the 4 classes, so
    # no pair i != j is similar and the similar pairs' mean is 0 / 0
    rep = replayed(tmp_path, "make_hashnet", M.hashnet_balanced_loss, 2, "loss", n=20)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "<loss>", "aten.div", []), rep
    assert o["source"] == line_of("return (nll * S).sum() / S.sum()"), o
    assert "clamp_min(1)" in rep["hint"] and "no row is to blame" in rep["hint"], rep["hint"]


def test_atanh_of_a_tanh_that_beta_saturated(tmp_path):
    # the continuation loss reads the pre-activation back as atanh(u) / beta; at beta = 64
    # tanh rounds to exactly +-1 in float32 and atanh is infinite (float64: 0.99999999)
    rep = replayed(tmp_path, "make_hashnet", M.quantization_atanh_loss, 12, "loss",
                   call=beta_loss, epochs=4, beta=lambda e: 4.0 ** e)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "precision", "<loss>", "aten.atanh", [1, 2, 3, 4, 5, 6, 7]), rep
    assert o["source"] == line_of("z = torch.atanh(u) / beta"), o
    assert "x.clamp(-1 + 1e-5, 1 - 1e-5)" in rep["hint"] and "bfloat16" not in rep["hint"]


def test_atanh_under_bfloat16_autocast_names_an_eps_bfloat16_resolves(tmp_path):
    # the same loss under bfloat16 autocast with two micro-batches a step: tanh rounds to 1
    # from beta * x of about 3; the float32 clamp the advice gives is 1 in bfloat16
    rep = replayed(tmp_path, "make_hashnet", M.quantization_atanh_loss, 8, "loss",
                   call=beta_loss, epochs=4, beta=lambda e: 4.0 ** e, accum=2, amp=True)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "precision", "<loss>", "aten.atanh", [3]), rep
    assert (o["micro_batch"], o["dtype"]) == (0, "bfloat16"), o
    hint = rep["hint"]
    # (was: only "x.clamp(-1 + 1e-5, 1 - 1e-5) in float32", which is atanh(1) in bfloat16)
    assert "ran in bfloat16, whose nearest number below 1 is 0.996094" in hint, hint
    assert "x.clamp(-1 + 0.008, 1 - 0.008)" in hint and "x.float()" in hint, hint


def test_bit_decorrelation_of_a_saturated_bit_is_rounding_not_cancellation(tmp_path):
    # beta 4, 16, 64: a bit is -1 in every row of a batch in float32 (float64 keeps it apart by
    # 1e-10), its std over the batch is 0 and the standardised bits' (u - mean) / std is 0/0
    rep = replayed(tmp_path, "make_hashnet", M.decorrelated_loss, 8, "loss", epochs=4,
                   beta=lambda e: 4.0 ** (e + 1))
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "precision", "<loss>", "aten.div", list(range(8))), rep
    assert o["source"] == line_of("z = (u - u.mean(0)) / u.std(0)"), o
    hint = rep["hint"]
    # (was: "catastrophic cancellation ... use torch.var / torch.std", which the code used)
    assert "same column(s) [1]" in hint and "saturated to exactly ±1" in hint, hint
    assert "z.std(0) + eps" in hint and "cancellation" not in hint, hint


def test_duplicate_record_under_dsh_euclidean_distance_is_a_backward_nan(tmp_path):
    # record 5 duplicates record 1: their distance is sqrt(0), finite, but its derivative is
    # infinite and the zero incoming gradient makes it NaN in backward only
    rep = replayed(tmp_path, "make_hashnet", M.dsh_loss, 0, "backward", dup=(1, 5))
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "<loss>", "SqrtBackward0", [1, 5]), rep
    assert o["source"] == line_of("dist = ((u[i] - u[j]) ** 2).sum(1).sqrt()"), o
    assert "vector_norm" in rep["hint"], rep["hint"]


def test_corrupted_record_is_an_input_event_of_its_sample(tmp_path):
    rep = replayed(tmp_path, "make_hashnet", M.hashnet_balanced_loss, 1, "input", nan_row=13)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["tensor"], o["samples"]) == (
        True, "input", "batch", [5]), rep
    assert "sample 5 at feature(s) 3" in rep["hint"], rep["hint"]


def test_corrupted_record_in_the_second_micro_batch_says_which_micro_batch(tmp_path):
    # GreedyHash in two micro-batches of 4 a step (pairs within a micro-batch of 4 would
    # hold no similar one): record 13 is row 1 of step 1's second micro-batch
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_greedy", M.greedy_loss, nan_row=13, accum=2)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (1, "input"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["micro_batch"], o["samples"]) == ("input", 1, [1]), rep
    lines = invoke_cli(err.bundle_path).stdout.splitlines()
    # (was: "made by the input batch" and "samples [1]": row 1 of which micro-batch?)
    assert lines[1:3] == ["  origin     input: nan made by the input batch, micro-batch 1",
                          "  samples    [1]"], lines


def test_learned_centres_of_absent_classes_under_adam_eps_0(tmp_path):
    # central similarity with learned Hadamard centres: CSQ's BCE reaches only the centres of
    # the batch's classes; Adam(eps=0) divides the others' 0 moments by 0 at its first update
    # (not re-run: the bundle holds the weights after the update, so exit code 1)
    rep = replayed(tmp_path, "make_centre_hash", M.csq_loss, 0, "optimizer", code=1,
                   call=centre_loss, adam_eps=0.0)
    assert (rep["reproduced"], rep["cause"], rep["origin"]["samples"]) == (
        False, "optimizer", []), rep
    assert "centres" in rep["hint"] and "set eps > 0" in rep["hint"], rep["hint"]


def test_bit_balance_entropy_of_a_saturated_bit_is_a_rounded_mean_of_tanh(tmp_path):
    # the fraction of +1s of a bit, (1 + u.mean(0)) / 2, is inside (0, 1) for tanh codes in
    # exact arithmetic; a bit rounded to -1 in every row makes it 0, and log(p) -inf. The
    # entropy is per bit: no sample
    rep = replayed(tmp_path, "make_hashnet", M.entropy_balanced_loss, 8, "loss", epochs=4,
                   beta=lambda e: 4.0 ** (e + 1))
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "precision", "<loss>", "aten.log", []), rep
    assert o["source"] == line_of("entropy = -(p * torch.log(p) + (1 - p) * torch.log(1 - p))")
    hint = rep["hint"]
    # (was: "catastrophic cancellation, as in a variance E[x²] − E[x]²": no variance there)
    assert "a mean of such values" in hint and "rounded to 1 in float32" in hint, hint
    assert "cancellation" not in hint, hint


def test_dpsh_code_bank_read_before_its_rows_are_written_names_the_bank(tmp_path):
    # DPSH scores the batch against the bank of every record's code; made with NaN for "not
    # seen" (as torch.empty's garbage may be), the rows of the batches not yet seen are NaN
    model = M.make_hashnet()
    X, Y = M.images(torch.Generator().manual_seed(0), 32)
    U = torch.full((32, M.BITS), float("nan"))
    loader = DataLoader(TensorDataset(X, Y, torch.arange(32)), batch_size=M.BATCH)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with pytest.raises(NonFiniteError) as info, FlightRecorder(
            model, opt, loss_fn=M.dpsh_bank_loss, out_dir=tmp_path,
            factory="deep_hashing_models:make_hashnet") as rec:
        for x, y, idx in loader:
            u = model(x)
            U[idx] = u.detach()
            loss = rec.loss_fn(u, y, U, Y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (0, "input"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["tensor"], o["samples"]) == (
        True, "input", "loss_args[2]", []), rep
    hint = rep["hint"]
    # (was: "the loop sliced or rearranged the output ... a sharpened guess p ** (1 / T)")
    assert "a row per record of the data set, not per sample of the batch of 8" in hint, hint
    assert "[8, 9, 10, 11, 12, 13, 14, 15, '...'] NaN in every entry and the other 8" in hint
    assert "torch.zeros" in hint and "sharpen" not in hint, hint


def test_cauchy_distance_of_each_code_to_itself_names_the_diagonal(tmp_path):
    # DCH over every pair of the batch: a code's cosine with itself rounds above 1, its
    # Hamming distance bits / 2 * (1 - cos) is -5e-8 on the diagonal, and log(d / gamma) NaN
    # (which diagonal entries round below 0, and which to exactly 0, is the CPU's matmul's
    # rounding: here all 8 below; a 0 would be log's pole, invalid, with the same advice)
    rep = replayed(tmp_path, "make_hashnet", M.dch_loss, 0, "loss")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"]) == (True, "<loss>", "aten.log"), rep
    assert o["samples"] and set(o["samples"]) <= set(range(8)), o
    assert o["source"] == line_of("cauchy = S * torch.log(d / gamma)"), o
    hint = rep["hint"]
    if rep["cause"] == "precision":  # (was: the cancelled difference alone, "clamp the
        # difference at 0 before the op", which keeps log(0) of the self-pairs)
        assert "1 − cos(u_i, u_j) of a code with itself" in hint, hint
    assert rep["cause"] in ("precision", "invalid"), rep
    assert "exactly the diagonal of a square pairwise matrix" in hint, hint
    assert "paired with itself" in hint and "triu_indices" in hint, hint


def test_dpsh_loss_holding_its_bank_names_the_rows_not_yet_written(tmp_path):
    # DeepHash-pytorch's DPSHLoss keeps the bank itself and writes the batch's rows in forward;
    # made with NaN for "not seen", the rows of later batches are NaN at the first step
    model = M.make_hashnet()
    X, Y = M.images(torch.Generator().manual_seed(0), 32)
    criterion = M.DPSHLoss(32, fill=float("nan"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(TensorDataset(X, Y, torch.arange(32)), batch_size=M.BATCH)
    with pytest.raises(NonFiniteError) as info, FlightRecorder(
            model, opt, loss_fn=criterion, out_dir=tmp_path,
            factory="deep_hashing_models:make_hashnet"):
        for x, y, idx in loader:
            loss = criterion(model(x), y, idx)
            opt.zero_grad()
            loss.backward()
            opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (0, "loss"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "weights", "<loss>", "aten.index_put_", []), rep
    assert o["source"] == line_of("self.U[ind] = u.data"), o
    hint = rep["hint"]
    # (was: "a value made before the step (class weights 1/count with a class absent ...)")
    assert "writes rows of the loss's 'U' (shape (32, 16))" in hint, hint
    assert "24 of its 32 rows are NaN in every entry ([8, 9, 10, 11, 12, 13, 14, 15, '...'])" \
        in hint and "torch.zeros(num_train, bit)" in hint and "class weights" not in hint, hint


def test_hashnet_weighting_by_boolean_index_has_no_event_without_similar_pairs(tmp_path):
    # DeepHash-pytorch's in-place reweighting touches no element when a batch has no similar
    # pair (S / S1 is inf, times an empty selection): the same last batch as above trains on
    model = train(tmp_path, "make_hashnet", M.hashnet_dh_loss, n=20)
    assert not list(tmp_path.glob("*.nan"))
    assert all(torch.isfinite(p).all() for p in model.parameters())
