"""What an update's eps did, said in a hint: an eps of 0 in an Adam-style update's denominator
(torch.optim's or another optimizer's; Adagrad's, RMSprop's, Adadelta's and Adamax's in their own terms), one that rounds to 0 in the weights' dtype, and
Adafactor's squared floor that does."""

from __future__ import annotations

__all__ = ["EPS0_ACCUMULATED", "EPS0_CUSTOM_UPDATE", "EPS0_UPDATE", "EPS_LOST_UPDATE", "SQUARED_EPS_LOST", "eps0_text"]

# An Adam-style update m / (sqrt(v) + eps) that made NaN with eps=0 (replay.optimizer_origin.optimizer_hint)
EPS0_UPDATE = ("with eps=0 an element whose gradients have all been exactly 0 has m = v = 0, so "
               "m / (sqrt(v) + eps) is 0/0: set eps > 0 (the default 1e-8)")
# The same for an optimizer written outside torch.optim (Sophia's m / max(rho * h, eps), Adam
# clones, Prodigy): its formula and default eps are its own, so neither is named.
EPS0_CUSTOM_UPDATE = ("with eps=0 an element whose gradients have all been exactly 0 has a "
                      "second-moment (or curvature) estimate of exactly 0, so the update divides "
                      "0 by 0 (or multiplies rsqrt(0) = inf by a gradient of 0): set eps > 0 "
                      "(that optimizer's default, or 1e-8; --try eps=1e-8 tests it)")


# torch.optim's updates that divide by an accumulated square of their own, with their own
# formula and default eps: Adam's wording would name an m and a v they do not have.
EPS0_ACCUMULATED = ("with eps=0 an element whose gradients have all been exactly 0 has {state} "
                    "of 0, so {formula} is 0/0{start}: set eps > 0 (the default {default}){more}")
ACCUMULATED = {
    "Adagrad": ("a sum of squared gradients", "grad / (sqrt(sum) + eps)", "1e-10"),
    "RMSprop": ("a square_avg", "grad / (sqrt(square_avg) + eps)", "1e-08"),
    "Adadelta": ("a square_avg and an acc_delta",
                 "sqrt(acc_delta + eps) / sqrt(square_avg + eps) * grad", "1e-06"),
    # (an infinity norm u = max(beta2 * u, |grad| + eps), no v and no sqrt)
    "Adamax": ("an exp_avg and an exp_inf", "exp_avg / max(beta2 * exp_inf, |grad| + eps)",
               "1e-08"),
}
# Adagrad's sum starts at initial_accumulator_value: 0 there leaves it 0 until a gradient comes
ADAGRAD_ACC0 = (" (the sum starts at initial_accumulator_value, here 0: an embedding row "
                "absent from every batch so far)",
                ", or start the sum above 0 (initial_accumulator_value=0.1, as TF's Adagrad "
                "and See et al.'s pointer-generator do)")


def eps0_text(cls: str, groups: list[dict] = ()) -> str:
    """EPS0_UPDATE for torch.optim's Adam-style optimizers, EPS0_ACCUMULATED for those that
    divide by an accumulated square of the gradient alone (Adagrad, RMSprop, Adadelta; for
    Adagrad with the initial_accumulator_value of ``groups`` that left its sum 0) or by an
    infinity norm of it (Adamax), EPS0_CUSTOM_UPDATE for anyone else's."""
    if not cls.startswith("torch.optim."):
        return EPS0_CUSTOM_UPDATE
    name = cls.rpartition(".")[2]
    if name not in ACCUMULATED:
        return EPS0_UPDATE
    state, formula, default = ACCUMULATED[name]
    start, more = ("", "")
    if name == "Adagrad" and any(g.get("initial_accumulator_value") == 0 for g in groups):
        start, more = ADAGRAD_ACC0
    return EPS0_ACCUMULATED.format(state=state, formula=formula, default=default, start=start,
                                   more=more)


# The same division by 0 when eps > 0 rounds to 0 in the weights' dtype (replay.optim.eps_lost)
EPS_LOST_UPDATE = ("eps={eps:g} is 0 in {dtype}, the dtype of the weights and of the optimizer "
                   "state that adds it, so an element whose v rounded to 0 (a small gradient "
                   "squared, or one always 0) divides by 0 in m / (sqrt(v) + eps): keep the "
                   "weights and optimizer state in float32 (autocast for {dtype} compute), or "
                   "set eps={safe}")

# Adafactor's floor eps1 * eps1 under its rsqrt rounded to 0 (replay.optim.squared_eps_lost)
SQUARED_EPS_LOST = ("torch.optim.Adafactor floors its factored second moment at eps1 * eps1 "
                    "before rsqrt, and eps1={eps:g} squared is 0 in {dtype}, so a row or column "
                    "whose gradients have all been exactly 0 (a feature 0 in every record, a "
                    "token never seen) has rsqrt(0) = inf, and inf * 0 = NaN. Hugging Face's "
                    "Adafactor adds eps1 to g**2 (its eps=(1e-30, 1e-3)); torch's squares it: "
                    "leave eps1 at torch's default, eps=(None, 1e-3) ({dtype}'s machine eps, "
                    "--try eps={safe} tests it)")
