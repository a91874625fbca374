"""End to end: a custom training loop written with Hugging Face Accelerate as its docs write
it — ``Accelerator(gradient_accumulation_steps=4, mixed_precision="bf16" or "no")``,
``accelerator.prepare(model, optimizer, loader, scheduler)``, ``accelerator.accumulate``,
``accelerator.backward``, ``clip_grad_norm_`` under ``sync_gradients``, the
``AcceleratedOptimizer``'s ``step`` (a no-op between syncs) and ``step_was_skipped``,
``save_state``/``load_state`` — under ``FlightRecorder`` given the prepared model and optimizer,
until a planted bug fires, then replayed with the CLI. Step numbers are checked against the
loop's count of optimizer updates (``accelerator.step`` counts micro-batches)."""

from __future__ import annotations

import pytest

accelerate = pytest.importorskip("accelerate")

import accelerate_loop_models as M  # noqa: E402
import torch  # noqa: E402
from bundles import nanreplay_json, source_line  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from recorder import FlightRecorder, NonFiniteError  # noqa: E402

pytestmark = pytest.mark.usefixtures("in_tests_dir")

ACC, BS, K = 4, 2, 2  # micro-batches per update, rows per micro-batch, the planted update
PER_UPDATE = ACC * BS


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """One process runs several ``Accelerator`` configurations (bf16, then not): reset
    accelerate's process-wide state between tests, as accelerate's own test cases do."""
    yield
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerate.state.GradientState._reset_state()


def record(k: int, micro: int, row: int) -> int:
    """The dataset index of ``row`` of micro-batch ``micro`` of update ``k``."""
    return k * PER_UPDATE + micro * BS + row


def line_of(text: str) -> str:
    return source_line("accelerate_loop_models.py", text)


class Loop:
    """The documented custom loop; ``updates`` counts the optimizer updates that ran."""

    def __init__(self, data, *, mp="no", schedule=None, rec=True, out=None, before=None,
                 at_update=None, factory="make_tagger", raw=False):
        self.acc = accelerate.Accelerator(gradient_accumulation_steps=ACC, mixed_precision=mp,
                                          cpu=True)
        accelerate.utils.set_seed(0)
        model = getattr(M, factory)()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(data, batch_size=BS)
        self.crit = M.MaskedTokenLoss()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule or (lambda s: 1.0))
        self.rec = None

        def recorder(model, opt, sched):
            return FlightRecorder(model, opt, loss_fn=self.crit, out_dir=out,
                                  lr_scheduler=sched,
                                  factory=f"accelerate_loop_models:{factory}") if rec else None
        if raw:  # attached before prepare, to the model and optimizer as the user built them
            self.rec = recorder(model, opt, sched)
        self.model, self.opt, self.loader, self.sched = self.acc.prepare(model, opt, loader,
                                                                         sched)
        if before:
            before(self.acc)
        if not raw:
            self.rec = recorder(self.model, self.opt, self.sched)
        self.updates, self.at_update = 0, at_update or {}

    def train(self):
        acc, model, opt = self.acc, self.model, self.opt
        for batch in self.loader:
            with acc.accumulate(model):
                logits = model(batch["input_ids"], batch["feats"], batch["attention_mask"])
                loss = self.crit(logits, batch["labels"], batch["attention_mask"])
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                self.sched.step()
                opt.zero_grad()
            if acc.sync_gradients and not opt.step_was_skipped:
                self.updates += 1
                if self.updates in self.at_update:
                    self.at_update[self.updates](acc)

    def evaluate(self) -> float:
        """Token accuracy over the loader, gathered as accelerate's docs gather metrics."""
        self.model.eval()
        right = total = 0
        with torch.no_grad():
            for batch in self.loader:
                logits = self.model(batch["input_ids"], batch["feats"], batch["attention_mask"])
                pred, tags, mask = self.acc.gather_for_metrics(
                    (logits.argmax(-1), batch["labels"], batch["attention_mask"]))
                right += int(((pred == tags) & (mask > 0)).sum())
                total += int(mask.sum())
        self.model.train()
        return right / total

    def run(self, evaluate=False):
        if self.rec is None:
            self.train()
            return self.evaluate() if evaluate else None
        with self.rec:
            self.train()
            return self.evaluate() if evaluate else None


