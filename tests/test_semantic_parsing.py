"""End to end on text-to-SQL with grammar-constrained decoding (``semantic_parsing_models``):
an LSTM encoder-decoder whose decoder emits grammar actions (ApplyRule, GenToken, CopyColumn)
masked by the grammar state with ``masked_fill(~valid, -inf)``, a pointer over the schema's
columns, schema linking features from string-match counts, a pointer-generator switch mixing
the action distribution with a copy of the question's tokens, a label-smoothed cross-entropy
over the gold actions padded with -100, AdamW with gradient clipping, teacher forcing, batches
from a ``DataLoader`` with a custom ``collate_fn`` (and bf16 autocast for one run). Each planted
failure fires under the recorder and is replayed with the CLI; the healthy run raises nothing
and trains bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import semantic_parsing_models as M
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

K, BAD = 2, 1  # the step a planted bad example is in, and its index in the batch
FACTORY = "semantic_parsing_models:make_model"


def line_of(text: str) -> str:
    return source_line("semantic_parsing_models.py", text)


def train(out_dir, plant: str = "none", mkw: dict | None = None, lkw: dict | None = None,
          eps: float = 1e-8, amp: bool = False, record: bool = True, crit=None,
          micro: int = 1, allow_inf: tuple = (), bad: int = BAD) -> torch.nn.Module:
    """Teacher-forced training: AdamW, gradient norm clipping, optional bf16 autocast, the
    batch split into ``micro`` micro-batches whose gradients accumulate."""
    mkw = mkw or {}
    model = M.make_model(**mkw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=eps)
    crit = crit or M.LabelSmoothedNLL(**(lkw or {}))
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=FACTORY,
                         factory_kwargs=mkw, allow_inf=list(allow_inf))
    names = ("q", "q_len", "cols", "col_mask", "col_stats", "prev", "valid")
    with rec if record else contextlib.nullcontext():
        for b in M.loader(plant, K, bad):
            opt.zero_grad()
            for rows in torch.arange(M.B).chunk(micro):
                mb = {k: v[rows] for k, v in b.items()}
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    out = model(*(mb[k] for k in names))
                    loss = crit(out, mb["gold"], mb["valid"]) / micro
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return model


def fire(out_dir, step: int, code: int | None = 0, **kw):
    """(event, report) of the planted run, which must raise at ``step`` (``code``: the CLI's
    exit code; 1 where nothing is re-run: an update event the bundle holds after)."""
    with pytest.raises(NonFiniteError) as info:
        train(out_dir, **kw)
    ev = info.value.event
    assert ev["step"] == step, ev
    return ev, nanreplay_json(info.value.bundle_path, code=code)


def origin(rep: dict) -> tuple:
    o = rep["origin"]
    return o["phase"], o["module"], o["op"], o["samples"], rep["cause"]


def batch(plant: str, step: int = K) -> dict:
    return list(M.loader(plant, K, BAD))[step]


@pytest.mark.parametrize("mkw", [{}, {"hand_softmax": True}])
def test_healthy_parser_raises_nothing_and_trains_the_same(tmp_path, mkw):
    recorded = train(tmp_path, mkw=mkw)
    plain = train(tmp_path, mkw=mkw, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_schema_with_no_column_leaves_the_copy_state_no_valid_action(tmp_path):
    """A schema filter dropped every column of one table while its gold SQL still selects one:
    the CopyColumn state's action mask is all False, masked_fill(-inf) leaves the row no
    finite logit and the softmax is NaN there."""
    b = batch("nocol")
    assert not b["col_mask"][BAD].any() and b["col_mask"].any(-1).sum() == M.B - 1
    ev, rep = fire(tmp_path, K, plant="nocol")
    assert (ev["phase"], ev["samples"]) == ("forward", [BAD]), ev
    assert origin(rep) == ("forward", "", "aten._softmax", [BAD], "invalid"), rep
    assert rep["origin"]["source"] == line_of("p_action = logits.masked_fill(~valid"), rep
    assert "every entry is -inf (a fully masked row)" in rep["hint"], rep["hint"]
    assert f"0 everywhere in sample(s) {BAD}" in rep["hint"], rep["hint"]


def test_an_empty_question_names_the_linker_fraction_and_the_record(tmp_path):
    """The tokenizer left a question no token: the linker's match fraction counts / q_len is
    0/0 for that example's columns."""
    assert batch("emptyq")["q_len"].tolist()[BAD] == 0
    ev, rep = fire(tmp_path, K, plant="emptyq")
    assert (ev["phase"], ev["module"], ev["samples"]) == ("forward", "linker", [BAD]), ev
    assert origin(rep) == ("forward", "linker", "aten.div", [BAD], "invalid"), rep
    assert rep["origin"]["source"] == line_of("frac = counts / q_len"), rep
    assert f"Sample(s) {BAD} are empty records" in rep["hint"], rep["hint"]


