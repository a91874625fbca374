"""End to end on ports of Andrej Karpathy's training code (``karpathy_repos_models``):
nanoGPT's ``train.py`` loop (``get_lr``'s cosine schedule set on each ``param_group`` by hand,
gradient accumulation with ``loss / accum``, the next batch fetched before the backward,
``GradScaler(enabled=dtype == 'float16')``, ``clip_grad_norm_`` after ``scaler.unscale_``,
``estimate_loss`` under ``torch.no_grad`` with ``model.eval()`` at iteration 0 and every
``eval_interval``), makemore's loop (an ``InfiniteDataLoader`` with worker processes,
``evaluate`` under ``torch.inference_mode``) and the bigram lecture's hand-written softmax
and negative log-likelihood. Each planted bug fires under the recorder and is replayed with
the CLI; the healthy runs raise no event and train bit-identically with and without it."""

from __future__ import annotations

import contextlib
import math

import karpathy_repos_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("karpathy_repos_models.py", text)


def get_lr(it, learning_rate=6e-4, warmup_iters=2, lr_decay_iters=8, min_lr=6e-5):
    """nanoGPT's ``get_lr``: linear warmup, cosine decay to ``min_lr``."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def nanogpt(make, out_dir, dtype="float32", steps=4, accum=2, eps=1e-8, record=True,
            poison=None, checkpoint=None, eval_interval=2, global_rng=False):
    """nanoGPT's ``train.py``. ``poison(it, micro, Y)`` edits the targets fetched for the next
    micro-batch; ``checkpoint(state_dict)`` is what ``init_from='resume'`` loads;
    ``global_rng``: ``get_batch`` draws from the global RNG, as nanoGPT's does, between a
    micro-batch's forward (its dropout) and the next one's."""
    torch.manual_seed(1337)
    model = getattr(M, make)()
    if checkpoint is not None:
        model.load_state_dict(checkpoint(model.state_dict()))
    scaler = torch.amp.GradScaler("cpu", enabled=(dtype == "float16"))
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cpu", eps=eps)
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
               "float16": torch.float16}[dtype]
    ctx = contextlib.nullcontext() if dtype == "float32" else \
        torch.autocast("cpu", dtype=ptdtype)
    data, g = M.token_stream(), None if global_rng else torch.Generator().manual_seed(0)

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        losses = torch.zeros(2)
        for k in range(2):
            X, Y = M.get_batch(data, g)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
        model.train()
        return losses.mean()

    rec = FlightRecorder(model, optimizer, out_dir=out_dir, scaler=scaler,
                         factory=f"karpathy_repos_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        X, Y = M.get_batch(data, g)  # fetch the very first batch
        for it in range(steps):
            for param_group in optimizer.param_groups:
                param_group["lr"] = get_lr(it)
            if eval_interval and it % eval_interval == 0:
                estimate_loss()
            for micro_step in range(accum):
                with ctx:
                    logits, loss = model(X, Y)
                    loss = loss / accum
                # immediately async prefetch next batch while model is doing the forward pass
                X, Y = M.get_batch(data, g)
                if poison is not None:
                    Y = poison(it, micro_step, Y)
                scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    return model


class InfiniteDataLoader:
    """makemore's: a ``DataLoader`` over a sampler with replacement, restarted when done."""

    def __init__(self, dataset, **kwargs):
        sampler = torch.utils.data.RandomSampler(dataset, replacement=True,
                                                 num_samples=int(1e10))
        self.train_loader = torch.utils.data.DataLoader(dataset, sampler=sampler, **kwargs)
        self.data_iter = iter(self.train_loader)

    def next(self):
        try:
            batch = next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.train_loader)
            batch = next(self.data_iter)
        return batch


