"""A torch norm layer built with ``eps=0`` (a config's ``layer_norm_eps: 0.0``, timm's
``norm_layer=partial(nn.LayerNorm, eps=0)``) whose NaN came from a row of equal values: its
variance is 0 and nothing keeps the division by its root off 0. The op's generic advice ("clamp
the op's input away from the pole, or add an eps") is named by the layer's own ``eps`` setting,
the option to change, since the user's code adds no eps of its own there."""

from __future__ import annotations

from typing import Any

from .grown_number import number_attributes
from .load import Step

_NORMS = ("LayerNorm", "RMSNorm", "GroupNorm", "InstanceNorm1d", "InstanceNorm2d",
          "InstanceNorm3d")


def zero_norm_eps_hint(report: dict[str, Any], step: Step) -> None:
    """Append to the hint of an invalid NaN made in a torch norm layer whose ``eps`` is 0."""
    o = report.get("origin") or {}
    name, hint = o.get("module"), report.get("hint") or ""
    if report.get("cause") != "invalid" or not isinstance(name, str) or "eps=0" in hint:
        return
    info = next((m for m in step.meta.get("modules") or () if m.get("name") == name), {})
    kind = str(info.get("type") or "")
    if not kind.startswith("torch.nn.") or kind.rsplit(".", 1)[-1] not in _NORMS:
        return
    eps = number_attributes(step, name, built=True).get("eps")
    if type(eps) is not float or eps != 0.0:
        return
    cls = kind.rsplit(".", 1)[-1]
    rows, default = ("all 0 (a zero row: mean square 0)", "its default, None, is the dtype's "
                     "machine epsilon") if cls == "RMSNorm" else (
        "all equal (a constant row: variance 0)", "torch's default is 1e-5")
    report["hint"] = (
        f"{hint}. Here {name or 'the model'} is an nn.{cls} built with eps=0, so a sample "
        f"whose normalised values are {rows} is divided by 0: build it with eps > 0 "
        f"({default}) where its setting comes from (a config's eps, a norm_layer partial)")