def fire(loop: Loop):
    with pytest.raises(NonFiniteError) as info:
        loop.run()
    del loop.loader
    return nanreplay_json(info.value.bundle_path, "--json", code=None), info.value.event


def origin(rep):
    o = rep["origin"]
    return (rep["event"]["step"], o["phase"], o["module"], o["op"], o["micro_batch"],
            o["samples"], rep["cause"])


@pytest.mark.parametrize("mp", ["no", "bf16"])
def test_healthy_loop_raises_nothing_and_trains_identically(tmp_path, mp):
    """Eight updates of four micro-batches, then an evaluation pass through
    ``gather_for_metrics``: no event, the recorder's step is the update count (not
    accelerate's own micro-batch count), the weights are bit-identical and the
    accuracy the same."""
    weights, accuracy = [], []
    for rec in (False, True):
        loop = Loop(M.TaggingData(64), mp=mp, rec=rec, out=tmp_path / "b")
        accuracy.append(loop.run(evaluate=True))
        weights.append({k: v.clone() for k, v in loop.model.state_dict().items()})
        if rec:
            assert loop.rec.event is None and loop.rec.step == loop.updates == 8
    assert list(tmp_path.glob("b/*.nan")) == [] and accuracy[0] == accuracy[1]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_a_nan_record_in_the_third_micro_batch_is_named_by_micro_batch_and_row(tmp_path):
    """A sensor dropout in row 1 of micro-batch 2 of update 2: the model's positional input
    ``feats``, named as its ``forward`` names it."""
    loop = Loop(M.TaggingData(64, nan={record(K, 2, 1)}), out=tmp_path)
    rep, ev = fire(loop)
    assert loop.updates == K and ev["step"] == K
    assert origin(rep) == (K, "input", None, None, 2, [1], "input")
    # (was: args[1] alone, leaving the user to count the forward's arguments)
    assert (rep["origin"]["tensor"], rep["origin"]["arg"]) == ("args[1]", "feats")
    assert "data pipeline" in rep["hint"]


@pytest.mark.parametrize("raw", [False, True])
def test_bf16_exp_attention_overflows_on_a_record_in_the_wrong_unit(tmp_path, raw):
    """A record's features 1000x: the hand-written attention's exp of its scores overflows
    bfloat16 (and float32), inf / inf in the row normalisation. The same report with the
    recorder attached before ``prepare`` (``raw``), whose bf16 autocast wraps the model's
    ``forward`` only then."""
    loop = Loop(M.TaggingData(64, loud={record(K, 1, 0)}), mp="bf16", out=tmp_path, raw=raw)
    rep, ev = fire(loop)
    assert loop.updates == K
    assert origin(rep) == (K, "forward", "attn", "aten.exp", 1, [0], "overflow")
    assert rep["origin"]["dtype"] == "bfloat16"
    assert rep["origin"]["source"] == line_of("w = torch.exp(q @ k.transpose(1, 2)")
    assert "subtract the row max" in rep["hint"] and "out of scale" in rep["hint"]


def test_a_micro_batch_of_empty_records_divides_the_token_loss_by_zero(tmp_path):
    empty = {record(K, 3, 0), record(K, 3, 1)}
    loop = Loop(M.TaggingData(64, empty=empty), out=tmp_path)
    rep, ev = fire(loop)
    assert loop.updates == K and (ev["phase"], ev["micro_batch"]) == ("loss", 3)
    assert origin(rep) == (K, "loss", "<loss>", "aten.div", 3, [], "invalid")
    assert rep["origin"]["source"] == line_of("return (per_token * m).sum() / m.sum()")
    assert "clamp_min(1)" in rep["hint"] and "micro-batch 3" in rep["hint"]