def makemore(make, out_dir, learning_rate=5e-4, steps=8, workers=0, record=True):
    """makemore's main loop: AdamW(weight_decay=0.01, betas=(0.9, 0.99)), ``evaluate``
    under ``torch.inference_mode`` every 4 steps."""
    torch.manual_seed(3407)
    model = getattr(M, make)()
    dataset = M.char_dataset()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.01,
                                  betas=(0.9, 0.99), eps=1e-8)
    loader = InfiniteDataLoader(dataset, batch_size=8, num_workers=workers,
                                generator=torch.Generator().manual_seed(0))

    @torch.inference_mode()
    def evaluate(max_batches=2):
        model.eval()
        dl = torch.utils.data.DataLoader(dataset, batch_size=8, num_workers=0)
        losses = []
        for i, (X, Y) in enumerate(dl):
            logits, loss = model(X, Y)
            losses.append(loss.item())
            if i + 1 >= max_batches:
                break
        model.train()
        return torch.tensor(losses).mean().item()

    rec = FlightRecorder(model, optimizer, out_dir=out_dir,
                         factory=f"karpathy_repos_models:{make}") if record else None
    try:
        with rec if rec is not None else contextlib.nullcontext():
            for step in range(steps):
                X, Y = loader.next()
                logits, loss = model(X, Y)
                model.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                if step > 0 and step % 4 == 0:
                    evaluate()
    finally:
        del loader  # (its workers, also when an event stops the loop)
    return model


def bigram_lecture(out_dir, lr, steps=16, record=True):
    """The bigram lecture's gradient descent (``W.data += -lr * W.grad``, as SGD)."""
    torch.manual_seed(2147483647)
    model = M.make_bigram_net()
    xs, ys = M.bigram_pairs()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    rec = FlightRecorder(model, optimizer, loss_fn=M.bigram_nll, out_dir=out_dir,
                         factory="karpathy_repos_models:make_bigram_net") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.bigram_nll
        for _ in range(steps):
            probs = model(xs)
            loss = loss_fn(probs, ys)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return model


def lecture_mlp(out_dir, batch_size, epochs=2, record=True):
    """makemore part 3's MLP with the lecture's BatchNorm1d, through a shuffling DataLoader
    that keeps the last, incomplete batch (``drop_last=False``, the default)."""
    torch.manual_seed(2147483647)
    model = M.make_lecture_mlp()
    X, Y = M.build_dataset()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y),
                                         batch_size=batch_size, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = torch.nn.CrossEntropyLoss()
    rec = FlightRecorder(model, optimizer, loss_fn=criterion, out_dir=out_dir,
                         factory="karpathy_repos_models:make_lecture_mlp") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        for _ in range(epochs):
            for Xb, Yb in loader:
                loss = criterion(model(Xb), Yb)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
    return model


def llmc(make, out_dir, dtype=torch.float16, steps=2, grad_accum_steps=2, record=True):
    """llm.c's ``train_gpt2.py``: autocast to ``--dtype`` with no GradScaler, the loss of
    ``model(x, y, return_logits=False)`` over ``grad_accum_steps``, ``lossf`` kept detached,
    the global norm clipped at 1.0, ``get_lr`` set on each group."""
    torch.manual_seed(42)
    model = getattr(M, make)()
    optimizer = model.configure_optimizers(0.0, 6e-4, (0.9, 0.95), "cpu")
    data, g = M.token_stream(), torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, optimizer, out_dir=out_dir,
                         factory=f"karpathy_repos_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            lossf = 0.0
            for _ in range(grad_accum_steps):
                x, y = M.get_batch(data, g)
                with torch.autocast("cpu", dtype=dtype):
                    _, loss = model(x, y, return_logits=False)
                loss = loss / grad_accum_steps
                lossf += loss.detach()
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for param_group in optimizer.param_groups:
                param_group["lr"] = get_lr(step)
            optimizer.step()
    return model


