"""End to end on trajectory forecasting (``trajectory_forecasting_models``): scenes of agents
padded per scene with a validity mask given to ``forward``, social attention with ``-inf`` for
absent agents, teacher forcing, a bivariate Gaussian head (``rho = tanh(.)``) and its NLL
averaged over each scene's valid agents, a GMM head trained winner-takes-all over masked
future steps, VectorNet's polyline subgraphs max-pooled over padded points. Adam with
OneCycleLR and gradient clipping, batches from a DataLoader. Each planted failure of the domain
fires under the recorder and is replayed with the CLI; the healthy runs raise no event and
train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import torch
import trajectory_forecasting_models as M
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("trajectory_forecasting_models.py", text)


def batches(kind: str, steps: int, plant: dict):
    """The last step's batch carries the plant. Returns (model args, loss extras) a step."""
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        kw = plant if step == steps - 1 else {}
        if kind == "social":
            obs, valid, fut = M.scenes(g, **kw)
            out.append(((obs, valid, fut), (fut, valid)))
        elif kind == "multimodal":
            obs, fut, mask = M.tracks(g, **kw)
            out.append(((obs,), (fut, mask)))
        else:
            obs, points, pmask, poly, fut = M.lane_scenes(g, **kw)
            out.append(((obs, points, pmask, poly), (fut,)))
    return out


def vectornet_loss(pred, fut):
    return torch.nn.functional.smooth_l1_loss(pred, fut)


LOSSES = {"social": M.scene_nll, "multimodal": M.wta_loss, "vectornet": vectornet_loss}


