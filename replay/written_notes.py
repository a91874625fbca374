"""The notes of weights written outside the recorded optimizer's ``step()``, which the bundle
holds as written, not as the step's forward read them: changed in the step before the update
(another optimizer's, an in-place edit), made non-finite after the forward (a SAM perturbation,
a loop's own update, a post-accumulate-grad hook's), updated by an optimizer the recorder was
not given, written by the model's own code before the first update (the recorder's
``changed_in_step``, ``written_after_forward``, ``stepped_elsewhere``, ``written_in_step``)."""

from __future__ import annotations

from .load import Step
from .user_grad_hooks import stepping_hook, where


def changed_note(names: list[str]) -> str:
    """The note for trained parameters that changed in place during the recorded step, before
    the recorded optimizer's ``step()`` (the recorder's ``changed_in_step``)."""
    return (f"{changed_params(names)}, which the recorded optimizer does not hold, changed "
            "during the step before its step() ran (another optimizer's step(), an in-place "
            "edit): the bundle holds their new values, not those the step's forward used, so "
            "the re-run may differ; call the recorded optimizer's step() first, or record the "
            "optimizer that updates them")


def late_note(names: list[str], step: Step) -> str:
    """The note for parameters the loop made non-finite after the step's forward read them
    finite (the recorder's ``written_after_forward``): between the step's forwards (a SAM
    perturbation), or, with no optimizer given, in its own update (inside backward, from
    post-accumulate-grad hooks: :func:`replay.user_grad_hooks.stepping_hook`)."""
    hook = stepping_hook(step, names)
    how = ("the loop wrote them in place between the step's forwards (SAM's w + e), from "
           "this step's gradients" if step.meta.get("optimizer") else
           f"the loop updates them inside backward, from a post-accumulate-grad hook it "
           f"registered, {where(hook)}, as each gradient is accumulated" if hook else
           "with no optimizer given, the step stays open until the next forward, through the "
           "loop's own update (p -= lr * p.grad, a master copy written back, a "
           "load_state_dict of weights it computed), which wrote them after the forward")
    return (f"{changed_params(names)} were finite when this step's forward read them and "
            f"non-finite when it was checked: {how}; the bundle holds them as it left them")


def own_update_fix(step: Step) -> str:
    """How to record a step of a loop without an optimizer that wrote the weights after its
    forward so that it can be re-run."""
    if hook := stepping_hook(step, step.event.get("written_after_forward") or []):
        return (f"the loop updates the weights inside backward ({where(hook)}), so no check "
                "comes between a gradient and its update: while you debug, step the "
                "optimizers after backward instead of in the hooks (for opt in "
                "optimizers.values(): opt.step()), or skip an update whose gradient is "
                "non-finite in the hook (if torch.isfinite(p.grad).all(): ...),")
    return ("call rec.end_step() after backward (or after torch.autograd.grad, which writes "
            "no .grad and so ends no step), before the loop's own update (or give "
            "FlightRecorder the optimizer)")


def elsewhere_note(meta: dict | None = None) -> str:
    """The note for a bundle whose weights another optimizer updated (the recorder's
    ``stepped_elsewhere``): the loop steps an optimizer the recorder was not given. When the
    recorded optimizer is a wrapper holding an inner optimizer over its parameters
    (``pytorch_optimizer``'s SAM and its ``base_optimizer``), that is the one the loop
    stepped: the wrapper's own methods (``first_step``/``second_step``) call its ``step()``
    and never the wrapper's."""
    opt = (meta or {}).get("optimizer") or {}
    inner = [(a, i) for a, i in (opt.get("inner") or {}).items() if not i.get("sharded")]
    if inner:
        attr, info = inner[0]
        cls = opt.get("class", "the optimizer").rpartition(".")[2]
        return (f"{cls}, the optimizer given to FlightRecorder, never ran its own step(): the "
                f"loop stepped the {info.get('class', '?').rpartition('.')[2]} it holds as "
                f"{attr} (a wrapper's own methods calling {attr}.step(), SAM's first_step() "
                f"and second_step()), which updated every weight after this step's forward, "
                "so the bundle holds the updated values, not those the forward used; give "
                f"FlightRecorder(model, opt.{attr}, ...) that inner optimizer and record again")
    return ("the optimizer given to FlightRecorder never stepped: the loop steps another one "
            "(created after the recorder?), which updated every weight after this step's "
            "forward, so the bundle holds the updated values, not those the forward used; give "
            "FlightRecorder the optimizer the loop steps and record again")


def written_note(names: list[str]) -> str:
    """The note for parameters the recorded step's own code made non-finite before the
    optimizer's first update (the recorder's ``written_in_step``)."""
    return (f"{changed_params(names)} were finite when the step began, before the "
            "optimizer's first update, and were made non-finite during it by the model's "
            "own code (a data-dependent initialisation in the forward, such as ActNorm's scale "
            "from the first batch): the bundle holds their new values, and the re-run writes "
            "them again as that code runs")


def changed_params(names: list[str]) -> str:
    more = f" (+{len(names) - 3} more)" if len(names) > 3 else ""
    return ("parameter " if len(names) == 1 else "parameters ") + ", ".join(names[:3]) + more