def test_a_null_column_statistic_is_named_at_its_entry(tmp_path):
    """The mean of a column whose cells are all NULL is NaN in the batch's col_stats (B, C),
    at one column of one example. The hint was the generic 'check the data pipeline for these
    samples ... or filter them', since a table narrower than 8 features was not read as
    records of features; it now names the sample and the column and says to impute."""
    stats = batch("nanstat")["col_stats"]
    assert stats.isnan().nonzero().tolist() == [[BAD, 0]]
    ev, rep = fire(tmp_path, K, plant="nanstat")
    assert ev["phase"] == "input" and ev["samples"] == [BAD], ev
    assert origin(rep) == ("input", None, None, [BAD], "input"), rep
    assert rep["origin"]["tensor"] == "args[4]", rep
    assert f"args[4] holds it at scattered entries of records otherwise finite: sample {BAD} " \
        f"at feature(s) 0 (of {M.C})" in rep["hint"], rep["hint"]
    assert "a database column all NULL" in rep["hint"], rep["hint"]
    assert "check the data pipeline" not in rep["hint"], rep["hint"]


def test_adam_without_eps_names_the_padding_and_unseen_embedding_rows(tmp_path):
    """AdamW with eps=0: the padding row of the question embedding (padding_idx) and the rows
    of tokens absent from the batch get gradients of exactly 0, m = v = 0, and the update is
    0/0."""
    ev, rep = fire(tmp_path, 0, code=1, eps=0.0)
    assert ev["phase"] == "optimizer", ev
    assert (rep["cause"], rep["reproduced"]) == ("optimizer", False), rep
    assert "with eps=0" in rep["hint"] and "embed.weight" in rep["hint"], rep["hint"]
    assert "row(s) 0, " in rep["hint"], rep["hint"]


def test_a_where_guarded_attention_entropy_is_a_backward_nan(tmp_path):
    """An attention-entropy penalty torch.where(attn > 0, attn * attn.log(), 0): finite in the
    forward, but the backward of log at the padding positions' 0 is inf, times 0: NaN, in the
    examples whose question is padded."""
    padded = (batch("none", 0)["q_len"] < M.L).nonzero().flatten().tolist()
    ev, rep = fire(tmp_path, 0, lkw={"attn_entropy": 0.1})
    assert ev["phase"] == "backward", ev
    assert origin(rep) == ("backward", "<loss>", "MulBackward0", padded, "invalid"), rep
    assert rep["origin"]["source"] == line_of("plogp = torch.where(attn > 0"), rep
    assert "torch.where(mask, x, 1)" in rep["hint"], rep["hint"]


def test_switch_entropy_in_bf16_rounds_one_minus_p_gen_to_zero(tmp_path):
    """A switch initialised to generate (bias 12) under bf16 autocast: sigmoid(12) rounds to 1,
    and the switch-entropy bonus's log(1 - p_gen) is log(0)."""
    ev, rep = fire(tmp_path, 0, mkw={"gen_bias": 12.0}, lkw={"switch_entropy": 0.01},
                   amp=True)
    assert origin(rep) == ("loss", "<loss>", "aten.log", list(range(M.B)), "precision"), rep
    assert rep["origin"]["source"] == line_of("ent = -(p_gen * p_gen.log()"), rep
    assert "rounded to 1 in bfloat16" in rep["hint"], rep["hint"]
    assert "logsigmoid(−z)" in rep["hint"], rep["hint"]


