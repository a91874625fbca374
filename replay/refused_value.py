"""A distribution refusing the value ``log_prob`` was given, where that value is the batch's
data alone (nothing the model learns went into it: it needs no gradient).

ifl-tpp's log-normal mixture of inter-event times, given a padded batch's times: the pads,
and two events at the same time, are inter-event times of 0, outside a LogNormal's support
(0, inf). The fix is to those records, or to where the mask applies, not the advice for a
parameter the model makes (a scale through softplus plus a floor), which nothing here has.
"""

from __future__ import annotations


def of_data(what: str, value) -> bool:
    """``what`` the distribution refused is its value, and no gradient flows into it."""
    return what == "value" and value is not None and not value.requires_grad


def transformed_support(error: BaseException | None) -> str | None:
    """For a ``TransformedDistribution`` whose check refused a value (pytorch-forecasting's
    ``Normal`` through ``AffineTransform`` and ``ExpTransform`` or ``SoftplusTransform``, under
    a target normalizer's ``transformation="log"`` or ``"softplus"``; a ``LogNormal``): what
    sets its support, its last transform's codomain, said with the remedy where that codomain
    is the positive numbers (the data modelled through log or softplus, where 0 has no
    preimage). None for any other distribution."""
    tb = error.__traceback__ if error is not None else None
    while tb is not None:
        transforms = getattr(tb.tb_frame.f_locals.get("self"), "transforms", None)
        if tb.tb_frame.f_code.co_name == "_validate_sample" and isinstance(transforms, list) \
                and transforms:
            names = ", ".join(type(t).__name__ for t in transforms)
            last = transforms[-1]
            said = (f"; its support is the codomain of its last transform "
                    f"({type(last).__name__}, of [{names}]): {last.codomain}")
            if str(last.codomain) in _POSITIVE:
                said += (", so the data it models must be above 0: a target transformed by "
                         "log or softplus before the model (a target normalizer's "
                         "transformation=\"log\" or \"softplus\", pytorch-forecasting's "
                         "GroupNormalizer) given a 0 sold or a negative correction; use "
                         "transformation=\"log1p\" or none for data with 0s, a count "
                         "distribution (NegativeBinomialDistributionLoss), or shift the data "
                         "above 0")
            return said
        tb = tb.tb_next
    return None


_POSITIVE = ("GreaterThan(lower_bound=0.0)", "GreaterThan(lower_bound=0)")


def data_value_hint(said: str, support: str | None = None, held: str | None = None) -> str:
    """The hint after ``said`` (what was refused, and that float64 refuses it too);
    ``support``: what sets a transformed distribution's support (:func:`transformed_support`);
    ``held``: the recorded tensor holding the value (``batch["decoder_target"]``)."""
    of = f"{held}, " if held else ""
    return (f"{said}: the value given to log_prob is the batch's data alone ({of}nothing the "
            "model learns), so the samples named hold records on the support's edge or "
            "outside it (an inter-event time of 0 from two events at one time or from a "
            "padded position, a 0 under a Gamma or a LogNormal, 0 or 1 under a Beta); "
            "give log_prob a value inside the support where the mask drops the entry "
            "(dist.log_prob(torch.where(mask, x, 1)) * mask), clamp it where a 0 is a "
            "measurement floor (x.clamp_min(1e-10), as ifl-tpp does for inter-event times), "
            "or drop such records where the data is made; a softplus or a floor on the "
            "distribution's parameters does not change it" + (support or ""))