def train(kind: str, make: str, out_dir, plant: dict | None = None, steps: int = 4,
          record: bool = True, loss=None, bf16: bool = False, accum: int = 1, **rec_kw):
    """Adam with OneCycleLR and gradient clipping, each step's batch from a DataLoader over
    that step's tensors, in ``accum`` micro-batches of gradient accumulation. Returns the
    model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=steps)
    crit = loss or LOSSES[kind]
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, **rec_kw,
                         factory=f"trajectory_forecasting_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for args, extras in batches(kind, steps, plant or {}):
            n = len(args[0])
            loader = DataLoader(TensorDataset(*args, *extras), batch_size=n // accum,
                                shuffle=False)
            opt.zero_grad()
            for tensors in loader:
                margs, mextras = tensors[:len(args)], tensors[len(args):]
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    out = model(*margs)
                    loss = loss_fn(*(out if isinstance(out, tuple) else (out,)), *mextras)
                (loss / accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(kind: str, make: str, tmp_path, bf16: bool = False, rec_kw=None, accum: int = 1,
         **plant):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, tmp_path, plant, bf16=bf16, accum=accum, **(rec_kw or {}))
    return info.value.event, info.value.bundle_path


def test_lone_agent_with_no_neighbour_names_the_softmax_of_its_fully_masked_row(tmp_path):
    """Social attention over the other agents only (Social-LSTM's pooling excludes the agent
    itself): in a scene with one pedestrian its row of scores is -inf everywhere and the
    softmax is NaN. The event and the replay name the attention module's softmax, scene 2 (not
    a row of the agents flattened into the LSTM's batch), a fully masked row, and the fix:
    keep one key per row."""
    ev, bundle = fire("social", "make_social_neighbours", tmp_path, lone=2)
    assert (ev["step"], ev["phase"], ev["module"], ev["call"], ev["samples"], ev["kind"]) == (
        3, "forward", "social", 0, [2], "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "social", "aten._softmax", "nan", [2]), o
    assert o["source"] == line_of("attn = torch.softmax(scores, dim=-1)"), o
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]
    assert "keep at least one key per row" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_scene_without_valid_agents_names_the_masked_mean_of_the_nll(tmp_path):
    """Every track of scene 5 was filtered out as too short, so its valid mask is all False:
    the model is finite (the agent attends to itself), but the NLL's mean over the scene's
    valid agents is 0/0. A loss event, named at that division, on scene 5, 0/0."""
    ev, bundle = fire("social", "make_social", tmp_path, empty=5)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        "loss", "<loss>", "aten.div", "nan", [5]), o
    assert o["source"] == line_of("per_scene = (nll * m).sum(1) / m.sum(1)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "skip the rows where it is 0" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_agent_leaving_the_view_names_the_sqrt_backward_of_its_padded_steps(tmp_path):
    """Winner-takes-all minADE over masked future steps: both the prediction and the target are
    zeroed at the steps agent 6 is no longer seen, so its squared distance there is 0 and
    sqrt's gradient is infinite; times the mask's 0 it is NaN in every weight. The replay
    names SqrtBackward0 on that line, sample 6, the vector_norm / eps fix, and that the eps
    given (0.0) guarded nothing."""
    ev, bundle = fire("multimodal", "make_multimodal", tmp_path, leaving=6)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "backward", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=6")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        "backward", "<loss>", "SqrtBackward0", "nan", [6]), o
    assert o["source"] == line_of("dist = (d + eps).sqrt()"), o
    assert rep["cause"] == "invalid", rep
    assert "vector_norm" in rep["hint"] and "exactly 0" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_polyline_cropped_to_no_point_names_the_max_pool_of_its_scene(tmp_path):
    """VectorNet's subgraph max-pools each polyline over its valid points, padding filled with
    -inf; a lane cropped out of the region of interest keeps its polyline slot with no valid
    point, and its feature is -inf. The event and the replay name the subgraph's max, scene 4,
    a fully masked row."""
    ev, bundle = fire("vectornet", "make_vectornet", tmp_path, cropped=4)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["kind"]) == (
        3, "forward", "subgraph", [4], "-inf"), ev
    rep = nanreplay_json(bundle, "--try", "drop=4")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "subgraph", "aten.max", "-inf", [4]), o
    assert o["source"] == line_of("return h.max(dim=2).values"), o
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


@pytest.mark.parametrize("kind,make,plant,loss,bf16", [
    ("social", "make_social", {}, None, False),
    ("social", "make_social_skip", {}, None, True),
    ("social", "make_social_neighbours_sdpa", {"lone": 2}, None, False),
    ("multimodal", "make_multimodal", {"leaving": 6}, M.wta_loss_eps, False),
    ("vectornet", "make_vectornet", {}, None, False)])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, kind, make, plant, loss, bf16):
    """Padded agents' -inf scores inside the softmax (under bfloat16 autocast too), a lone
    agent's row with no key under scaled_dot_product_attention (which returns 0 there), padded
    points' -inf inside the max pool, padded polylines under MultiheadAttention's
    key_padding_mask, an agent leaving the view under the sqrt with its eps: no event, and
    weights bit-identical with and without the recorder."""
    recorded = train(kind, make, tmp_path, plant, loss=loss, bf16=bf16, accum=1 + bf16)
    plain = train(kind, make, tmp_path, plant, loss=loss, bf16=bf16, accum=1 + bf16,
                  record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_scene_in_pixels_saturates_rho_and_the_nll_divides_by_its_rounded_complement(tmp_path):
    """ETH/UCY's homography was not applied to scene 3, so its displacements are in pixels,
    150 times too large; the head also sees the last displacement, and its rho = tanh(.) is
    1.0 in float32 there. The NLL's ``z / (2 (1 - rho²))`` divides by 0, +inf: the replay names
    that division on scene 3 and ``precision``: 1 - rho² is a complement that exact arithmetic
    keeps above 0 (float64 has a true, tiny value, not a cancellation's residue however large
    z is), and the hint's fix clamps rho."""
    ev, bundle = fire("social", "make_social_skip", tmp_path, pixels=3, scale=150.0)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        "loss", "<loss>", "aten.div", "+inf", [3]), o
    assert o["source"] == line_of("return (z / (2 * one_minus) + log_sigma.sum(-1)"), o
    assert rep["cause"] == "precision", rep["hint"]
    assert "rounded to 1 in float32" in rep["hint"], rep["hint"]
    assert "ρ.clamp(−1 + eps, 1 − eps)" in rep["hint"], rep["hint"]
    assert "residue" not in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_rho_rounded_to_one_in_bfloat16_is_named_in_bfloat16(tmp_path):
    """The same head under bfloat16 autocast, the scene only 40 times too large: float32
    keeps rho below 1 (the run without autocast raises nothing), bfloat16's tanh rounds it to
    1.0. The division itself runs in float32 (z is, the target being float32), so the hint
    names the type that rounded, the complement's, and says to compute what feeds it in
    float32."""
    train("social", "make_social_skip", tmp_path, {"pixels": 3, "scale": 40.0})
    assert not list(tmp_path.glob("*.nan"))
    ev, bundle = fire("social", "make_social_skip", tmp_path, bf16=True, pixels=3, scale=40.0)
    assert (ev["step"], ev["phase"]) == (3, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.div", "+inf", [3])
    assert rep["cause"] == "precision", rep["hint"]
    assert "rounded to 1 in bfloat16" in rep["hint"], rep["hint"]
    assert "compute what feeds this op in float32" in rep["hint"], rep["hint"]


NAN_PADDED = {"allow_nan": ["args[0]", "args[2]"]}


def test_nan_padded_future_fed_by_teacher_forcing_names_that_input_not_the_imputed_one(
        tmp_path):
    """trajdata pads absent agents with NaN, in the observed past (args[0]) and the future
    (args[2]) alike, both under allow_nan (the last step's batch comes from such a loader); the model imputes the past, but teacher forcing feeds
    the raw future to the decoder and its NaN reach the outputs. The recorder names the first
    input holding NaN, args[0]; the replay's re-runs find the future's NaN are the ones that
    leak (set to 0, the outputs are NaN-free; the past's set to 0, they are not) and name
    args[2], on the scenes with absent agents, and where forward uses it unimputed."""
    ev, bundle = fire("social", "make_social", tmp_path, rec_kw=NAN_PADDED, pad=float("nan"))
    assert (ev["step"], ev["phase"], ev["tensor"]) == (3, "input", "args[0]"), ev
    (_, valid, _), _ = batches("social", 4, {"pad": float("nan")})[-1]
    padded = torch.nonzero(~valid.all(1)).flatten().tolist()
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["cause"], o["phase"], o["tensor"], o["samples"]) == (
        "input", "input", "args[2]", padded), o
    assert "find where forward uses args[2] before (or without) imputing it" in rep["hint"]
    assert any("args[2]'s got past" in p for p in rep["problems"]), rep["problems"]


