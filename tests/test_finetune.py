"""Hand-written fine-tuning loops (``accelerate.Accelerator`` driving a LoRA-adapted Hugging Face
model), recorded as the README says and replayed from the bundle.

The planted bug: an added special token's embedding row initialised as the mean of its
description's sub-token embeddings, which the tokenizer returned none of: the mean of no rows
is NaN. Only the samples that contain the token meet it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import finetune_models as F  # noqa: E402
import torch  # noqa: E402

from recorder import FlightRecorder, NonFiniteError  # noqa: E402
from replay import replay  # noqa: E402
from replay.report import to_text  # noqa: E402

HERE = Path(__file__).parent
BATCH, K, ROW = 4, 2, 1


pytestmark = pytest.mark.usefixtures("in_tests_dir")


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    """Each test builds its own Accelerator (mixed precision is a process-wide setting of
    accelerate's, fixed by the first one; accelerate's own tests reset it so)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def _accelerate_run(tmp_path, **options) -> NonFiniteError:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    kwargs = {"train_embeddings": True} if options.get("rewind") else {}
    model = F.make_lora_llama(**kwargs)
    emb = model.get_input_embeddings().weight
    description: list[int] = []  # the sub-tokens of the new token's text: none known
    with torch.no_grad():
        emb[F.VOCAB] = emb[description].mean(0)  # mean of no rows: NaN
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt = acc.prepare(model, opt)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path,
                            factory="finetune_models:make_lora_llama",
                            factory_kwargs=kwargs, **options):
            for step in range(5):
                loss = model(**F.tokens(step, BATCH, new_token_at=(K, ROW))).loss
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
    return info.value


def test_nan_row_of_an_added_token_names_the_row_its_reader_and_the_sample(tmp_path):
    """The bundle's weights are the cause (no update wrote the row); the report also names
    the row, the embedding call and op that first read it, and the one sample holding the
    token, which were missing: a user saw only the parameter's name."""
    err = _accelerate_run(tmp_path)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["params"]) == (K, "weights", ["model.embed_tokens.weight"])
    rep = replay(err.bundle_path)
    assert rep["reproduced"] is True and rep["cause"] == "weights"
    o = rep["origin"]
    assert (o["param"], o["module"], o["call"], o["micro_batch"], o["op"]) == (
        "model.embed_tokens.weight", "model.embed_tokens", 0, 0, "aten.embedding")
    assert o["samples"] == [ROW]
    assert (o["rows"], o["rows_of"], o["embedding"]) == ([F.VOCAB], F.VOCAB + 1, True)
    assert f"only row(s) {F.VOCAB} of {F.VOCAB + 1} of model.embed_tokens.weight" in rep["hint"]
    text = to_text(rep)
    assert "read by    aten.embedding in model.embed_tokens, call 0" in text
    assert f"samples    [{ROW}]" in text


def test_nan_in_a_loaded_adapter_names_its_rows_and_the_call_that_read_them(tmp_path):
    """A LoRA adapter checkpoint with one NaN row of one ``lora_A`` (a corrupted save) loaded
    before training: every sample meets it at the first step. The report names the adapter's
    path inside the model, the op of its first call, and its bad row (no token ids: it is no
    embedding)."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = F.make_lora_llama(added=0)
    name = "model.layers.1.self_attn.q_proj.lora_A.weight"
    adapter = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    adapter[name][2, 5] = float("nan")
    model.load_state_dict(adapter, strict=False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt = acc.prepare(model, opt)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path,
                            factory="finetune_models:make_lora_llama",
                            factory_kwargs={"added": 0}):
            acc.backward(model(**F.tokens(0, BATCH)).loss)
            opt.step()
    rep = replay(info.value.bundle_path)
    assert (rep["event"]["step"], rep["cause"]) == (0, "weights")
    o = rep["origin"]
    assert (o["param"], o["module"], o["call"]) == (
        name, "model.layers.1.self_attn.q_proj.lora_A", 0)
    assert o["op"] in ("aten.mm", "aten.linear", "aten.matmul", "aten.addmm"), o["op"]
    assert o["samples"] == list(range(BATCH))
    assert (o["rows"], o["rows_of"], o["embedding"]) == ([2], 4, False)
    assert rep["hint"].endswith(f"only row(s) 2 of 4 of {name} are non-finite")


def test_nan_row_no_forward_read_is_weights_not_the_update_that_carried_it(tmp_path):
    """With the embeddings trained too, the update of step 0 writes the NaN row back (AdamW:
    w * (1 - lr * wd) - 0) before any forward read it. The recorder saw it first there, as
    an optimizer event, and the replay said "AdamW's update at step 0 made nan ... from
    finite gradients and weights" until the window's copy showed the row NaN before it. The
    recorder now measures the weights before the first update: a `weights` event of step 0,
    which the window's copy holds too (not 'the event does not come back')."""
    err = _accelerate_run(tmp_path, rewind=2)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["params"]) == (0, "weights",
                                                       ["model.embed_tokens.weight"])
    rep = replay(err.bundle_path)
    assert rep["window"]["reproduced"] is True
    assert rep["reproduced"] is True and rep["cause"] == "weights"
    o = rep["origin"]
    assert (o["phase"], o["param"], ev["kind"]) == ("weights", "model.embed_tokens.weight", "nan")
    assert (o["rows"], o["rows_of"], o["embedding"]) == ([F.VOCAB], F.VOCAB + 1, True)
    assert f"only row(s) {F.VOCAB} of {F.VOCAB + 1} of model.embed_tokens.weight" in rep["hint"]
    assert "from finite gradients" not in rep["hint"]
    assert not any("does not come back" in p for p in rep["problems"]), rep["problems"]