def test_an_inverse_sqrt_schedule_off_by_one_sets_lr_to_inf(tmp_path):
    """LambdaLR through accelerate's scheduler wrapper (stepped once per update): the first
    update after warmup runs at sqrt(3 / 0) = inf. The hint said "a schedule or the loop
    computed it"; it now names the scheduler the recorder was given, as the class inside
    accelerate's ``AcceleratedScheduler``, and the step it had reached."""
    loop = Loop(M.TaggingData(64), schedule=M.warmup_inverse_sqrt(3), out=tmp_path)
    with pytest.warns(RuntimeWarning, match="divide by zero"):
        rep, ev = fire(loop)
    assert ev["step"] == 3 and ev["phase"] == "optimizer"
    assert (rep["event"]["step"], rep["origin"]["phase"], rep["cause"]) == (
        3, "optimizer", "optimizer")
    assert "its lr was inf in that update: the lr_scheduler given to the recorder (LambdaLR, " \
        "at last_epoch 4 when the event was caught; evaluate its lr_lambda" in rep["hint"]


def test_a_cosine_embedding_masked_with_where_is_a_backward_only_nan_at_padding(tmp_path):
    """``torch.where(real, e / e.norm(...), 0)``: the pad id's zero embedding is 0/0 in the
    branch the forward drops, and the division's backward NaN (forward finite)."""
    loop = Loop(M.TaggingData(64), out=tmp_path, factory="make_unit_tagger")
    rep, ev = fire(loop)
    assert ev["step"] == 0 and ev["phase"] == "backward" and loop.updates == 0
    assert origin(rep) == (0, "backward", "", "DivBackward0", 0, [0, 1], "invalid")
    assert rep["origin"]["source"] == line_of("e = torch.where(real, e / e.norm(")
    assert "torch.where(mask, x, 1)" in rep["hint"]


def bad_checkpoint(tmp_path):
    """``save_state`` of a fresh run whose ``model.safetensors`` then holds a NaN in row 3 of
    ``attn.out.weight`` (a corrupt save)."""
    ck = tmp_path / "ckpt"
    loop = Loop(M.TaggingData(8), rec=False)
    loop.acc.save_state(ck)
    weights = load_file(ck / "model.safetensors")
    weights["attn.out.weight"][3] = float("nan")
    save_file(weights, ck / "model.safetensors", metadata={"format": "pt"})
    del loop.loader
    return ck


def test_resuming_from_a_corrupt_checkpoint_names_the_rows_it_loaded(tmp_path):
    ck = bad_checkpoint(tmp_path)
    loop = Loop(M.TaggingData(64), out=tmp_path / "b", before=lambda acc: acc.load_state(ck))
    rep, ev = fire(loop)
    assert loop.updates == 0 and (ev["step"], ev["phase"]) == (0, "weights")
    o = rep["origin"]
    assert (o["param"], o["module"], o["op"], o["rows"], rep["cause"]) == (
        "attn.out.weight", "attn.out", "aten.addmm", [3], "weights")
    assert "at the first step the recorder saw" in rep["hint"]
    assert "whole rows" in rep["hint"] and "load_state" in rep["hint"]
    assert "element-wise division" not in rep["hint"]


def test_a_rollback_to_a_corrupt_checkpoint_mid_run_is_a_write_between_updates(tmp_path):
    ck = bad_checkpoint(tmp_path)
    loop = Loop(M.TaggingData(64), out=tmp_path / "b",
                at_update={3: lambda acc: acc.load_state(ck)})
    rep, ev = fire(loop)
    assert loop.updates == 3 and (ev["step"], ev["last_update_step"]) == (3, 2)
    assert (rep["origin"]["param"], rep["origin"]["rows"], rep["cause"]) == (
        "attn.out.weight", [3], "weights")
    assert "between that update and step 3" in rep["hint"]
    assert "accelerator.load_state" in rep["hint"] and "whole rows" in rep["hint"]