def fire(train, *args, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(*args, **kw)
    return info.value.event, info.value.bundle_path


def test_adamw_eps_zero_makes_nan_in_position_rows_the_windows_never_read(tmp_path):
    """``block_size`` 32, trained on windows of 16, AdamW with ``eps=0.0``: ``wpe``'s rows
    16..31 get a gradient of exactly 0, and the first update is 0 / (sqrt(0) + 0) there."""
    event, bundle = fire(nanogpt, "make_gpt_long_block", tmp_path, eps=0.0)
    assert (event["step"], event["phase"]) == (0, "optimizer")
    report = nanreplay_json(bundle, code=1)  # (the bundle holds the weights after the update)
    assert report["reproduced"] is False
    origin = report["origin"]
    assert (origin["phase"], origin["param"]) == ("optimizer", "transformer.wpe.weight")
    assert report["cause"] == "optimizer"
    hint = report["hint"]
    assert "eps=0" in hint and "set eps > 0" in hint
    assert "row(s) 16, 17, 18" in hint and "of 32 of transformer.wpe.weight" in hint


def test_float16_attention_scores_of_a_mis_scaled_init_overflow_in_the_first_evaluation(
        tmp_path):
    """``_init_weights`` with ``std = n_embd ** 0.5``, the manual attention path, float16
    autocast: ``q @ k.T`` passes 65504 in the evaluation at iteration 0, before any update.
    Sequences 0 and 3 hold a +inf at a position the causal mask keeps (2's is -inf: the
    softmax takes it)."""
    event, bundle = fire(nanogpt, "make_gpt_manual_big_init", tmp_path, dtype="float16")
    assert (event["step"], event["phase"], event["module"]) == (0, "forward",
                                                                "transformer.h.0.attn")
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["op"], origin["module"], origin["made"], origin["dtype"]) == (
        "aten.bmm", "transformer.h.0.attn", "+inf", "float16")
    assert origin["source"] == line_of("att = (q @ k.transpose(-2, -1)) * (1.0 /")
    assert [c["op"] for c in origin["chain"]] == ["aten.bmm", "aten._softmax"]
    assert origin["samples"] == [0, 3]
    assert report["cause"] == "overflow"
    hint = report["hint"]
    assert "attention scores" in hint and "scale q before the product" in hint
    # no update ran: the init's scale, not attention-logit growth in training
    assert "no update ran under the recorder" in hint and "init's std" in hint
    assert "grow with the query and key projections' weights in training" not in hint


def test_float16_overflow_under_dropout_in_the_second_micro_batch_is_replayed_as_run(tmp_path):
    """The same init with nanoGPT's fine-tuning dropout (0.1), no evaluation, three
    micro-batches fetched from the global RNG between each forward and its backward: the
    overflow depends on the dropout mask of micro-batch 1, which the replay restores; only
    sequence 3's NaN is the first layer's (sequence 0's logits go NaN in a later layer)."""
    event, bundle = fire(nanogpt, "make_gpt_dropout_big_init", tmp_path, dtype="float16",
                         steps=1, accum=3, eval_interval=0, global_rng=True)
    assert (event["step"], event["phase"], event["module"], event["micro_batch"]) == (
        0, "forward", "transformer.h.0.attn", 1)
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert report["reproduced"] is True
    assert (origin["op"], origin["module"], origin["micro_batch"], origin["made"]) == (
        "aten.bmm", "transformer.h.0.attn", 1, "+inf")
    assert origin["samples"] == [3]
    assert report["cause"] == "overflow"


def test_causal_fill_written_where_the_tril_buffer_is_1_masks_the_last_query_whole(tmp_path):
    """``att.masked_fill(self.bias[:, :, :T, :T] == 1, -inf)`` (``== 0`` meant): each query's
    own position and its past are masked, the last query has no key in any sample. The hint
    names the buffer and the inverted condition, not a finite fill (a leak of the future)."""
    event, bundle = fire(nanogpt, "make_gpt_mask_flipped", tmp_path)
    assert (event["step"], event["phase"], event["module"]) == (0, "forward",
                                                                "transformer.h.0.attn")
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["op"], origin["module"], origin["made"]) == (
        "aten._softmax", "transformer.h.0.attn", "nan")
    assert origin["source"] == line_of("att = F.softmax(att, dim=-1)")
    assert origin["chain"][0]["op"] == "aten.masked_fill" and origin["chain"][0]["intentional"]
    assert origin["samples"] == [0, 1, 2, 3] and origin["all_samples"] is True
    assert report["cause"] == "invalid"
    hint = report["hint"]
    assert "transformer.h.0.attn.bias is a causal mask" in hint and "inverted" in hint
    assert "masked_fill(self.bias[:, :, :T, :T] == 0" in hint
    assert "mask with a large finite negative number" not in hint


