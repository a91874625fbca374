"""What an update's eps did, said in a hint: an eps of 0 in an Adam-style update's denominator
(torch.optim's or another optimizer's), one that rounds to 0 in the weights' dtype, and
Adafactor's squared floor that does."""

from __future__ import annotations

__all__ = ["EPS0_CUSTOM_UPDATE", "EPS0_UPDATE", "EPS_LOST_UPDATE", "SQUARED_EPS_LOST", "eps0_text"]

# An Adam-style update m / (sqrt(v) + eps) that made NaN with eps=0 (replay.optimizer_origin.optimizer_hint)
EPS0_UPDATE = ("with eps=0 an element whose gradients have all been exactly 0 has m = v = 0, so "
               "m / (sqrt(v) + eps) is 0/0: set eps > 0 (the default 1e-8)")
# The same for an optimizer written outside torch.optim (Sophia's m / max(rho * h, eps), Adam
# clones, Prodigy): its formula and default eps are its own, so neither is named.
EPS0_CUSTOM_UPDATE = ("with eps=0 an element whose gradients have all been exactly 0 has a "
                      "second-moment (or curvature) estimate of exactly 0, so the update divides "
                      "0 by 0 (or multiplies rsqrt(0) = inf by a gradient of 0): set eps > 0 "
                      "(that optimizer's default, or 1e-8; --try eps=1e-8 tests it)")


def eps0_text(cls: str) -> str:
    """EPS0_UPDATE for torch.optim's optimizers, EPS0_CUSTOM_UPDATE for anyone else's."""
    if cls.startswith("torch.optim."):
        return EPS0_UPDATE
    return EPS0_CUSTOM_UPDATE


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
