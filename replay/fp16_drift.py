"""A float16 overflow whose values the training grew over the steps before, no batch.

An adapter trained on a frozen float16 base (LoRA's ``lora_B @ lora_A`` times ``lora_alpha /
r``, cast back to the base layer's float16) grows the layer's output with each update; the op
that overflows (a rotary embedding's add after ``q_proj``) is only where float16's maximum was
passed. The precursors show the layer past half that maximum steps before the event
(``near_fp16_max``): the hint then names the layer and the parameters under it the optimizer
trains, since a float32 cast of the one op only moves the overflow on."""

from __future__ import annotations

from typing import Any

from .load import Step

_PAST = "past half the float16 maximum"


def fp16_drift_hint(report: dict[str, Any], step: Step) -> None:
    """Append to a float16 overflow's hint the layer, at or inside the blamed module, whose
    output passed half float16's maximum at an earlier step, and the trained parameters it
    holds; nothing when another reading already explained the hint (``But ...``)."""
    o, at = report["origin"], report["event"].get("step")
    if report.get("cause") != "overflow" or o.get("dtype") != "float16" or at is None \
            or not report.get("hint") or ". But " in report["hint"]:
        return
    module = o.get("module")
    for p in report.get("precursors") or []:
        layer = (p.get("detail") or "").removeprefix("absmax of ").partition(" is ")[0] \
            .partition(" (call ")[0]  # (a module called more than once: one of its series)
        if p.get("kind") != "near_fp16_max" or p.get("step", at) >= at or not _within(
                layer, module):
            continue
        trained = _trained_under(step, layer)
        if not trained:
            continue
        names = ", ".join(trained[:2]) + (f" (+{len(trained) - 2} more)" if len(trained) > 2
                                           else "")
        report["hint"] = (
            f"{report['hint']}. But no batch of this step made the values: {layer}'s output "
            f"was already {_PAST} at step {p['step']} (see precursors) and grew with the "
            f"updates since, of the parameters under it that the optimizer trains ({names}); "
            "a float32 cast of this op only moves the overflow on: lower the learning rate "
            "or the scale their output is multiplied by (a LoRA adapter's lora_alpha / r), or "
            "compute that layer in float32")
        return


def _within(layer: str, module: str | None) -> bool:
    """``layer`` is the blamed module or one of its submodules."""
    return module is not None and (layer == module or not module
                                   or layer.startswith(f"{module}."))


def _trained_under(step: Step, layer: str) -> list[str]:
    """The parameters under ``layer`` the recorded optimizer holds."""
    opt = step.meta.get("optimizer") or {}
    held = [n for g in opt.get("param_groups") or [] for n in g.get("params") or []]
    return [n for n in held if n.startswith(f"{layer}.")]