def test_lora_b_growing_from_zero_under_warmup_is_no_precursor(tmp_path):
    """LoRA's ``B`` starts at 0, so the adapter's output is identically 0 until the first
    updates (none at all while a warmup's learning rate is 0), then grows: every LoRA run
    listed 'absmax of ...lora_B jumped 10x' among the precursors of an unrelated event (a
    batch with no labelled token, 0 / 0 in the model's loss)."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = F.make_lora_llama(added=0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 4))  # warmup from 0
    model, opt, sched = acc.prepare(model, opt, sched)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, lr_scheduler=sched,
                            factory="finetune_models:make_lora_llama",
                            factory_kwargs={"added": 0}):
            for step in range(8):
                acc.backward(model(**F.tokens(step, BATCH, unlabelled_at=6)).loss)
                opt.step()
                sched.step()
                opt.zero_grad()
    rep = replay(info.value.bundle_path)
    assert (rep["event"]["step"], rep["cause"], rep["origin"]["op"]) == (
        6, "invalid", "aten.nll_loss_forward")
    assert not [p for p in rep["precursors"] if "lora_B" in p["detail"]], rep["precursors"]


def test_bf16_autocast_accelerate_wraps_the_forward_in_after_attach_is_recorded(tmp_path):
    """The recorder attached first, then ``accelerator.prepare(model, opt)`` (the order most
    scripts build things in): prepare() wraps the model's forward in bfloat16 autocast after
    the recorder read the forward at attach. The bundle said no autocast, the replay ran in
    float32, where the planted bfloat16 rounding (sigmoid(6.9) == 1, log(1 - p) = -inf) does
    not happen, and reported 'NOT reproduced' with a hint about state outside the model."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, mixed_precision="bf16")
    model = F.make_rare_event_classifier()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    rec = FlightRecorder(model, opt, out_dir=tmp_path,
                         factory="finetune_models:make_rare_event_classifier").attach()
    model, opt = acc.prepare(model, opt)
    with pytest.raises(NonFiniteError) as info:
        for step in range(3):
            b = F.tokens(step, BATCH)
            acc.backward(model(b["input_ids"], b["attention_mask"], torch.ones(BATCH)))
            opt.step()
            opt.zero_grad()
    rec.detach()
    assert info.value.event["step"] == 0
    rep = replay(info.value.bundle_path)
    assert rep["reproduced"] is True and rep["cause"] == "precision"
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["dtype"]) == ("", "aten.log", "-inf", "bfloat16")
    assert o["source"].endswith(f"finetune_models.py:{_line_of('torch.log(1 - p)')}")
    assert o["samples"] == list(range(BATCH))
    assert "logsigmoid" in rep["hint"]


def test_what_if_of_a_model_returning_its_loss_does_not_inherit_the_recorded_nan_gradient(
        tmp_path):
    """A float16 base with float32 LoRA adapters trained at lr=5 (AdamW; 2e-4 is usual): the
    adapters grow until the float16 cast of their output overflows. The model returns its loss
    beside the logits, so a re-run back-propagates the recorded gradients of both, less what
    the loss sends the logits; at the event step the recorded logits' gradient is NaN (that
    forward was), and every what-if inherited it: 'dtype=float32: nan at step N (backward of
    ...lora_A.weight)', though training in float32 stays finite there."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = F.make_lora_llama(added=0, half=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5.0)
    model, opt = acc.prepare(model, opt)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, rewind=16,
                            factory="finetune_models:make_lora_llama",
                            factory_kwargs={"added": 0, "half": True}):
            for step in range(30):
                acc.backward(model(**F.tokens(step, BATCH)).loss)
                opt.step()
                opt.zero_grad()
    ev = info.value.event
    assert ev["phase"] == "forward" and ev["kind"] in ("+inf", "-inf", "nan")
    rep = replay(info.value.bundle_path, tries=["dtype=float32"])
    assert rep["window"]["reproduced"] is True and rep["cause"] == "overflow"
    assert rep["origin"]["dtype"] == "float16"
    (tried,) = rep["what_if"]
    assert tried["finite"] is True and tried["inconclusive"] is False, tried


def _line_of(text: str) -> int:
    lines = (HERE / "finetune_models.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)
