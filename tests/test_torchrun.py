"""Real torchrun: two DDP ranks on CPU, a NaN sample on rank 1 only."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from bundles import invoke_cli, line_number

from recorder.bundle import read_bundle

HERE = Path(__file__).parent / "dist"
RUN_TIMEOUT_S = 300  # a two-rank run that takes longer hung


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_ranks(marker: str) -> None:
    """SIGKILL every process whose command line holds ``marker`` (a run's own directory)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker in cmdline.read_bytes().decode(errors="replace"):
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass  # (gone meanwhile)


def _torchrun(script: str, out: Path, pythonpath: Path, *args: str, **env_vars: str
              ) -> subprocess.CompletedProcess:
    """Two ranks of ``script OUT ARGS`` under torchrun; once more on a new port if the free one
    was taken before the rendezvous bound it."""
    # the checkout's packages, not whichever copy is installed (a worktree's tests ran the
    # installed recorder in the ranks)
    path = os.pathsep.join([str(pythonpath), str(HERE.parent.parent)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **env_vars}
    for _ in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={_free_port()}", str(HERE / script), str(out), *args]
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=HERE) as p:
            try:
                said, err = p.communicate(timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                # a hung run is killed with its ranks (each in a session of its own), which
                # would otherwise live on, load the rest of the suite and hold the pipes open
                p.kill()
                _kill_ranks(str(out))
                said, err = p.communicate()
                raise AssertionError(f"{script} hung: stdout:\n{said[-3000:]}\nstderr:\n"
                                     f"{err[-3000:]}") from None
        proc = subprocess.CompletedProcess(cmd, p.returncode, said, err)
        if "address already in use" not in proc.stderr.lower():
            break
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc


class Run(NamedTuple):
    out: Path  # the mode's bundle directory
    stdout: str  # both ranks' output in that mode, rank 0's first
    stderr: str


def _launch_modes(tmp_path_factory, script: str, *modes: str) -> dict[str, Run]:
    """Every mode of ``script`` in one launch (see tests/dist/modes.py): ``{mode: Run}``."""
    out = tmp_path_factory.mktemp(script.removesuffix(".py"))
    _torchrun(script, out, HERE, *modes)

    def said(mode: str, stream: str) -> str:
        return "".join((out / "logs" / f"{mode}-rank{r}.{stream}").read_text() for r in (0, 1))

    return {m: Run(out / m, said(m, "out"), said(m, "err")) for m in modes}


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> dict[str, Run]:
    return _launch_modes(tmp_path_factory, "ddp_train.py", "input", "warn", "rewind",
                         "internal", "loss", "eval", "eval0")


TP_MODES = ("bare", "healthy", "input", "shard", "slice", "update", "sp")  # (tests/dist/tp_train.py)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> dict[str, Run]:
    """FSDP2's update modes and tensor parallelism's, in one launch (a launch costs seconds)."""
    return _launch_modes(tmp_path_factory, "fsdp_update_train.py", "default", "guard", "exit",
                         *(f"tp_train:{m}" for m in TP_MODES),
                         *(f"options_train:{m}" for m in OPTION_MODES))


# DDP's and FSDP2's options of real scripts (tests/dist/options_train.py), healthy without and
# with the recorder, and planted NaNs
OPTIONS = ("ddp-bucketview", "ddp-unused", "fsdp-accum", "fsdp-mp", "fsdp-dcp")
OPTION_MODES = (*(f"{o}-{w}" for o in OPTIONS for w in ("bare", "rec")), "fsdp-accum-rw",
                "fsdp-dcp-nan")


@pytest.fixture(scope="module")
def options(sharded) -> dict[str, Run]:
    return {m: sharded[f"options_train:{m}"] for m in OPTION_MODES}


@pytest.fixture(scope="module")
def fsdp_update(sharded) -> dict[str, Run]:
    return sharded


@pytest.fixture(scope="module")
def tp(sharded) -> dict[str, Run]:
    return {m: sharded[f"tp_train:{m}"] for m in TP_MODES}


HOOKS = ("fp16", "powersgd", "allreduce")  # DDP communication hooks (ddp_commhook_train.py)
HOOK_MODES = (*HOOKS, *(f"{h}-bare" for h in HOOKS), "overflow", "own", "nan")


# torch.distributed.pipelining's two stages (tests/dist/pipeline_train.py)
PIPE_MODES = ("gpipe-bare", "gpipe-healthy", "gpipe-first", "1f1b-last-w")


@pytest.fixture(scope="module")
def frames(tmp_path_factory) -> dict[str, Run]:
    """ddp_frames_train's modes, ddp_commhook_train's (``ddp_commhook_train:MODE``) and
    pipeline_train's."""
    return _launch_modes(tmp_path_factory, "ddp_frames_train.py", "plain", "clip",
                         *(f"ddp_commhook_train:{m}" for m in HOOK_MODES),
                         *(f"pipeline_train:{m}" for m in PIPE_MODES))


@pytest.fixture(scope="module")
def commhooks(frames) -> dict[str, Run]:
    return {m: frames[f"ddp_commhook_train:{m}"] for m in HOOK_MODES}


@pytest.fixture
def nanreplay(monkeypatch):
    """``nanreplay ARGS`` in this process, run from tests/dist as a user runs it from where
    the training script (the bundles' factory) lives, as a finished process."""
    monkeypatch.chdir(HERE)
    monkeypatch.setattr(sys, "path", list(sys.path))

    def run(*args) -> subprocess.CompletedProcess:
        r = invoke_cli(*args)
        return subprocess.CompletedProcess(args, r.exit_code, r.stdout, r.stderr)

    return run


def test_two_ranks_each_write_their_bundle_and_stop(ddp):
    out, proc = ddp["input"].out, ddp["input"]
    # the two ranks print concurrently: their lines may interleave
    events = dict(re.findall(r"rank (\d) event (step=\d+ phase=\w+ tensor=\S+ samples=\[[^\]]*\])",
                             proc.stdout))
    assert set(events) == {"0", "1"}, proc.stdout
    # rank 1 saw its own bad sample; rank 0 saw the averaged gradient it produced
    assert "step=3 phase=input" in events["1"] and "samples=[2]" in events["1"]
    assert "step=3 phase=backward" in events["0"]
    # raise mode: both ranks raised at the same step, each saying rank 1 saw it first
    said = dict(re.findall(r"rank (\d) first=\[1\] loop_step=3 message (nanreplay: [^\n]*"
                           r"Rank \d of 2; first seen on rank\(s\) 1 \(non-finite on rank\(s\) "
                           r"0, 1\))", proc.stdout))
    assert set(said) == {"0", "1"}, proc.stdout
    names = sorted(p.name for p in out.iterdir())
    assert names == ["step00000003-rank0.nan", "step00000003-rank1.nan"]
    meta, tensors = read_bundle(out / "step00000003-rank1.nan")
    assert meta["env"]["rank"] == 1 and meta["env"]["world_size"] == 2
    assert meta["event"]["tensor"] == "batch" and meta["event"]["samples"] == [2]
    # the wrapper is unwrapped: names are the inner model's, so its factory rebuilds it
    assert meta["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert not bool(tensors["batch/0/0"][2].isfinite().all())
    # and the bundle replays from the directory where its factory lives
    rep = subprocess.run([sys.executable, "-m", "replay", "--json",
                          str(out / "step00000003-rank1.nan")],
                         capture_output=True, text=True, timeout=120, cwd=HERE)
    report = json.loads(rep.stdout)
    assert report["cause"] == "input" and report["origin"]["samples"] == [2]
    assert report["bundle"]["rank"] == 1 and report["event"]["step"] == 3
    assert report["reproduced"] is True


def test_warn_mode_on_two_ranks_says_the_ranks_train_on(ddp):
    """on_event="warn" under DDP: both ranks write their bundle at step 3 and train all 10
    steps. Their warnings said "every rank stopped at this step" (raise mode's words)."""
    out, proc = ddp["warn"].out, ddp["warn"]
    assert "rank 0 no event steps=10" in proc.stdout and "rank 1 no event steps=10" in \
        proc.stdout, proc.stdout
    warned = re.findall(r"Rank (\d) of 2; first seen on rank\(s\) 1 \(non-finite on rank\(s\) "
                        r"0, 1\); ([^\n]*)", proc.stderr)
    assert sorted(warned) == [
        ("0", "every rank wrote its bundle at this step and trains on (on_event=\"warn\")."),
        ("1", "every rank wrote its bundle at this step and trains on (on_event=\"warn\").")], \
        proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["step00000003-rank0.nan",
                                                     "step00000003-rank1.nan"]


def test_a_ddp_window_rerun_averages_every_ranks_gradients(ddp, monkeypatch):
    """rewind=2 under DDP, rank 1's NaN sample at step 3: the window (steps 0-3) re-runs in one
    process from rank 1's bundle. Its updates used rank 1's gradients alone, not DDP's average
    over both ranks, so the re-run's losses drifted from the recorded ones from step 1 on; now
    every rank's batches are re-run and their gradients averaged, as training's were."""
    out = ddp["rewind"].out
    import replay

    monkeypatch.chdir(HERE)  # where ddp_train's factory lives
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("step00000003-rank0.nan", "step00000003-rank1.nan"):
        rep = replay.replay(out / name)
        assert rep["bundle"]["rank"] == 1 and rep["cause"] == "input", rep
        w = rep["window"]
        assert (w["copy_step"], w["steps"], w["reproduced"]) == (0, [0, 3], True)
        recorded = dict(zip(rep["history"]["steps"], rep["history"]["loss"]))
        norms = dict(zip(rep["history"]["steps"], rep["history"]["grad_norm"]))
        for s in w["per_step"][:3]:  # steps 0-2: the loss, and the gradient norm DDP's
            # all-reduce gave the update (the recorder reads it before optimizer.step())
            assert s["loss"] == pytest.approx(recorded[s["step"]], rel=1e-6), (s, recorded)
            assert s["grad_norm"] == pytest.approx(norms[s["step"]], rel=1e-5), (s, norms)
        assert w["per_step"][3]["step"] == 3
        assert rep["problems"] == []


def test_trainer_callback_on_two_ranks_in_warn_mode(tmp_path):
    """transformers.Trainer under torchrun (DDP, gloo): rank 1's all-padding batch at step 3 is
    written to its bundle, rank 0 (whose values stayed finite) learns of it at the same step
    and writes its peer bundle, in warn mode both ranks train to the end, and either bundle
    replays rank 1's step to the op in transformers' loss code."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = tmp_path / "bundles"
    proc = _torchrun("hf_ddp_train.py", out, HERE.parent)
    # the two ranks print concurrently: their lines may run into each other
    lines = dict(re.findall(r"rank (\d) (steps=\d+ event=\S+ bundle=(?:None|\S+?\.nan))",
                            proc.stdout))
    assert lines == {"0": f"steps=6 event=3/peer bundle={out / 'step00000003-rank0.nan'}",
                     "1": f"steps=6 event=3/forward bundle={out / 'step00000003-rank1.nan'}"}, \
        proc.stdout
    meta, _ = read_bundle(out / "step00000003-rank1.nan")
    assert meta["env"]["rank"] == 1 and meta["env"]["world_size"] == 2
    assert meta["factory"] == "hf_models:make_tiny_gpt2"
    rep = subprocess.run([sys.executable, "-m", "replay", "--json",
                          str(out / "step00000003-rank0.nan")],
                         capture_output=True, text=True, timeout=120, cwd=HERE.parent)
    report = json.loads(rep.stdout)
    # (the report in the message: this check failed twice in ~10 loaded runs, cause not yet seen)
    assert report["reproduced"] is True and report["cause"] == "invalid", rep.stdout[-3000:]
    assert report["origin"]["op"] == "aten.div" and report["bundle"]["rank"] == 1
    assert report["event"]["step"] == 3


def test_an_internal_error_on_one_rank_stops_every_rank_recorder_and_training_goes_on(ddp):
    """A recorder bug on rank 1 at step 3 (its RNG capture raises) switches its recorder off.
    Before, rank 1 then made no more per-step exchanges: rank 0's next one met DDP's gradient
    all-reduce and gloo aborted the training. Now rank 1 says so at that step's close, rank 0's
    recorder stops there too, and both ranks train all 10 steps, unrecorded from step 3."""
    out, proc = ddp["internal"].out, ddp["internal"]
    ends = dict(re.findall(r"rank (\d) (no event steps=\d+ active=\w+ errors=\d+)", proc.stdout))
    assert ends == {"0": "no event steps=4 active=False errors=0",
                    "1": "no event steps=3 active=False errors=1"}, proc.stdout + proc.stderr
    assert "recorder disabled after an internal error (RuntimeError: a bug in the recorder)" \
        in proc.stderr
    assert "the recorder of rank(s) 1 stopped after an internal error; this rank's stops with " \
        "it" in proc.stderr
    assert not out.exists() or not list(out.iterdir())


def test_ddp_nan_loss_on_one_rank_stops_both_at_that_step(ddp, nanreplay, tmp_path):
    """Rank 1's loss is 0/0 at step 3 with finite gradients: only rank 1 sees a NaN. The
    step's flags are all-reduced, so rank 0 raises at step 3 too (a peer event naming rank 1)
    instead of waiting in step 4's all-reduce for a rank that is gone."""
    out, proc = ddp["loss"].out, ddp["loss"]
    events = dict(re.findall(r"rank (\d) event (step=\d+ phase=\w+)", proc.stdout))
    assert events == {"0": "step=3 phase=peer", "1": "step=3 phase=loss"}, proc.stdout
    assert len(re.findall(r"rank \d first=\[1\] loop_step=3 ", proc.stdout)) == 2
    assert "rank 0 first=[1] loop_step=3 message nanreplay: rank(s) 1 saw a non-finite value " \
           "at step 3; this rank's own values were finite (step 3)." in proc.stdout
    names = sorted(p.name for p in out.iterdir())
    assert names == ["step00000003-rank0.nan", "step00000003-rank1.nan"]
    m0, _ = read_bundle(out / names[0])
    m1, _ = read_bundle(out / names[1])
    assert m0["event"]["ranks"]["run_id"] == m1["event"]["ranks"]["run_id"]
    assert m0["event"]["ranks"]["seen_by"] == [1] and m0["event"]["ranks"]["first"] == [1]
    # rank 0's bundle replays rank 1's step: its loss of all-ignored targets
    report = json.loads(nanreplay("--json", out / names[0]).stdout)
    assert report["bundle"]["rank"] == 1 and report["event"]["step"] == 3
    assert report["event"]["phase"] == "loss" and report["reproduced"] is True
    # rank 0's peer bundle alone has nothing of its own to replay: one line saying whose
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / names[0]).write_bytes((out / names[0]).read_bytes())
    rep = nanreplay(alone / names[0])
    run_id = m0["event"]["ranks"]["run_id"]
    assert rep.returncode == 2 and rep.stderr == (
        f"nanreplay: {alone / names[0]}: rank 0's own values were finite at step 3; rank(s) [1] "
        f"saw the event first, and no bundle of rank 1 of run {run_id} is beside it: copy it "
        f"into {alone}, or replay it directly\n")


def test_fsdp2_nested_nan_on_rank_1_stops_both_ranks_and_replays_unsharded(tmp_path, nanreplay):
    """FSDP2 (nested fully_shard, gloo, CPU): rank 1's blank record at step 3 makes 0/0 in
    UnsafeNorm; rank 0 only gets NaN gradient shards from the reduce-scatter. Both raise at
    step 3, each writes its bundle of local shards, and either bundle replays rank 1's step on
    the reassembled model, in this process, without torchrun."""
    out = tmp_path / "bundles"
    proc = _torchrun("fsdp_train.py", out, HERE)
    events = dict(re.findall(r"rank (\d) event (step=\d+ phase=\w+ module=\S+ first=\[[\d, ]*\] "
                             r"loop_step=\d+)", proc.stdout))
    assert events == {"1": "step=3 phase=forward module=norm first=[1] loop_step=3",
                      "0": "step=3 phase=backward module=None first=[1] loop_step=3"}, \
        proc.stdout
    assert "rank 0 rng_unchanged=True" in proc.stdout
    assert "rank 1 rng_unchanged=True" in proc.stdout
    names = sorted(p.name for p in out.iterdir())
    assert names == ["step00000003-rank0.nan", "step00000003-rank1.nan"]
    m0, t0 = read_bundle(out / names[0])
    m1, t1 = read_bundle(out / names[1])
    assert m0["event"]["ranks"]["run_id"] == m1["event"]["ranks"]["run_id"]
    # local shards (rows 0-5 on rank 0, 6-11 on rank 1 of a 12x12 weight) with their placement
    w = "weights/blocks.0.fc.weight"
    assert t0[w].shape == t1[w].shape == (6, 12)
    assert m1["shards"][w] == {"global_shape": [12, 12], "offset": [6, 0], "local_shape": [6, 12],
                               "placements": [{"shard": 0}], "mesh": [2], "mesh_dims": [],
                               "coordinate": [1]}
    assert set(m0["shards"]) == {k for k in t0 if k.startswith(("weights/", "grads/", "optim/"))
                                 and not k.endswith("/step")}
    # the user's classes, not FSDP's generated FSDPNet / FSDPBlock
    assert m0["model"]["class"] == "__main__.Net"
    assert m0["modules"][3]["type"] == "__main__.Block"
    for name in names:  # either rank's bundle: rank 1's step is replayed
        rep = nanreplay("--json", out / name)
        report = json.loads(rep.stdout)
        assert report["bundle"]["rank"] == 1 and report["event"]["step"] == 3
        assert report["reproduced"] is True and report["cause"] == "invalid"
        assert report["origin"]["module"] == "norm" and report["origin"]["op"] == "aten.div"
        assert report["origin"]["samples"] == [5]
    info = nanreplay("--info", out / names[0]).stdout
    run_id = m0["event"]["ranks"]["run_id"]
    assert (f"ranks      rank 0 of 2, run {run_id}, first seen on rank(s) [1], non-finite on "
            "[0, 1]; 24 sharded tensors; bundles of rank(s) 0, 1 beside it") in info
    # --strip copies the whole set: one stripped copy per rank, still a set
    shared = tmp_path / "shared"
    strip = nanreplay(out / names[1], "--strip", "batch", "-o", shared / "share.nan")
    assert strip.returncode == 0, strip.stderr
    assert sorted(p.name for p in shared.iterdir()) == ["share-rank0.nan", "share-rank1.nan"]
    info = nanreplay("--info", shared / "share-rank0.nan").stdout
    assert "bundles of rank(s) 0, 1 beside it" in info and "stripped   batch" in info
    # a rank's bundle alone: one line naming the ranks found and missing
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / names[0]).write_bytes((out / names[0]).read_bytes())
    rep = nanreplay(alone / names[0])
    assert rep.returncode == 2 and rep.stdout == ""
    assert rep.stderr == (f"nanreplay: {alone / names[0]}: this bundle is one of 2 ranks' shards "
                          f"of run {run_id} step 3; found rank(s) [0] beside it, missing rank(s) "
                          f"[1]: copy every rank's bundle of that step into {alone}\n")


def test_lightning_fsdp2_strategy_on_two_ranks_stops_both_and_replays(tmp_path, nanreplay):
    """Lightning's ModelParallelStrategy (FSDP2 fully_shard in configure_model, gloo, CPU) with
    the recorder's callback: rank 1's blank record at step 3 stops both ranks at step 3, and
    rank 0's bundle replays rank 1's step to the op."""
    pytest.importorskip("lightning")
    out = tmp_path / "bundles"
    proc = _torchrun("lightning_fsdp_train.py", out, HERE)
    events = dict(re.findall(r"rank (\d) event (step=\d+ phase=\w+ module=\S+ first=\[[\d, ]*\] "
                             r"global_step=\d+)", proc.stdout))
    assert events == {"1": "step=3 phase=forward module=norm first=[1] global_step=3",
                      "0": "step=3 phase=backward module=None first=[1] global_step=3"}, \
        proc.stdout + proc.stderr[-3000:]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["step00000003-rank0.nan", "step00000003-rank1.nan"]
    meta, _ = read_bundle(out / names[0])
    assert meta["recorder"]["integration"] == "lightning" and "shards" in meta
    report = json.loads(nanreplay("--json", out / names[0]).stdout)
    assert report["bundle"]["rank"] == 1 and report["event"]["step"] == 3
    assert (report["origin"]["module"], report["origin"]["op"], report["cause"]) == \
        ("norm", "aten.div", "invalid")


@pytest.mark.parametrize("mode", ["default", "guard", "exit"])
def test_fsdp2_update_nan_in_one_ranks_shard_stops_both_ranks(fsdp_update, nanreplay, mode):
    """A hand-written Adam without eps writes NaN into rows 5-9 of an embedding (rank 1's
    shard, rows never used so their gradient is 0: 0/sqrt(0)) at step 0. By default the
    update's evidence rides in step 1's check, with guard_optimizer in the update's own read,
    after a one-step loop in the with block's exit read: each carries the ranks' flags, so
    rank 0 stops at the same point with a peer event of step 0, and the two bundles are one
    set."""
    out, proc = fsdp_update[mode].out, fsdp_update[mode]
    events = dict(re.findall(r"rank (\d) event (step=.*?loop_step=\d+)", proc.stdout))
    loop, after = {"default": ("1", "True"), "guard": ("0", "False"), "exit": ("0", "True")}[mode]
    assert events == {
        "1": f"step=0 phase=optimizer params=['emb.weight'] after_update={after} first=[1] "
             f"loop_step={loop}",
        "0": f"step=0 phase=peer params=[] after_update=None first=[1] loop_step={loop}"}, \
        proc.stdout
    names = sorted(p.name for p in out.iterdir())
    assert names == ["step00000000-rank0.nan", "step00000000-rank1.nan"]
    meta, tensors = read_bundle(out / names[1])
    assert meta["state"] == ("before_update" if mode == "guard" else "after_update")
    assert tensors["weights/emb.weight"].shape == (5, 4)
    assert bool(tensors["weights/emb.weight"].isnan().all()) == (mode != "guard")
    info = nanreplay("--info", out / names[0]).stdout
    assert "first seen on rank(s) [1], non-finite on [1]" in info
    assert "bundles of rank(s) 0, 1 beside it" in info


def test_a_recorder_on_one_rank_only_fails_attach_quickly_in_one_line(tmp_path):
    """Rank 1 attaches no recorder: rank 0's attach gives up after NANREPLAY_ATTACH_TIMEOUT
    (3 s here) with one line naming rank 1, instead of its first step waiting for rank 1's
    flags until the process group's timeout (30 min)."""
    proc = _torchrun("partial_attach.py", tmp_path / "bundles", HERE.parent,
                     NANREPLAY_ATTACH_TIMEOUT="3")
    found = re.search(r"rank 0 waited=([\d.]+) error (.*)", proc.stdout)
    assert found, proc.stdout
    assert 3.0 <= float(found[1]) < 60, found[1]
    assert found[2] == (
        "FlightRecorder.attach: rank(s) [1] of 2 attached no recorder within 3s; under "
        "torch.distributed every rank must attach one (the ranks agree on each step's verdict, "
        "so one rank alone would wait for the others at every step): attach it on every rank, "
        "or set NANREPLAY_ATTACH_TIMEOUT to wait longer for ranks that attach later")
    assert not list(tmp_path.rglob("*.nan"))


def test_ddp_evaluation_forward_nan_on_one_rank_is_that_ranks_own(ddp):
    """An evaluation forward between steps (eval mode, no gradients) whose batch holds a NaN
    on rank 1 only, in warn mode: rank 1 writes its bundle there (evaluation, its input's
    sample 1), and both ranks train on. Evaluations are not agreed across ranks as steps are:
    one rank may run them alone (see the next test)."""
    out, proc = ddp["eval"].out, ddp["eval"]
    assert "rank 0 no event steps=10" in proc.stdout and "rank 1 no event steps=10" in \
        proc.stdout, proc.stdout
    assert [p.name for p in out.iterdir()] == ["step00000003-rank1.nan"]
    meta, _ = read_bundle(out / "step00000003-rank1.nan")
    ev = meta["event"]
    assert (ev["evaluation"], ev["phase"], ev["samples"]) == (True, "input", [1]), ev


def test_ddp_validation_on_rank_0_alone_does_not_hang(ddp):
    """Rank 0 alone runs evaluation forwards before step 3 (validation on rank 0: the wrapped
    model in eval mode, the unwrapped one in train mode under no_grad). Each evaluation's check
    was an all-reduce that rank 1 never joined: both ranks hung at the first validation."""
    out, proc = ddp["eval0"].out, ddp["eval0"]
    assert "rank 0 no event steps=10" in proc.stdout and "rank 1 no event steps=10" in \
        proc.stdout, proc.stdout
    assert not out.exists() or not list(out.iterdir())


def test_ddp_backward_nan_of_one_ranks_loss_is_first_seen_on_that_rank(tmp_path, nanreplay):
    """Rank 1's triplet loss makes NaN in backward (sqrt at 0) at step 3; DDP's all-reduce
    gives rank 0 the same NaN gradients. Both ranks' events were backward events of step 3,
    so both were "first": the replay took rank 0's step, finite on its own, and said
    not_reproduced. The rank whose loss sent NaN into the model output (the output's gradient
    is never all-reduced) is now first, and either bundle replays its step to the op."""
    out = tmp_path / "bundles"
    proc = _torchrun("ddp_triplet_train.py", out, HERE)
    events = dict(re.findall(r"rank (\d) event (step=\d+ phase=\w+ first=\[[\d, ]*\] "
                             r"loop_step=\d+)", proc.stdout))
    assert events == {"0": "step=3 phase=backward first=[1] loop_step=3",
                      "1": "step=3 phase=backward first=[1] loop_step=3"}, proc.stdout
    rep = nanreplay("--json", out / "step00000003-rank0.nan")
    report = json.loads(rep.stdout)
    assert report["bundle"]["rank"] == 1 and report["reproduced"] is True, rep.stdout[-3000:]
    assert (report["origin"]["phase"], report["origin"]["module"], report["origin"]["op"],
            report["cause"]) == ("backward", "<loss>", "SqrtBackward0", "invalid")


def test_fsdp2_mixed_precision_nan_replays_in_the_policys_dtype(tmp_path, nanreplay):
    """FSDP2 with MixedPrecisionPolicy(param_dtype=bfloat16): rank 1's hand-written LayerNorm
    cancels to a negative variance in bfloat16 at step 0. The replay rebuilt the float32
    model and fed it the recorded bfloat16 input: 'replay failed (RuntimeError: mat1 and
    mat2 must have the same dtype ...)'. The bundle now records each fully_shard-ed module's
    policy and the re-run computes in its dtypes: aten.rsqrt in norm, sample 5, precision."""
    out = tmp_path / "bundles"
    proc = _torchrun("fsdp_mp_train.py", out, HERE)
    events = dict(re.findall(r"rank (\d) event (step=\d+ phase=\w+ module=\S+ first=\[[\d, ]*\] "
                             r"loop_step=\d+)", proc.stdout))
    assert events == {"1": "step=0 phase=forward module=norm first=[1] loop_step=0",
                      "0": "step=0 phase=backward module=None first=[1] loop_step=0"}, \
        proc.stdout
    meta, _ = read_bundle(out / "step00000000-rank1.nan")
    fsdp = {m["name"]: m["fsdp"] for m in meta["modules"] if "fsdp" in m}
    assert fsdp == {name: {"param_dtype": "bfloat16", "output_dtype": None,
                           "cast_forward_inputs": True} for name in ("", "body")}
    rep = nanreplay("--json", out / "step00000000-rank0.nan")
    assert rep.returncode == 0, rep.stderr
    report = json.loads(rep.stdout)
    assert report["bundle"]["rank"] == 1 and report["reproduced"] is True
    assert (report["origin"]["module"], report["origin"]["op"], report["origin"]["samples"],
            report["cause"]) == ("norm", "aten.rsqrt", [5], "precision"), report["origin"]


def test_a_loss_that_gathers_every_ranks_features_is_named_not_a_failed_replay(tmp_path, nanreplay):
    """A CLIP-style loss all-gathers the ranks' features; logit_scale overflows the logits at
    step 3 on both ranks. The one-process replay re-ran the loss, whose dist.all_gather has
    no process group there: 'replay failed (ValueError: Default process group has not been
    initialized ...)', exit 2. The report is now the recorder's view, not reproduced, with a
    hint naming the call, its line, and how to make the step replayable."""
    out = tmp_path / "bundles"
    proc = _torchrun("ddp_clip_train.py", out, HERE)
    events = dict(re.findall(r"rank (\d) event (step=\d+ phase=\w+ loop_step=\d+)", proc.stdout))
    assert events == {"0": "step=3 phase=loss loop_step=3", "1": "step=3 phase=loss loop_step=3"}
    rep = nanreplay("--json", out / "step00000003-rank1.nan")
    assert rep.returncode == 1, rep.stderr
    report = json.loads(rep.stdout)
    assert report["reproduced"] is False and report["event"]["step"] == 3
    assert (report["origin"]["phase"], report["origin"]["module"]) == ("loss", "<loss>")
    line = next(i + 1 for i, text in enumerate((HERE / "ddp_clip_train.py").read_text()
                                                 .splitlines()) if "# LINE gather" in text)
    assert report["hint"].startswith(
        f"the step's code calls torch.distributed.all_gather at ddp_clip_train.py:{line}, which "
        "needs the process group of the run's 2 ranks"), report["hint"]
    assert "skip that call when torch.distributed.is_initialized() is False" in report["hint"]


def test_ddp_backward_nan_made_inside_one_ranks_model_replays_that_ranks_step(frames, nanreplay):
    """Rank 1's zero-padded frames make NaN inside the model's backward at step 3 (sqrt at 0,
    its loss and output gradient finite); the all-reduce gives rank 0 the same NaN gradient,
    so both ranks are first. nanreplay on either bundle replayed rank 0's step, finite alone:
    not_reproduced. The other first ranks' steps are now replayed too: rank 1's names
    SqrtBackward0 at the normalisation, sample 2, with a note saying why."""
    out, proc = frames["plain"].out, frames["plain"]
    events = dict(re.findall(r"rank (\d) event (step=\d+ phase=\w+ first=\[[\d, ]*\] "
                             r"loop_step=\d+)", proc.stdout))
    assert events == {"0": "step=3 phase=backward first=[0, 1] loop_step=3",
                      "1": "step=3 phase=backward first=[0, 1] loop_step=3"}, proc.stdout
    line = next(i + 1 for i, text in enumerate((HERE / "ddp_frames_train.py").read_text()
                                                 .splitlines()) if "# BUG" in text)
    for name in ("step00000003-rank0.nan", "step00000003-rank1.nan"):
        rep = nanreplay("--json", out / name)
        report = json.loads(rep.stdout)
        assert rep.returncode == 0 and report["reproduced"] is True, rep.stdout[-3000:]
        assert report["bundle"]["rank"] == 1
        o = report["origin"]
        assert (o["phase"], o["op"], o["source"], o["samples"], report["cause"]) == (
            "backward", "SqrtBackward0", f"ddp_frames_train.py:{line}", [2], "invalid"), o
        assert report["problems"] == [
            "rank(s) [0, 1] saw the event at once; a NaN that one rank's backward makes "
            "reaches every rank's gradients through the all-reduce: rank 0's step alone is "
            "finite, rank 1's makes it"]


def test_ddp_step_cut_short_by_clip_error_on_every_rank_replays_the_rank_that_made_it(
        frames, nanreplay):
    """The same NaN with clip_grad_norm_(error_if_nonfinite=True): every rank raises in the
    clip, so each checks the cut-short step alone and writes its bundle without the ranks'
    agreement. Rank 0's bundle (its NaN from the all-reduce) replayed its own step: 'NOT
    reproduced ... transient'. It now carries the run id and says it was checked alone; the
    replay tries the other ranks' bundles beside it and names rank 1's SqrtBackward0."""
    out, proc = frames["clip"].out, frames["clip"]
    assert "rank 0 clip error" in proc.stdout and "rank 1 clip error" in proc.stdout, \
        proc.stdout
    meta, _ = read_bundle(out / "step00000003-rank0.nan")
    ranks = meta["event"]["ranks"]
    assert (ranks["rank"], ranks["world_size"], ranks["first"], ranks["alone"]) == (0, 2, [], True)
    rep = nanreplay("--json", out / "step00000003-rank0.nan")
    report = json.loads(rep.stdout)
    assert rep.returncode == 0 and report["reproduced"] is True, rep.stdout[-3000:]
    assert report["bundle"]["rank"] == 1 and report["origin"]["op"] == "SqrtBackward0"
    assert report["problems"] == [
        "each rank checked the step alone (an exception cut it short); a NaN that one rank's "
        "backward makes reaches every rank's gradients through the all-reduce: rank 0's step "
        "alone is finite, rank 1's makes it"]


@pytest.fixture
def tp_plant(monkeypatch):
    """tests/dist/tp_train.py's plant (its bad step, rows and token), read from the script."""
    monkeypatch.syspath_prepend(str(HERE))
    import tp_train

    yield tp_train
    for name in ("tp_train", "fsdp_update_train", "modes"):
        sys.modules.pop(name, None)


def _tp_events(run: Run) -> dict[str, str]:
    return dict(re.findall(r"rank (\d) event (step=[^\n]*?) bundle=", run.stdout))


def test_tensor_parallel_healthy_run_is_bit_identical_with_the_recorder(tp):
    """ColwiseParallel / RowwiseParallel on a two-rank mesh: each rank's losses, printed with
    repr, are the same with and without the recorder, nothing is written or said, and the
    recorder reads the host once per step (test_recorder_sync's counter, from step 1: step 0
    also sets up)."""
    for rank in "01":
        bare = re.findall(rf"rank {rank} step \d+ loss (\S+)", tp["bare"].stdout)
        got = re.findall(rf"rank {rank} step (\d+) loss (\S+) reads (\d+)", tp["healthy"].stdout)
        assert len(bare) == 6 and [loss for _, loss, _ in got] == bare, tp["healthy"].stdout
        reads = [int(n) for _, _, n in got]
        assert [b - a for a, b in zip(reads, reads[1:])] == [1] * 5, reads
        assert f"rank {rank} no event" in tp["healthy"].stdout
    assert not tp["healthy"].out.exists() or not list(tp["healthy"].out.iterdir())
    assert tp["healthy"].stderr == ""


@pytest.mark.parametrize("mode", ["input", "shard"])
def test_tensor_parallel_nan_on_rank_1_replays_rank_1s_step(tp, tp_plant, nanreplay, mode):
    """Rank 1's batch only: a NaN row (input), or a zero row that UnsafeNorm between w1/w3
    (colwise) and w2 (rowwise) divides 0 by 0 on rank 1's slice (shard). w2's all-reduce hands
    rank 0 the NaN inside the same forward (at the FeedForward's output): rank 1 made it first
    (an earlier call), and rank 0's bundle replays rank 1's step unsharded. Before, both ranks
    counted as first (the same call index), rank 0's own step (finite) was replayed, and its
    sliced norm's statistics, compared with the unsharded re-run's, were "weights written
    outside optimizer.step()"; before that the recorder refused tensor parallelism."""
    run, p = tp[mode], tp_plant
    row = p.BAD_ROW if mode == "input" else p.ZERO_ROW
    phase, module = ("input", "") if mode == "input" else ("forward", "ff.norm")
    assert _tp_events(run) == {
        "1": f"step={p.BAD_STEP} phase={phase} module={module} samples=[{row}] params=[] "
             "first=[1]",
        "0": f"step={p.BAD_STEP} phase=forward module=ff samples=[{row}] params=[] first=[1]"}, \
        run.stdout
    meta, tensors = read_bundle(run.out / f"step{p.BAD_STEP:08d}-rank0.nan")
    assert meta["model"]["tensor_parallel"] is True
    assert meta["shards"]["weights/ff.w2.weight"]["placements"] == [{"shard": 1}]
    assert tensors["weights/ff.w2.weight"].shape == (6, 8)  # half of (6, 16)'s columns
    report = json.loads(nanreplay("--json", run.out / f"step{p.BAD_STEP:08d}-rank0.nan").stdout)
    assert report["bundle"]["rank"] == 1 and report["event"]["step"] == p.BAD_STEP
    assert report["reproduced"] is True and report["origin"]["samples"] == [row]
    if mode == "input":
        assert report["cause"] == "input"
    else:
        assert (report["origin"]["module"], report["origin"]["op"], report["cause"]) == \
            ("ff.norm", "aten.div", "invalid")


def test_tensor_parallel_optimizer_nan_in_rank_1s_shard(tp, nanreplay):
    """A row-wise embedding whose rows 5-9 (rank 1's shard) never get a gradient: an Adam
    without eps writes NaN there at step 0, on rank 1 only; rank 0 stops with a peer event and
    either bundle replays rank 1's as an optimizer event on emb.weight."""
    run = tp["update"]
    assert _tp_events(run) == {
        "1": "step=0 phase=optimizer module=None samples=[] params=['emb.weight'] first=[1]",
        "0": "step=0 phase=peer module=None samples=[] params=[] first=[1]"}, run.stdout
    report = json.loads(nanreplay("--json", run.out / "step00000000-rank0.nan").stdout)
    assert report["bundle"]["rank"] == 1 and report["cause"] == "optimizer"
    assert (report["origin"]["phase"], report["origin"]["params"]) == ("optimizer", ["emb.weight"])


def test_sequence_parallel_bundle_holds_partial_gradients_and_replays(tp, tp_plant, nanreplay):
    """SequenceParallel LayerNorm (Replicate weights whose gradients are Partial sums until
    the optimizer reduces them) in a torchtitan-style block. Rank 1 writes NaN into its first
    local embedding row (row 6 of the full weight) before a batch that looks it up. Before,
    no bundle was written ("checkpointing ... not supported for DTensor with partial
    placements"); now each rank stores its summand, the replay adds them up, and names the
    weights, the row, and the samples whose tokens read it."""
    run, p = tp["sp"], tp_plant
    ev = _tp_events(run)
    assert ev["1"].startswith(f"step={p.BAD_STEP} phase=weights ") and "first=[1]" in ev["1"], \
        run.stdout + run.stderr
    meta, tensors = read_bundle(run.out / f"step{p.BAD_STEP:08d}-rank1.nan")
    assert meta["shards"]["grads/norm.weight"]["placements"] == [{"partial": "sum"}]
    report = json.loads(nanreplay("--json", run.out / f"step{p.BAD_STEP:08d}-rank0.nan").stdout)
    tokens = tensors["batch/0/0"]
    expected = sorted({int(r) for r in (tokens == p.BAD_TOKEN).nonzero()[:, 0]})
    assert report["bundle"]["rank"] == 1 and report["cause"] == "weights"
    assert report["origin"]["samples"] == expected and report["origin"]["module"] == "tok"
    assert f"only row(s) {p.BAD_TOKEN} of 11 of tok.weight" in report["hint"]


def test_tensor_parallel_nan_of_one_ranks_slice_alone_says_what_the_replay_cannot(tp, tp_plant,
                                                                                 nanreplay):
    """Rank 1 zeroes its shard of w3: UnsafeNorm divides 0 by 0 on its slice only, which the
    unsharded replay (whose norm spans both slices) cannot make. The report says the event did
    not come back because of that, naming the module the recorder saw make it, and what to
    do, not the generic 'state outside the model' hint."""
    run, p = tp["slice"], tp_plant
    assert _tp_events(run)["1"].startswith(f"step={p.BAD_STEP} phase=forward module=ff.norm "), \
        run.stdout
    report = json.loads(nanreplay("--json", run.out / f"step{p.BAD_STEP:08d}-rank0.nan").stdout)
    assert report["bundle"]["rank"] == 1 and report["cause"] == "not_reproduced"
    assert report["hint"].startswith("the model trained tensor-parallel and the replay re-runs "
                                     "it unsharded, on the full activations (the recorder saw "
                                     "it made in 'ff.norm')"), report["hint"]


def _hook_lines(run: Run, what: str) -> list[str]:
    """Each rank's ``rank R WHAT=...`` line's value, rank 0's first."""
    return [re.search(rf"rank {r} {what}=([^\n]*)", run.stdout)[1] for r in (0, 1)]


def test_ddp_comm_hooks_train_bit_identically_with_one_host_read_per_step(commhooks):
    """fp16_compress_hook, PowerSGD (compressing from its second step) and allreduce_hook:
    each rank's losses are the same bits with and without the recorder, no event, and the
    recorder reads the host once per step (the hooks are read at an event only)."""
    for hook in HOOKS:
        run, bare = commhooks[hook], commhooks[f"{hook}-bare"]
        assert "event" not in run.stdout and run.stderr == "", run.stdout + run.stderr
        assert _hook_lines(run, "done losses") == _hook_lines(bare, "done losses"), hook
        for reads in _hook_lines(run, "reads"):
            assert reads == str(list(range(1, 7))), (hook, reads)
        assert list(run.out.iterdir()) == []


def test_fp16_compress_hook_overflow_of_finite_local_gradients_names_the_hook(commhooks,
                                                                                 nanreplay):
    """At step 2 rank 1's record 3 weighs 1e6: its local gradient is finite in float32 but
    over float16's 65504, and fp16_compress_hook's cast makes it inf, every rank's after the
    all-reduce. The replay's local backward (no hook) is finite on every rank: it said
    "not_reproduced", the gradients "written by the loop's own code". The bundle now names
    the hook, and the replay rank 1's local gradient over float16 as the overflow."""
    sys.path.insert(0, str(HERE))  # (undone by the nanreplay fixture)
    import ddp_commhook_train as H

    run = commhooks["overflow"]
    assert _hook_lines(run, "event step") == ["2 phase=backward first=[0, 1] tensor=None"] * 2
    meta, _ = read_bundle(run.out / "step00000002-rank0.nan")
    assert [h["name"] for h in meta["ddp"]["comm_hooks"]] == ["fp16_compress_hook"]
    for r in (0, 1):
        rep = nanreplay("--json", run.out / f"step{2:08d}-rank{r}.nan")
        report = json.loads(rep.stdout)
        hook = report["comm_hook"]
        assert (report["cause"], report["bundle"]["rank"], report["event"]["step"]) == (
            "overflow", 1, 2), rep.stdout[-3000:]
        assert (hook["hook"], hook["rank"], hook["dtype"], hook["cast_overflow"]) == (
            "fp16_compress_hook", 1, "float16", True)
        assert torch.finfo(torch.float16).max < hook["largest"] < H.HEAVY
        assert "fp16_compress_hook" in report["hint"] and "bf16_compress_hook" in report["hint"]
        assert "sample(s) 3 of loss_args[2]" in report["hint"]  # (the weight, w[3])
        assert "loop's own code" not in report["hint"]
        assert any("rank 1's head.bias" in p and "overflows the cast" in p
                   for p in report["problems"]), report["problems"]


def test_a_comm_hook_of_the_scripts_own_is_named_with_its_line(commhooks, nanreplay):
    """The same weight under a float16 all-reduce the script wrote (``half_allreduce``): the
    replay cannot tell what the hook does, but names it, by its line, as what made the
    gradients, each rank's local ones being finite, rather than the loop's own code."""
    run = commhooks["own"]
    assert _hook_lines(run, "event step") == ["2 phase=backward first=[0, 1] tensor=None"] * 2
    meta, _ = read_bundle(run.out / "step00000002-rank1.nan")
    line = line_number("dist/ddp_commhook_train.py", "# HOOK")
    (hook,) = meta["ddp"]["comm_hooks"]
    assert (hook["name"], hook["source"]) == ("half_allreduce", f"ddp_commhook_train.py:{line}")
    report = json.loads(nanreplay("--json", run.out / "step00000002-rank1.nan").stdout)
    assert (report["cause"], report["origin"]["source"]) == (
        "not_reproduced", f"ddp_commhook_train.py:{line}")
    assert report["comm_hook"]["hook"] == "half_allreduce" and report["comm_hook"]["dtype"] is None
    assert "communication hook half_allreduce" in report["hint"]
    assert "local gradients are finite" in report["hint"]
    assert "loop's own code" not in report["hint"]


def test_a_nan_of_one_ranks_backward_under_a_comm_hook_replays_that_rank(commhooks, nanreplay):
    """fp16_compress_hook; at step 3 rank 1's record 1 is all 0: its backward's sqrt at 0
    makes a NaN that the hook's all-reduce hands rank 0. Either bundle replays rank 1's step
    and names SqrtBackward0 on sample 1, as without a hook."""
    run = commhooks["nan"]
    assert _hook_lines(run, "event step") == ["3 phase=backward first=[0, 1] tensor=None"] * 2
    line = line_number("dist/ddp_commhook_train.py", "# BUG")
    for r in (0, 1):
        report = json.loads(nanreplay("--json", run.out / f"step{3:08d}-rank{r}.nan").stdout)
        o = report["origin"]
        assert (report["bundle"]["rank"], report["reproduced"], report["cause"]) == (
            1, True, "invalid")
        assert (o["op"], o["samples"], o["source"]) == (
            "SqrtBackward0", [1], f"ddp_commhook_train.py:{line}")


def _plant():
    """options_train's plant: (step, row) of rank 1's blank record, and the steps."""
    sys.path.insert(0, str(HERE))
    try:
        import options_train
    finally:
        sys.path.remove(str(HERE))
    return options_train.BAD_STEP, options_train.BAD_ROW, options_train.STEPS


@pytest.mark.parametrize("option", OPTIONS)
def test_ddp_and_fsdp2_options_train_bit_identically_with_the_recorder(options, option):
    """gradient_as_bucket_view, find_unused_parameters with a branch skipped at odd steps,
    FSDP2's no_sync accumulation (set_requires_gradient_sync(False)), its bf16
    MixedPrecisionPolicy, and a DCP save and load mid-run: every rank's losses and weights are
    bit-identical with the recorder, which says nothing."""
    bare, rec = options[f"{option}-bare"], options[f"{option}-rec"]
    assert rec.stdout.count("no event losses=") == 2, rec.stdout + rec.stderr[-3000:]
    assert rec.stdout == bare.stdout
    assert "nanreplay" not in rec.stderr and "Traceback" not in rec.stderr, rec.stderr[-3000:]


def test_fsdp2_no_sync_accumulation_window_rerun_uses_the_full_gradient_norm(options, nanreplay):
    """FSDP2 accumulation (rank 1's blank record in the first, unsynced micro-batch), rewind=2:
    each rank's ring holds the norm of its own gradient shards. The window re-run took that
    smaller norm for the loop's clip_grad_norm_, scaled the re-run's gradients down to it (the
    window no longer trained as training had) and said "the loop's gradient clipping to norm
    0.2499 re-applied" of a loop that never clips; now the set's norms are the full model's."""
    bad, row, _ = _plant()
    out, proc = options["fsdp-accum-rw"].out, options["fsdp-accum-rw"]
    events = dict(re.findall(r"rank (\d) event (step=\d+ phase=\w+ module=\S+ first=\S+)",
                             proc.stdout))
    assert events == {"1": f"step={bad} phase=forward module=norm first=[1]",
                      "0": f"step={bad} phase=backward module=None first=[1]"}, proc.stdout
    names = sorted(p.name for p in out.iterdir())
    rings = [read_bundle(out / n)[1] for n in names]
    local = torch.stack([t["ring/grad_norm"] for t in rings])
    report = json.loads(nanreplay("--json", out / names[0]).stdout)
    assert (report["event"]["step"], report["bundle"]["rank"], report["cause"]) == (bad, 1,
                                                                                     "invalid")
    o = report["origin"]
    assert (o["module"], o["op"], o["samples"], o["micro_batch"]) == ("norm", "aten.div", [row], 0)
    w = report["window"]
    assert (w["steps"][1], w["reproduced"], w["loop_clip"]) == (bad, True, None), w
    full = local.double().pow(2).sum(0).sqrt()  # (the shards of every parameter, once each)
    for s in w["per_step"][:-1]:
        assert s["grad_norm"] == pytest.approx(float(full[s["step"]]), rel=1e-5), s
        assert s["grad_norm"] > float(local[:, s["step"]].max()) * 1.1


def test_fsdp2_nan_after_a_dcp_resume_replays_the_resumed_step(options, nanreplay):
    """A sharded model and optimizer saved with torch.distributed.checkpoint mid-run (the
    recorder attached), loaded into fresh ones, a new recorder at start_step: rank 1's blank
    record one step after the resume stops both ranks there, and either bundle replays it."""
    _, row, steps = _plant()
    bad = steps // 2 + 1
    out, proc = options["fsdp-dcp-nan"].out, options["fsdp-dcp-nan"]
    events = dict(re.findall(r"rank (\d) event (step=\d+ phase=\w+ module=\S+ first=\S+)",
                             proc.stdout))
    assert events == {"1": f"step={bad} phase=forward module=norm first=[1]",
                      "0": f"step={bad} phase=backward module=None first=[1]"}, proc.stdout
    assert sorted(p.name for p in out.iterdir()) == [f"step{bad:08d}-rank0.nan",
                                                     f"step{bad:08d}-rank1.nan"]
    report = json.loads(nanreplay("--json", out / f"step{bad:08d}-rank0.nan").stdout)
    assert (report["event"]["step"], report["bundle"]["rank"], report["reproduced"]) == \
        (bad, 1, True)
    o = report["origin"]
    assert (o["module"], o["op"], o["samples"], report["cause"]) == ("norm", "aten.div", [row],
                                                                     "invalid")


@pytest.fixture(scope="module")
def pipeline(frames) -> dict[str, Run]:
    return {m: frames[f"pipeline_train:{m}"] for m in PIPE_MODES}


@pytest.fixture
def pp_plant(monkeypatch):
    """tests/dist/pipeline_train.py's plant, read from the script."""
    monkeypatch.syspath_prepend(str(HERE))
    import pipeline_train

    yield pipeline_train
    for name in ("pipeline_train", "modes"):
        sys.modules.pop(name, None)


def _pp_events(run: Run) -> dict[str, str]:
    return dict(re.findall(r"rank (\d) event ([^\n]*?) bundle=", run.stdout))


def test_pipeline_healthy_run_is_bit_identical_with_the_recorder(pipeline):
    """ScheduleGPipe over two stages, the recorder attached before the first step: the last
    stage's micro-batch losses are the same bits with and without the recorder on every rank's
    stage, and nothing is written or said. Before, the first step's shape inference (each
    stage's forward of torch.empty buffers) was a step-0 event on rank 1, 'reproduced' from its
    garbage as aten.log of a negative number, and rank 0, whose output's gradient comes from the
    next stage, was told to pass a loss_fn."""
    bare, run = pipeline["gpipe-bare"], pipeline["gpipe-healthy"]
    losses = re.findall(r"rank 1 step \d+ losses ([^\n]*)", run.stdout)
    assert len(losses) == 6 and losses == re.findall(r"rank 1 step \d+ losses ([^\n]*)",
                                                      bare.stdout), run.stdout
    assert "rank 0 no event" in run.stdout and "rank 1 no event" in run.stdout, run.stdout
    assert not run.out.exists() or not list(run.out.iterdir())
    assert "nanreplay" not in run.stderr, run.stderr


def test_pipeline_nan_made_in_stage_0_is_first_seen_on_rank_0(pipeline, pp_plant, nanreplay):
    """Stage 0's UnsafeNorm divides 0 by 0 on the zero row; stage 1 receives the NaN as its
    input. Before, the ranks' agreement put rank 1's input event first (an input event
    precedes any forward one) and both bundles replayed rank 1's step: 'the batch itself
    holds NaN/Inf: check the data pipeline'. A stage's received activations (leaves that
    require grad) now count as received: rank 0 is first, and either bundle replays its op."""
    run, p = pipeline["gpipe-first"], pp_plant
    size = p.BATCH // p.MICRO
    mb, row = divmod(p.BAD_ROW, size)
    assert _pp_events(run) == {
        "0": f"step={p.BAD_STEP} phase=forward module=1 samples=[{row}] first=[0]",
        "1": f"step={p.BAD_STEP} phase=input module= samples=[{row}] first=[0]"}, run.stdout
    for rank in (0, 1):
        report = json.loads(nanreplay("--json", run.out / f"step{p.BAD_STEP:08d}-rank{rank}.nan"
                                      ).stdout)
        assert report["bundle"]["rank"] == 0 and report["reproduced"] is True
        origin = report["origin"]
        assert (origin["module"], origin["op"], origin["micro_batch"], origin["samples"],
                report["cause"]) == ("1", "aten.div", mb, [row], "invalid"), report


def test_pipeline_nan_made_in_the_last_stage_replays_it_from_rank_0s_bundle(pipeline, pp_plant,
                                                                           nanreplay):
    """Schedule1F1B: stage 1's LogAct takes the log of a negative number on every row; rank 0
    sees the NaN gradient stage 1's backward sends back. Rank 1 is first, and rank 0's bundle
    replays rank 1's forward event."""
    run, p = pipeline["1f1b-last-w"], pp_plant
    rows = list(range(p.BATCH // p.MICRO))
    assert _pp_events(run) == {
        "0": f"step={p.BAD_STEP} phase=backward module=None samples=[] first=[1]",
        "1": f"step={p.BAD_STEP} phase=forward module=1 samples={rows} first=[1]"}, run.stdout
    report = json.loads(nanreplay("--json", run.out / f"step{p.BAD_STEP:08d}-rank0.nan").stdout)
    assert report["bundle"]["rank"] == 1 and report["reproduced"] is True
    assert (report["origin"]["module"], report["origin"]["op"], report["origin"]["samples"],
            report["cause"]) == ("1", "aten.log", rows, "invalid"), report
