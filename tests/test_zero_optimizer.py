"""ZeRO-1 under torchrun: DDP with ``ZeroRedundancyOptimizer`` (Adam's state sharded across two
gloo ranks on CPU), every mode of tests/dist/zero_train.py in one launch (models and data:
tests/zero_optimizer_models.py). Each failure must stop both ranks at the same step, each rank's
bundle must hold the optimizer state that rank holds and say it is sharded, and the replay of
either rank's bundle must name the step, parameter or module, op and cause, with no
``consolidate_state_dict`` in the loop."""

import re

import pytest
from bundles import invoke_cli, nanreplay_json, source_line
from test_torchrun import HERE, _torchrun

from recorder.bundle import read_bundle

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "zero_optimizer_models.py"
MODES = ("healthy", "bare", "eps0", "eps0guard", "sample", "loss", "scale", "empty", "rewind")


@pytest.fixture(scope="module")
def zero(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero_train")
    _torchrun("zero_train.py", out, HERE.parent, *MODES)
    return out


def said(out, mode: str) -> str:
    return "".join((out / "logs" / f"{mode}-rank{r}.out").read_text() for r in (0, 1))


def stops(out, mode: str) -> dict[str, str]:
    """rank -> ``step=S phase=P`` of each rank's NonFiniteError, and the loop's step then."""
    return dict(re.findall(r"rank (\d) event (step=\d+ phase=\w+)[^\n]* loop_step=(?:\d+)",
                           said(out, mode)))


def loop_steps(out, mode: str) -> set[str]:
    return set(re.findall(r"loop_step=(\d+)", said(out, mode)))


def bundles(out, mode: str, step: int):
    return [out / mode / f"step{step:08d}-rank{r}.nan" for r in (0, 1)]


def test_healthy_run_raises_nothing_and_trains_as_without_the_recorder(zero):
    sums = {m: re.findall(r"rank \d no event steps=6 checksum=(\S+)", said(zero, m))
            for m in ("healthy", "bare")}
    assert len(sums["healthy"]) == 2 and len(set(sums["healthy"])) == 1, said(zero, "healthy")
    assert sums["healthy"] == sums["bare"]  # bit-identical, on both ranks
    assert not (zero / "healthy").exists() or not list((zero / "healthy").iterdir())


def test_each_rank_bundle_holds_its_shard_of_the_optimizer_state(zero):
    held = {}
    for path in bundles(zero, "eps0", 0):
        meta, tensors = read_bundle(path)
        inner = meta["optimizer"]["inner"]["optim"]
        assert inner["class"] == "torch.optim.adam.Adam" and inner["sharded"] is True
        held[meta["env"]["rank"]] = inner["params"]
        assert {k.split("/")[1] for k in tensors if k.startswith("optim/")} == set(inner["params"])
    assert sorted(held[0] + held[1]) == sorted(meta["params"])  # every parameter, once
    assert "emb.weight" in held[1] and "head.0.weight" in held[0], held
    # --info said "unsharded (DDP)" of a set whose optimizer state is sharded
    info = invoke_cli(bundles(zero, "eps0", 0)[0], "--info").stdout
    assert ("weights unsharded (DDP), optimizer state sharded (ZeroRedundancyOptimizer: this "
            f"rank holds the state of {len(held[0])} of 7 parameters)") in info, info


@pytest.mark.parametrize("rank", [0, 1])
def test_adam_eps0_update_named_from_either_rank(zero, rank):
    """Adam with eps=0 divides 0 by 0 in the embedding rows no rank's batch looked up. The
    update runs on rank 1 (which holds emb.weight's state) and is broadcast: both ranks stop
    at step 0. Before, the replay said ZeroRedundancyOptimizer 'is not a torch.optim built-in'
    and could not re-run the guarded update; rebuilt from its local Adam with the rank 0 grads
    of its own batch alone, it made row 4 NaN too, which training's averaged gradient did not."""
    assert set(stops(zero, "eps0").values()) == {"step=0 phase=optimizer"}
    assert loop_steps(zero, "eps0") == {"1"} and loop_steps(zero, "eps0guard") == {"0"}
    rep = nanreplay_json(bundles(zero, "eps0", 0)[rank], code=1)  # (the weights after it)
    assert rep["cause"] == "optimizer" and rep["origin"]["param"] == "emb.weight"
    assert "eps=0" in rep["hint"] and rep["event"]["step"] == 0
    rep = nanreplay_json(bundles(zero, "eps0guard", 0)[rank])
    o = rep["origin"]
    assert (rep["cause"], rep["event"]["step"], o["op"], o["param"]) == (
        "optimizer", 0, "aten.addcdiv_", "emb.weight")
    assert o["rows"] == [6, 7, 8, 9, 10, 11]  # the ids no record of either rank holds
    note = next(p for p in rep["problems"] if "sharded" in p)
    assert "rank 0: head.0.weight;" in note and "emb.weight on rank 1" in note
    assert not any("not a torch.optim built-in" in p for p in rep["problems"])


@pytest.mark.parametrize("rank", [0, 1])
def test_nan_sample_on_one_rank(zero, rank):
    assert stops(zero, "sample") == {"0": "step=2 phase=backward", "1": "step=2 phase=input"}
    rep = nanreplay_json(bundles(zero, "sample", 2)[rank])
    assert rep["bundle"]["rank"] == 1 and rep["event"]["step"] == 2
    assert (rep["cause"], rep["origin"]["tensor"], rep["origin"]["samples"]) == (
        "input", "args[2]", [2])


@pytest.mark.parametrize("rank", [0, 1])
def test_weighted_loss_0_over_0_on_one_rank(zero, rank):
    assert stops(zero, "loss") == {"0": "step=2 phase=backward", "1": "step=2 phase=loss"}
    rep = nanreplay_json(bundles(zero, "loss", 2)[rank])
    o = rep["origin"]
    assert (rep["event"]["step"], rep["cause"], o["module"], o["op"]) == (
        2, "invalid", "<loss>", "aten.div")
    assert o["source"] == source_line(MODELS, "return (per * weight).sum() / weight.sum()")
    assert "weight" in rep["hint"] and "skip such batches" in rep["hint"]


def test_record_out_of_scale_overflows_proj(zero):
    assert stops(zero, "scale") == {"0": "step=1 phase=forward", "1": "step=1 phase=backward"}
    rep = nanreplay_json(bundles(zero, "scale", 1)[1])
    o = rep["origin"]
    assert (rep["bundle"]["rank"], rep["event"]["step"], rep["cause"]) == (0, 1, "overflow")
    assert (o["module"], o["op"], o["samples"]) == ("proj", "aten.addmm", [1])
    assert "out of scale" in rep["hint"]


def test_all_padding_record_makes_a_backward_only_nan(zero):
    assert set(stops(zero, "empty").values()) == {"step=1 phase=backward"}
    rep = nanreplay_json(bundles(zero, "empty", 1)[0])
    o = rep["origin"]
    assert (rep["event"]["step"], rep["cause"], o["phase"], o["op"], o["samples"]) == (
        1, "invalid", "backward", "SqrtBackward0", [3])
    assert o["source"] == source_line(MODELS, "norm = pooled.pow(2).sum(-1, keepdim=True)")


def test_rewind_window_reads_every_ranks_state_copy(zero):
    """rewind=2, a NaN sample on rank 1 at step 5: the window re-runs from the copy at step 2.
    Each rank's copy holds only its shard of Adam's state, under ZeRO's ``optim::`` keys: the
    re-run's Adam dropped those keys and the other rank's shard was never read, so the re-run's
    update at the copy's step started from zero moments and the next step's loss drifted from
    the recorded one."""
    import replay

    rep = replay.replay(bundles(zero, "rewind", 5)[0])
    w = rep["window"]
    assert (w["copy_step"], w["steps"], w["reproduced"]) == (2, [2, 5], True), w
    recorded = dict(zip(rep["history"]["steps"], rep["history"]["loss"]))
    for s in w["per_step"][:3]:  # steps 2-4: those after the copy's update drifted
        assert s["loss"] == pytest.approx(recorded[s["step"]], rel=1e-6), (s, recorded)
    assert rep["cause"] == "input" and rep["origin"]["samples"] == [2]