def test_new_gelu_cube_overflows_float16_hidden_by_tanh_then_nan_in_its_backward(tmp_path):
    """llm.c's NewGELU, ``tanh(c * (x + 0.044715 * torch.pow(x, 3.0)))``, under float16 autocast
    with no GradScaler and the mis-scaled init: ``x ** 3`` is inf in the forward, which
    ``tanh`` saturates to 1 (the output is x, finite); the backward's 0 from tanh times the
    power's derivative ``3 * x ** 2``, inf in float16, is NaN. The second block's runs first."""
    event, bundle = fire(llmc, "make_llmc_big_init", tmp_path)
    assert (event["step"], event["phase"]) == (0, "backward")
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["phase"], origin["op"], origin["module"], origin["micro_batch"]) == (
        "backward", "PowBackward0", "transformer.h.1.mlp.gelu", 0)
    assert origin["source"] == line_of("* (x + 0.044715 * torch.pow(x, 3.0))))")
    assert origin["samples"] == [0, 1, 2, 3]
    assert report["cause"] == "overflow"
    hint = report["hint"]
    assert "x ** 3 overflowed float16 in the forward too" in hint
    assert "F.gelu(x, approximate='tanh')" in hint and "where x ** n was not" not in hint


def test_attention_entropy_bonus_by_xlogy_is_nan_in_the_backward_only(tmp_path):
    """``-xlogy(att, att)`` of the causal softmax (an entropy bonus against entropy collapse,
    kept on the attention module as ``self.entropy`` and added to the loss by ``GPT``): 0 at
    the masked 0s in the forward, ``log 0`` and ``0 / 0`` in its backward. The backward node
    was made by the attention module's own call (the latest layer's runs first), not the
    root's, and the log cannot be split: the hint keeps p off 0."""
    event, bundle = fire(nanogpt, "make_gpt_entropy_reg", tmp_path)
    assert (event["step"], event["phase"]) == (0, "backward")
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["phase"], origin["op"], origin["module"]) == (
        "backward", "XlogyBackward0", "transformer.h.1.attn")
    assert origin["source"] == line_of("self.entropy = -torch.special.xlogy(att, att)")
    assert origin["samples"] == [0, 1, 2, 3]
    assert report["cause"] == "invalid"
    hint = report["hint"]
    assert "xlogy(p, p)" in hint and "p.clamp_min(torch.finfo(p.dtype).tiny)" in hint
    assert "split the log so that" not in hint


def test_bigram_lecture_softmax_by_hand_underflows_under_a_large_learning_rate(tmp_path):
    """``counts = logits.exp(); probs = counts / counts.sum(1)`` then ``-probs[...].log()``,
    with the lecture's ``W.data += -lr * W.grad`` at lr 500: by step 15 bigram 72 (``a`` then
    ``g``) has a probability below float32's range, rounded to 0; its log is -inf."""
    event, bundle = fire(bigram_lecture, tmp_path, lr=500.0)
    assert (event["step"], event["phase"], event["module"]) == (15, "loss", "<loss>")
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["op"], origin["module"], origin["made"]) == ("aten.log", "<loss>", "-inf")
    assert origin["source"] == line_of("return -probs[torch.arange(num), ys].log().mean()")
    assert origin["samples"] == [72]
    assert report["cause"] == "underflow"
    assert "log_softmax instead of log(softmax)" in report["hint"]


def test_fine_tuning_micro_batch_whose_targets_are_all_masked_is_0_over_0(tmp_path):
    """Prompt tokens labelled -1 (nanoGPT's ``ignore_index``) and the answers cut off by the
    block size: step 2's second micro-batch has no target; the model's own ``F.cross_entropy``
    divides by 0 inside ``GPT.forward``."""
    def truncated(it, micro_step, Y):
        return torch.full_like(Y, -1) if (it, micro_step) == (2, 0) else Y

    event, bundle = fire(nanogpt, "make_gpt", tmp_path, poison=truncated)
    assert (event["step"], event["phase"], event["micro_batch"]) == (2, "forward", 1)
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["op"], origin["module"], origin["micro_batch"], origin["made"]) == (
        "aten.nll_loss_forward", "", 1, "nan")
    assert origin["source"] == line_of("loss = F.cross_entropy(logits.view(-1, logits.size(-1))")
    assert report["cause"] == "invalid"
    assert "ignore_index (-1)" in report["hint"] and "max(count, 1)" in report["hint"]
    # (no attention mask: token id 0 is a token of the stream, not padding)
    assert "holds tokens at all 64 positions: no padding batch" in report["hint"], report["hint"]


