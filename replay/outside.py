"""A loss the replay cannot re-run: one computed outside the recorded model and outside
``loss_fn`` (a ``Trainer.compute_loss`` override, a Lightning ``training_step``'s inline
``F.mse_loss``, a loop's masked mean over an all-zero mask), or one given to ``record_loss``.

The recorder keeps the gradient that flowed into the model's output. When the model re-ran
finite and as recorded but that gradient is non-finite, the values entered from the loss: the
replay feeds the recorded gradient through the model's backward (the event comes back when the
same parameters get non-finite gradients as in the bundle) and feeds it once more with its
non-finite entries set to 0, which tells whether the model's backward makes any of its own.
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.capture import distribution_labels, flatten_tree, output_leaves
from recorder.finite import finite, kind_of

from .load import Step, output_grads
from .loss_swapped import swapped_hint
from .recorded import samples
from .rerun import Runner

ENTERED = ("the gradient entering the model's output was non-finite; the model's backward made "
           "none of its own")
# why an event of a loss the replay has nothing to re-run with was not re-run
NOT_REBUILT = "its loss cannot be rebuilt from the bundle; see the note"


def recorded_output_grads(step: Step) -> dict[int, dict[int, torch.Tensor]]:
    return {i: output_grads(step, i) for i in range(len(step.micro_batches))}


def non_finite_entries(grads: dict[int, dict[int, torch.Tensor]]) -> list[tuple[int, int]]:
    """(micro-batch, output index) of every non-finite recorded output gradient."""
    return [(i, j) for i, gs in grads.items() for j, g in gs.items() if not finite(g)]


def zeroed(grads: dict[int, dict[int, torch.Tensor]]) -> dict[int, dict[int, torch.Tensor]]:
    """The gradients with every non-finite entry replaced by 0."""
    return {i: {j: torch.where(torch.isfinite(g), g, torch.zeros((), dtype=g.dtype,
                                                                 device=g.device))
                for j, g in gs.items()} for i, gs in grads.items()}


def feed(runner: Runner, grads: dict[int, dict[int, torch.Tensor]],
         objects: list | None = None) -> list[str]:
    """Parameters with non-finite gradients after one re-run fed ``grads`` (``objects`` is
    given the re-run's model outputs)."""
    runner.out_grads = grads
    try:
        run = runner.run(instrument=False)
        if objects is not None:
            objects.extend(run.objects)
        return run.bad_grads
    finally:
        runner.out_grads = None


def _output_name(objects: list, mb: int, j: int, n_out: int) -> str:
    """`` 2``, `` (StudentT.scale)`` for a distribution's tensor, `` 1 (out["depth"])`` for a
    tensor under a dict's key (a multi-task model's heads): which output it is."""
    leaves = list(output_leaves(objects[mb])) if mb < len(objects) else []
    name = distribution_labels(objects[mb]).get(id(leaves[j])) if j < len(leaves) else None
    if name:
        return f" ({name})"
    key = _keyed_path(objects[mb], j, len(leaves)) if j < len(leaves) and n_out > 1 else None
    return f" {j} (out{key})" if key else f" {j}" if n_out > 1 else ""


def _keyed_path(obj, j: int, n: int) -> str | None:
    """The path of output leaf ``j`` when it passes through a dict's key (``["depth"]``);
    None when the paths do not line up with the leaves (objects beside the tensors)."""
    _, tensors, paths = flatten_tree(obj, "o")
    keys = list(tensors)
    if len(keys) != n:
        return None
    path = paths[keys[j]]
    return path if "[\"" in path else None


def entering_origin(step: Step, runner: Runner) -> tuple[dict[str, Any], bool] | None:
    """The origin fields and ``reproduced`` for a non-finite gradient entering the model's
    output, when the model's backward makes no non-finite value of its own; None when the
    recorded output gradients are finite, or when the model's backward also makes its own
    (then the backward analysis runs on the zeroed gradients: see :func:`zeroed`)."""
    grads = recorded_output_grads(step)
    bad = non_finite_entries(grads)
    if not bad or feed(runner, zeroed(grads)):
        return None
    got = feed(runner, grads, objects := [])
    recorded = recorded_bad_grads(step)
    if not grads_held(step):  # (nothing recorded to compare the re-run's gradients with)
        reproduced = bool(got)
    elif recorded or step.event.get("params"):
        # the recording may hold more: the loop can spread a NaN after backward (a
        # clip_grad_norm_ scales every gradient by the NaN total norm)
        reproduced = bool(got) and (set(got) <= set(recorded) if recorded else True)
    else:  # the event was that gradient itself, every parameter's staying finite: as recorded
        reproduced = not got or scrubbed(step, runner, got)  # (unless the loop zeroed them)
    mb, j = bad[0]
    g = grads[mb][j]
    n_out = len(grads[mb])
    fields = {
        "phase": "loss", "module": "<loss>", "micro_batch": mb, "made": kind_of(g),
        "detail": ENTERED, "params": got, "param": (got or [None])[0],
        "tensor": "grad of the model output" + _output_name(objects, mb, j, n_out),
        "samples": samples(step, mb).first_rows(grads[mb][k] for k in sorted(grads[mb])),
        "positions": {"non_finite": int((~torch.isfinite(g)).sum()), "of": g.numel()},
    }
    return fields, reproduced


def unrebuilt_loss(report: dict[str, Any], step: Step) -> dict[str, Any]:
    """``report`` of a gradient entering the model's output from the loss, when the step called
    a loss that could not be rebuilt (a lambda ``distance_function``: its note says why): the
    loss was not re-run, so the event is not reproduced whatever the model's backward of the
    recorded gradient gave; what the bundle holds (the samples of that gradient) stays."""
    origin = report.get("origin") or {}
    if step.loss_unrebuilt is None or step.loss_fn is not None or (
            origin.get("phase"), origin.get("module")) != ("loss", "<loss>"):
        return report  # (an origin the model's own backward made was re-run)
    if not any(isinstance(mb, dict) and mb.get("loss_inputs") for mb in step.micro_batches):
        return report  # (no loss ran in the step to re-run: GradCache's, replay.cached_grads)
    report["reproduced"] = False
    report["not_rerun"] = NOT_REBUILT
    return report


def scrubbed(step: Step, runner: Runner, got: list[str]) -> bool:
    """Whether the recorded gradients of ``got`` (non-finite after the re-run just fed the
    output gradient) are finite and 0 wherever the re-run's are NaN: the loop replaced the
    non-finite values before ``step()`` (StyleGAN2-ADA's ``nan_to_num(grad, nan=0, posinf=1e5,
    neginf=-1e5)``), so the re-run is as training's backward was."""
    params = dict(runner.model.named_parameters()) if runner.model is not None else {}
    for name in got:
        g, rec = getattr(params.get(name), "grad", None), step.tensors.get(f"grads/{name}")
        if g is None or rec is None or rec.shape != g.shape or not finite(rec):
            return False
        if not bool((rec.to(g.device)[torch.isnan(g)] == 0).all()):
            return False
    return True


SCRUBBED = (
    "the recorded gradients of {names} are finite, 0 where the re-run's are NaN: the loop "
    "replaced the non-finite gradients before optimizer.step() (torch.nan_to_num, as "
    "StyleGAN2-ADA's training loop does): without the recorder's stop, the update would have "
    "gone ahead on those values")


def scrubbed_note(step: Step, got: list[str]) -> str | None:
    """The note when the re-run's non-finite parameter gradients were recorded finite (see
    :func:`scrubbed`, which ``entering_origin`` judged)."""
    if not got or recorded_bad_grads(step) or step.event.get("params"):
        return None
    names = ", ".join(got[:3]) + (f" (+{len(got) - 3} more)" if len(got) > 3 else "")
    return SCRUBBED.format(names=names)


def grads_held(step: Step) -> bool:
    """Whether the bundle holds any parameter's gradient: none when the step closed after the
    loop cleared them (a GradScaler skipped the update, and the next iteration's
    ``zero_grad()`` ran before the forward that closed the step)."""
    return any(k.startswith("grads/") for k in step.tensors)


def recorded_bad_grads(step: Step) -> list[str]:
    """Parameters whose recorded gradient (the one the update would have used) is
    non-finite."""
    return [k.split("/", 1)[1] for k, t in step.tensors.items()
            if k.startswith("grads/") and not finite(t)]


def spread_after_backward(step: Step, got: list[str]) -> str | None:
    """A note when more parameters' recorded gradients are non-finite than the model's
    backward gives: the loop spread the value after backward."""
    extra = [n for n in recorded_bad_grads(step) if n not in set(got)]
    if not got or not extra:
        return None
    names = ", ".join(extra[:3]) + (f" (+{len(extra) - 3} more)" if len(extra) > 3 else "")
    return (f"{len(extra)} more parameters had non-finite gradients in the recording ({names}) "
            "than the model's backward gives: the loop spread the value after backward (a "
            "clip_grad_norm_ scales every gradient by the non-finite total norm)")


def loss_fn_not_called(step: Step) -> bool:
    """A loss_fn was given but no micro-batch of the step called it (nothing to re-run): a
    plain function called directly instead of as ``rec.loss_fn``, or another loss computed."""
    info = step.meta.get("loss") or {}
    return info.get("kind") in ("module", "function") and bool(step.micro_batches) and not any(
        mb.get("loss_inputs") for mb in step.micro_batches)


def loop_differentiated_forward(step: Step) -> int | None:
    """The event's micro-batch when loss_fn never took its output while it took another's,
    and the loop asked for the gradient w.r.t. its input: the gradient entering its output
    came from a loss of the loop's own, differentiated by ``torch.autograd.grad`` w.r.t. the
    input (an adversarial attack's forward), which writes no parameter's gradient."""
    i, mbs = step.event.get("micro_batch"), step.micro_batches
    if not isinstance(i, int) or not 0 <= i < len(mbs) or mbs[i].get("loss_inputs"):
        return None
    took = any(mb.get("loss_inputs") for mb in mbs)
    return i if took and mbs[i].get("grad_inputs") else None


# the loss of a forward the loop differentiated w.r.t. its input (an attack's), not loss_fn
ATTACK_LOSS = (
    "the gradient entered the model's output in micro-batch {i}, a forward whose output "
    "loss_fn never took: the loop differentiated a loss of its own there w.r.t. the model's "
    "input (torch.autograd.grad: an adversarial attack's loss), which the replay does not "
    "re-run and which wrote no parameter's gradient; look in that loss for the op (a log "
    "of a probability rounded to 0 or 1, log(1 - p), is the usual one: write it from the "
    "logits with log_softmax or logsumexp, or clamp p)")


# stable-baselines3 (recorder.sb3): the algorithm's train() computes the loss inline, of a batch
# sampled from its buffer; no module holding the network computes it (SACPolicy does not)
SB3_LOSS = (
    "stable-baselines3's algorithm computed this loss inline in its train(), which the replay "
    "cannot re-run: from the batch it sampled from its buffer (DQN's and SAC's TD target of "
    "the replay buffer's rewards, dones and next observations; PPO's and A2C's advantages and "
    "returns of the rollout buffer); the samples named are the rows of that batch whose loss "
    "gradient went non-finite: look at those transitions' rewards (an unbounded or infinite "
    "reward) and observations where the env made them, or bound the reward there (a clip, "
    "VecNormalize(norm_reward=True))")


def replayable_loss_hint(step: Step) -> str:
    """How to make the loss itself replayable, in the words of the integration that recorded
    the bundle (plain loop, Hugging Face Trainer, Lightning)."""
    info = step.meta.get("loss") or {}
    integration = (step.meta.get("recorder") or {}).get("integration")
    if (i := loop_differentiated_forward(step)) is not None:
        return ATTACK_LOSS.format(i=i)
    if loss_fn_not_called(step):
        if (swapped := swapped_hint(step)) is not None:
            return swapped
        return ("call the loss through the recorder, loss = rec.loss_fn(out, target) (a plain "
                "function cannot be hooked, so one called directly is not seen), so the replay "
                "re-runs it and names the op" if info.get("kind") == "function" else
                "compute the step's loss with the loss module given as loss_fn, so the replay "
                "re-runs it and names the op")
    if (hooks := output_hooks(step)) and step.loss_fn is not None:
        return (f"the loop put a gradient hook on the model's output (out.register_hook, "
                f"defined at {hooks[0]}) and the gradient the loss gave went through it; the "
                "loss the recorder was given re-ran finite, so look in that hook, or register "
                "it in the model's forward, where the replay runs it and names the op")
    if info.get("kind") in ("module", "function"):
        return ("the loss the recorder was given re-ran finite, so the value came from loss "
                "terms computed outside it: compute the whole loss inside loss_fn so the replay "
                "re-runs it and names the op" if step.loss_fn is not None else
                "make the loss replayable as the note says, so the replay re-runs it and names "
                "the op")
    if integration == "huggingface":
        return trainer_loss_hint(step)
    if integration == "lightning":
        return ("the training_step computed this loss inline: keep the loss module in an "
                "attribute of the LightningModule and name it, FlightRecorderCallback("
                "loss_fn=\"criterion\"), so the replay re-runs it and names the op")
    if integration == "sb3":
        return SB3_LOSS
    if held := step.meta.get("model_held_by"):
        cls, attr = held[0].get("class", "?"), held[0].get("attribute", "?")
        return (f"the loss was computed outside the recorder, and {cls.rpartition(':')[2]} "
                f"({cls}) holds the model as .{attr}: if that wrapper computes the losses (the "
                "loop calls wrapper(batch)), give it to FlightRecorder, with a factory that "
                "builds it, so the replay re-runs them and names the op; else pass the loss as "
                "FlightRecorder(..., loss_fn=...)")
    return ("the loss was computed outside the recorder: pass it as FlightRecorder(..., "
            "loss_fn=...) (a loss module, or a function called as rec.loss_fn) so the replay "
            "re-runs it and names the op; rec.record_loss(loss) at least checks its value "
            "every step. " + DOWNSTREAM)


# what else than the loss makes the gradient entering the output of a model recorded alone
DOWNSTREAM = ("Where the loop runs another network on the model's output before the loss (the "
              "seq2seq tutorial's decoder on the encoder's outputs, a head or a discriminator "
              "with an optimizer of its own), the value may be that network's: record a module "
              "that holds both, or that network with the loss as loss_fn")


def trainer_loss_hint(step: Step) -> str:
    """A Hugging Face Trainer's loss outside the model; where a package patched the model's
    forward (TRL's trainers: per-token log-probabilities), that package's trainer computed it,
    from the model's output and values the model never saw."""
    patches = [m["forward"] for m in step.meta.get("modules") or ()
               if isinstance(m, dict) and isinstance(m.get("forward"), str)]
    if patches:
        pkg = patches[0].split(".")[0]
        return (f"the model ran a forward {pkg} patched onto it ({patches[0]}), so {pkg}'s "
                "Trainer computed this loss from the model's output and values the model never "
                "took (a reference model's log-probabilities in DPO, rewards, a margin column): "
                "the model re-ran finite, so check those on these samples (a reference model "
                "loaded in float16 overflows where the policy does not)")
    return ("the Trainer computed this loss outside the model (a compute_loss override, "
            "compute_loss_func, label smoothing): pass the loss module to "
            "FlightRecorderCallback(loss_fn=...) and call it in compute_loss, or pass the "
            "labels to the model so it computes the loss itself; the replay then re-runs "
            "it and names the op")


def output_hooks(step: Step) -> list[str]:
    """Where the gradient hooks the loop put on the model's output are defined (the recorder
    lists them per micro-batch): the recorded output gradient went through them."""
    return [site for mb in step.micro_batches for site in mb.get("output_hooks", ())]


def rerun_finite_note(step: Step) -> str:
    """The note of a loss_fn the replay re-ran finite while the recorded gradient entering
    the output is not: a hook the loop put on the output, else loss terms outside loss_fn."""
    if (i := loop_differentiated_forward(step)) is not None:
        return (f"loss_fn took no output of micro-batch {i}, so the replay re-ran no loss there; "
                "the gradient the loop sent into it was taken w.r.t. the input, not the weights, "
                "so the recorded parameter gradients stayed finite")
    if hooks := output_hooks(step):
        return ("the loss_fn the replay re-ran is finite with finite gradients: the loop's "
                f"gradient hook on the model's output (defined at {hooks[0]}) changed the "
                "gradient the loss gave, and the replay does not re-run it")
    return ("the loss_fn the replay re-ran is finite with finite gradients: the loop's loss "
            "holds terms computed outside it")