def test_a_raw_column_sum_overflows_a_hand_written_masked_softmax(tmp_path):
    """A SUM over a BIGINT column left unstandardised (4e6) in one schema's cell statistics
    drives that example's column-pointer logits past 88, and an older parser's masked softmax
    exp(logits) * valid / sum overflows to inf / inf."""
    ev, rep = fire(tmp_path, K, plant="rawstat", mkw={"hand_softmax": True})
    assert (ev["phase"], ev["samples"]) == ("forward", [BAD]), ev
    assert origin(rep) == ("forward", "", "aten.exp", [BAD], "overflow"), rep
    assert rep["origin"]["source"] == line_of("e = logits.exp() * valid"), rep
    assert "subtract the row max before exp" in rep["hint"], rep["hint"]
    assert f"sample(s) {BAD} of args[4] reach 4e+06" in rep["hint"], rep["hint"]


def test_a_micro_batch_of_unparsed_gold_sql_is_nll_over_no_target(tmp_path):
    """Gradient accumulation over two micro-batches; the first two examples of step K hold
    gold SQL the grammar could not parse, kept with every action ignored (-100): NLLLoss's
    mean over that micro-batch divides by a total weight of 0. The report named no sample
    and said 'every target of the batch is ignore_index ... skip batches whose targets are
    all ignored' though the step's other micro-batch holds targets; it now names micro-batch
    0 and its rows and says to divide the summed losses by the whole step's count."""
    assert (batch("unparsed")["gold"][:BAD + 1] == M.IGNORE).all()
    ev, rep = fire(tmp_path, K, plant="unparsed", crit=M.SeqNLL(), micro=2)
    assert (ev["phase"], ev["micro_batch"]) == ("loss", 0), ev
    assert origin(rep) == ("loss", "<loss>", "aten.nll_loss_forward", [0, 1], "invalid"), rep
    assert rep["origin"]["micro_batch"] == 0, rep
    assert rep["origin"]["source"] == line_of("return self.nll(logp.flatten(0, 1)"), rep
    h = rep["hint"]
    assert "every target of micro-batch 0 (of 2 this step accumulated) is ignore_index (-100)" \
        in h, h
    assert "divide by the count of targets over the whole step" in h, h
    assert "every target of the batch" not in h, h


def test_a_batch_of_unparsed_gold_sql_without_accumulation_keeps_the_batch_text(tmp_path):
    """The same loss over one micro-batch per step whose every example is unparsed: the
    whole batch has no target, no accumulation to blame; the batch's text stays."""
    ev, rep = fire(tmp_path, K, plant="unparsed", crit=M.SeqNLL(), bad=M.B - 1)
    # (every example, "all N rows", as with accumulation)
    assert origin(rep)[2:] == ("aten.nll_loss_forward", list(range(M.B)), "invalid"), rep
    assert rep["origin"]["all_samples"], rep
    assert "every target of the batch is ignore_index (-100)" in rep["hint"], rep["hint"]
    assert "micro-batch" not in rep["hint"], rep["hint"]


def test_masked_log_probabilities_reach_the_output_then_smoothing_multiplies_them(tmp_path):
    """A decoder returning log_softmax of the grammar-masked logits holds -inf at every
    invalid action: the recorder stops at the first mask (the column pointer's padding) and
    says to allow it; allowed, the label smoothing's (logp * valid) is -inf * 0 at every
    masked action of every example."""
    kw = {"mkw": {"log_output": True}, "lkw": {"log_input": True}}
    ev, rep = fire(tmp_path / "a", 0, **kw)
    assert ev["phase"] == "forward", ev
    assert origin(rep)[1:3] + origin(rep)[4:] == ("", "aten.masked_fill", "invalid"), rep
    assert rep["origin"]["source"] == line_of("col_scores = col_scores.masked_fill("), rep
    assert "record with allow_inf naming that module" in rep["hint"], rep["hint"]
    assert any("FlightRecorder(..., allow_inf=[''])" in p for p in rep["problems"]), rep
    ev, rep = fire(tmp_path / "b", 0, allow_inf=("",), **kw)
    assert ev["phase"] == "loss", ev
    assert origin(rep) == ("loss", "<loss>", "aten.mul", list(range(M.B)), "invalid"), rep
    assert rep["origin"]["source"] == line_of("smooth = -(logp * valid)"), rep
    assert "computed 0 * inf" in rep["hint"] and "on purpose" in rep["hint"], rep["hint"]