@pytest.mark.filterwarnings("ignore:var\\(\\). degrees of freedom:UserWarning")
def test_lecture_batchnorm_of_the_last_batch_of_one_is_an_unbiased_variance_of_one_value(
        tmp_path):
    """107 examples in batches of 53: each epoch's third batch holds one example, and the
    lecture's ``x.var(0)`` divides by n - 1 = 0 in the hand-written BatchNorm1d."""
    event, bundle = fire(lecture_mlp, tmp_path, batch_size=53)
    assert (event["step"], event["phase"], event["module"]) == (2, "forward", "layers.1")
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["op"], origin["module"], origin["made"]) == ("aten.var", "layers.1", "nan")
    assert origin["source"] == line_of("xvar = x.var(0, keepdim=True)  # batch variance")
    assert origin["samples"] == [0]
    assert report["cause"] == "invalid"
    hint = report["hint"]
    assert "a batch norm written by hand" in hint and "drop_last=True" in hint


def test_resumed_checkpoint_with_a_nan_token_row_of_the_tied_embedding(tmp_path):
    """``init_from='resume'`` loads a checkpoint whose tied ``wte`` / ``lm_head`` weight has a
    NaN row (token 5): the evaluation at iteration 0 reads it first, in the embedding."""
    def corrupt(state_dict):
        state_dict["transformer.wte.weight"][5] = float("nan")
        return state_dict

    event, bundle = fire(nanogpt, "make_gpt", tmp_path, checkpoint=corrupt)
    assert (event["step"], event["phase"]) == (0, "weights")
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["phase"], origin["param"]) == ("weights", "transformer.wte.weight")
    assert (origin["op"], origin["module"]) == ("aten.embedding", "transformer.wte")
    assert report["cause"] == "weights"
    hint = report["hint"]
    assert "first step the recorder saw" in hint and "only row(s) 5 of 32" in hint


def test_learning_rate_typo_with_decoupled_weight_decay_flips_and_grows_the_weights(
        tmp_path):
    """makemore's AdamW with ``learning_rate=5e4`` (5e-4 meant) and ``weight_decay=0.01``:
    each update multiplies the weights by 1 - 500 = -499, until the MLP's first layer
    overflows float32."""
    event, bundle = fire(makemore, "make_mlp", tmp_path, learning_rate=5e4, steps=20,
                         workers=2)
    assert (event["step"], event["phase"], event["module"]) == (13, "forward", "")
    report = nanreplay_json(bundle)
    origin = report["origin"]
    assert (origin["op"], origin["module"], origin["made"]) == ("aten.addmm", "mlp.0", "+inf")
    assert report["cause"] == "overflow"
    assert "multiplies wte.weight by -499" in report["hint"]
    assert "weight_jump" in [p["kind"] for p in report["precursors"]]


@pytest.mark.parametrize(("loop", "kw"), [
    ("nanogpt", {"make": "make_gpt", "dtype": "float16"}),
    ("nanogpt", {"make": "make_gpt_manual", "dtype": "bfloat16"}),
    ("makemore", {"make": "make_gru", "workers": 2}),
    ("makemore", {"make": "make_bow"}),
    ("lecture", {"batch_size": 16}),
    ("llmc", {"make": "make_gpt", "dtype": torch.bfloat16}),
])
def test_healthy_runs_are_not_stopped_and_train_identically(tmp_path, loop, kw):
    """No event in the healthy loops (evaluations under no_grad / inference_mode between
    steps, fp16 with the GradScaler, the -inf causal fill), and the recorder changes nothing
    they compute."""
    train = {"nanogpt": nanogpt, "makemore": makemore, "lecture": lecture_mlp,
             "llmc": llmc}[loop]
    args = (kw.pop("make"),) if "make" in (kw := dict(kw)) else ()
    recorded = train(*args, tmp_path, **kw)
    bare = train(*args, tmp_path, record=False, **kw)
    for (name, a), b in zip(recorded.state_dict().items(), bare.state_dict().values()):
        assert torch.equal(a, b), name
    assert not list(tmp_path.glob("*.nan"))