def test_nan_padded_scenes_imputed_everywhere_raise_nothing_and_train_the_same(tmp_path):
    """The same NaN-padded scenes with the future imputed before teacher forcing and in the
    loss: allow_nan's missing values stay inside, no event, bit-identical weights."""
    recorded = train("social", "make_social_imputed", tmp_path, {"pad": float("nan")},
                     **NAN_PADDED)
    plain = train("social", "make_social_imputed", tmp_path, {"pad": float("nan")},
                  record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.isfinite(a).all() and torch.equal(a, b), name


@pytest.mark.parametrize("kind,make,plant,mb,row,phase,op", [
    ("social", "make_social", {"empty": 5}, 1, 1, "loss", "aten.div"),
    ("multimodal", "make_multimodal", {"leaving": 13}, 1, 5, "backward", "SqrtBackward0")])
def test_under_gradient_accumulation_the_micro_batch_and_its_row_are_named(
        tmp_path, kind, make, plant, mb, row, phase, op):
    """The same failures with each step's batch in two micro-batches of accumulation: scene 5
    of 8 is row 1 of micro-batch 1, agent 13 of 16 row 5 of micro-batch 1; dropping that row of
    that micro-batch makes the step finite."""
    ev, bundle = fire(kind, make, tmp_path, accum=2, **plant)
    assert (ev["step"], ev["phase"]) == (3, phase), ev
    rep = nanreplay_json(bundle, "--try", f"drop={row}")
    o = rep["origin"]
    assert (o["phase"], o["op"], o["micro_batch"], o["samples"]) == (phase, op, mb, [row]), o
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_scene_without_lanes_names_the_softmax_inside_multihead_attention(tmp_path):
    """A parking-lot scene has no lane within the radius: every polyline slot is padding, so
    MultiheadAttention's key_padding_mask masks every key of its query and the softmax inside
    torch's attention is NaN. The replay names the op inside nn.MultiheadAttention's own code,
    the user's line that called it, scene 2, a fully masked row."""
    ev, bundle = fire("vectornet", "make_vectornet", tmp_path, no_lanes=2)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["kind"]) == (
        3, "forward", "glob", [2], "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["samples"]) == ("glob", 0, "aten._softmax", [2])
    assert o["source"] == line_of("ctx, _ = self.glob(q, lanes, lanes, key_padding_mask="), o
    assert rep["cause"] == "invalid" and "keep at least one key per row" in rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_softplus_sigma_underflowing_in_a_scene_in_millimetres_names_its_log(tmp_path):
    """Sigma as MultiPath writes it, softplus of the head's output, whose log the NLL takes:
    scene 3 was exported in millimetres (1000 times too large), the head's output there is
    hundreds below 0 and softplus of it is about 1e-47, which float32 rounds to 0, so the log
    is -inf. The replay names that log on scene 3, ``underflow`` (float64 has the value), the
    clamp away from 0, and the scene's data out of scale with the drop that tests it."""
    with pytest.raises(NonFiniteError) as info:
        train("social", "make_social_skip", tmp_path, {"pixels": 3, "scale": 1000.0},
              loss=M.scene_nll_softplus)
    assert (info.value.event["step"], info.value.event["phase"]) == (3, "loss")
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=3")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.log", "-inf", [3])
    assert o["source"] == line_of("log_sigma = torch.stack([sx, sy], -1).log()"), o
    assert rep["cause"] == "underflow", rep["hint"]
    assert "clamp_min(eps)" in rep["hint"] and "out of scale" in rep["hint"], rep["hint"]
    assert "sample(s) 3 of args[0]" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


@pytest.mark.usefixtures("validation_at_torch_default")  # (a compiled test may turn it off)
def test_cholesky_factor_of_a_saturated_rho_refused_by_the_distribution_is_precision(tmp_path):
    """Trajectron++ builds each component as MultivariateNormal(mu, scale_tril) from sigma and
    rho; in the scene 150 times too large rho rounds to 1.0 and the factor's second diagonal
    entry, sigma_y sqrt(1 - rho²), is 0, which LowerCholesky refuses. float64 has it at about
    1e-7, far inside float32's range: no underflow (whose advice, a floor on a softplus or exp,
    is not the fix) but the rounding of rho: ``precision``, with the clamp of rho, on the
    stack that built the factor, scene 3."""
    with pytest.raises(ValueError):
        train("social", "make_social_skip", tmp_path, {"pixels": 3, "scale": 150.0},
              loss=M.mvn_scene_nll)
    [bundle] = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        "loss", "<loss>", "aten.stack", "0", [3]), o
    assert rep["cause"] == "precision", rep["hint"]
    assert "refused its parameter scale_tril" in rep["hint"], rep["hint"]
    assert "no underflow" in rep["hint"] and "ρ.clamp(−1 + eps, 1 − eps)" in rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]
