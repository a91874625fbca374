"""What an op was given where it went non-finite: its pole or domain edge, in words.

The ops' mathematics, apart from deciding the cause (:mod:`replay.cause`): which ops have
neither a pole nor a domain edge (from finite inputs only a result too large for the type is
non-finite), and, for the others, what the op's inputs were at the non-finite positions
(``aten.log of 0``, ``aten.sqrt of a negative number``, a CTC target with too few frames) and
which advice of :data:`replay.cause_text.DO` fits.
"""

from __future__ import annotations

import torch

from .equal_rows import equal_rows_text
from .folded_jacobian import fold_exit, folds
from .hits import Evidence
from .m_matrix import m_matrix_exit, z_matrix
from .scaled_log import BESSEL
from .singular_solve import SOLVES, singular_solve
from .singular_values import singular_divisor

# Ops with neither a pole nor a domain edge: from finite inputs, only a result too large for
# the type is non-finite (a NaN is inf - inf inside the op's own sum).
_NO_POLE = {"exp", "exp2", "expm1", "mul", "add", "sub", "sum", "mean", "mm", "bmm", "addmm",
            "matmul", "baddbmm", "addbmm", "addmv", "mv", "dot", "linear", "convolution",
            "_convolution", "cumsum", "prod", "cumprod", "sinh", "cosh", "square", "einsum",
            "_to_copy", "copy_", "linalg_vector_norm", "norm", "ldexp", "addcmul", "lerp",
            "_softmax", "_log_softmax", "logsumexp", "mul_", "add_", "sub_", "exp_",
            "linalg_matrix_exp", "matrix_exp", "soft_margin_loss"} | BESSEL
# (NOTEARS' tr(exp(W * W)); SoftMarginLoss's log(1 + exp(-y * x)), its exp taken as is)


# Ops whose derivative has a pole (a backward node's lower-cased name, ``SqrtBackward0``:
# ``sqrt``): an infinite gradient from finite incoming ones means an input at the pole.
_DERIVATIVE_POLES = {"sqrt", "rsqrt", "log", "log2", "log10", "log1p", "div", "reciprocal",
                     "pow", "acos", "asin", "atanh", "acosh", "erfinv", "xlogy", "norm",
                     "linalgvectornorm", "cdist", "dist", "std", "var", "hypot"}


# Backward nodes of decompositions whose gradient divides by the gaps between the values
# (1/(λi − λj) for eigenvectors, 1/(σi² − σj²) for singular vectors): infinite at a tie.
_GAP_DERIVATIVES = {"linalgeigh": ("eigh", "eigenvalues"), "linalgeig": ("eig", "eigenvalues"),
                    "linalgsvd": ("svd", "singular values"),
                    "svdhelper": ("svd", "singular values")}


def value_gap(name: str) -> tuple[str, str] | None:
    """For backward node ``name`` (lower case, no ``Backward0``) of an eigen, singular value or
    QR decomposition: where its derivative is infinite, in words, and the advice (a ``DO``
    key); else None."""
    if name == "linalgqr":
        return ("the gradient of qr divides by the diagonal of its R factor, infinite where "
                "the input's columns are linearly dependent (a repeated or zero column: a "
                "rank-deficient input)", "qr_rank")
    if name not in _GAP_DERIVATIVES:
        return None
    op, values = _GAP_DERIVATIVES[name]
    return (f"the gradient of {op}'s vectors divides by the differences between its {values}, "
            f"infinite where two are equal (repeated {values}: a matrix with a symmetry, "
            "identical rows or samples, a rank-deficient or scaled-identity input, a learned "
            "matrix initialised to the identity, a graph Laplacian with isolated or padded "
            "nodes or several connected components)", "value_gap")


def g(x: float) -> str:
    """A number as the reports print it: three significant digits."""
    return format(x, ".3g")


def g_pair(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` with three significant digits, or as many more as it takes for two
    different numbers not to print alike: 65535 cast to float16 must not read as beyond
    float16's largest value when both print as 6.55e+04."""
    for digits in range(3, 18):
        sa, sb = format(a, f".{digits}g"), format(b, f".{digits}g")
        if sa != sb or a == b:
            return sa, sb
    return repr(a), repr(b)


def g_apart(x: float, *others: float) -> str:
    """``x`` with three significant digits, or as many more as it takes not to read as one of
    ``others`` (a domain edge, the value float64 has): acos of 1.00000012, rounded from a
    cosine of unit vectors, must not print as acos of 1, which is inside the domain."""
    for digits in range(3, 18):
        s = format(x, f".{digits}g")
        if x in others or float(s) not in others:
            return s
    return repr(x)


def given(ev: Evidence, i: int) -> list[float]:
    """The values input ``i`` had where the op went non-finite (a few)."""
    return [float(v) for v in ev.inputs[i].flatten()[:8]]


def never_a_pole(name: str) -> bool:
    """Op ``name`` (``"exp"``; ``"softmax"`` for ``_softmax``) has no pole or domain edge for
    any input: an infinity it made is an overflow."""
    return name in _NO_POLE or f"_{name}" in _NO_POLE


def derivative_pole(name: str) -> bool:
    """Backward node ``name`` (lower case, no ``Backward0``) has a derivative with a pole."""
    return name in _DERIVATIVE_POLES


def no_pole(name: str, ev: Evidence) -> bool:
    """Whether op ``name`` (``"log"``, no ``aten.``), given these values, can only have made a
    non-finite value by a result too large for its type."""
    if ev.empty:
        return False  # a reduction over nothing: 0/0
    if name in _NO_POLE:
        return True
    ins = [v for v, e in zip(ev.inputs, ev.elementwise) if e]
    if name in ("pow", "pow_") and ins:
        b = scalar_base(ev)
        if b is not None:  # number ** tensor: only a positive base is free of poles and NaN
            return b > 0
        p = exponent(ev)
        if p is not None and (p >= 0 and (float(p).is_integer() or bool((ins[0] >= 0).all()))):
            return True  # x**2, x**3, sqrt-like powers of non-negatives: only too large
        return bool((ins[0] > 0).all())  # a positive base: only too large a power
    if name in ("div", "div_") and len(ins) >= 2:
        return bool((ins[1] != 0).all())  # no division by 0: only too large a quotient
    if name in ("addcdiv", "addcdiv_") and len(ins) >= 3:  # x + value * t1 / t2: t2 divides
        return bool((ins[2] != 0).all())  # (ADOPT's g / max(sqrt(v), eps) past float16's max)
    return False


def exponent(ev: Evidence) -> float | None:
    """The scalar exponent of ``pow(tensor, number)``, else None."""
    args = list(ev.args)
    p = args[1] if len(args) > 1 else None
    return float(p) if isinstance(p, (int, float)) and not isinstance(p, bool) else None


def scalar_base(ev: Evidence) -> float | None:
    """The base of ``pow(number, tensor)`` (a rotary cache's ``base ** (i / d)``), else None:
    there the floating input is the exponent, not the base."""
    args = list(ev.args)
    b = args[0] if args else None
    return float(b) if isinstance(b, (int, float)) and not isinstance(b, bool) else None


_FEW = ("of too few values for its correction (a division by n - correction = 0)", "few")
# ops whose non-finite value from finite inputs has one reading: what, and the DO key
_FIXED = {"var": _FEW, "std": _FEW, "var_mean": _FEW, "std_mean": _FEW,
          "segment_reduce": ("over a segment with no element (length 0: its mean is 0/0, its "
                             "max -inf)", "empty_group")}


def describe(name: str, ev: Evidence) -> tuple[str, str]:
    """What the op was given where it went non-finite, and which advice fits (a ``DO`` key)."""
    op = f"aten.{name}"
    ins = [v for v, e in zip(ev.inputs, ev.elementwise) if e] or ev.inputs
    x = ins[0] if ins else torch.empty(0, dtype=torch.float64)
    zero, neg = bool((x == 0).any()), bool((x < 0).any())
    low = g(float(x.min())) if x.numel() else "?"
    base = name.rstrip("_")
    if ev.empty:
        return f"{op} of an empty tensor (a mean over no element is 0/0)", "few"
    if base in _FIXED:
        return f"{op} {_FIXED[base][0]}", _FIXED[base][1]
    if (matrix := _of_matrix(op, base, ev)) is not None:
        return matrix
    if base in SOLVES:  # (a zero pivot, reported in info: replay.singular_solve)
        return singular_solve(op), "singular"
    if "ctc_loss" in base:
        return _ctc(ev), "ctc"
    if (low_var := _negative_running_var(base, ev)) is not None:
        return (f"{op} in eval mode with a negative running variance (as low as "
                f"{g(low_var)}): the square root of running_var + eps", "running_var")
    if base.startswith("nll_loss") and ev.others and bool((ev.others[0] == 0).all()):
        return _no_target(op, ev)
    if base in ("log", "log2", "log10", "xlogy", "special_xlog1py"):
        x = ins[-1] if base == "xlogy" and ins else x
        zero, neg = bool((x == 0).any()), bool((x < 0).any())
        if neg:
            return f"{op} of a negative number (as low as {g(float(x.min()))})", "log_domain"
        return f"{op} of 0 (log has a pole at 0: -inf)", "pole"
    if base == "log1p":  # (its bound is -1, below too: the generic clamp_min(eps) is not it)
        return ((f"{op} of a number below -1 (as low as {low})", "log1p_pole") if bool(
            (x < -1).any()) else (f"{op} of -1 (a pole: -inf)", "log1p_pole"))
    if base == "logit" and x.numel():
        return _logit(op, x)
    if base == "sqrt":
        return f"{op} of a negative number (as low as {low})", "domain"
    if base in ("rsqrt", "reciprocal"):
        return _inverse(op, ev, low, neg and not zero)
    if base == "addcdiv" and len(ins) >= 3 and bool((ins[2] == 0).any()):
        return _update_quotient(op, ins)
    den = None
    if base in ("div", "remainder", "fmod") and ins:
        den = ins[1] if len(ins) >= 2 else _divisor_not_taken(ev)
    if den is not None:
        return _division(op, ev, ins, den)
    if base == "pow" and ins:
        return _pow(op, ev, zero)
    if base in ("acos", "asin", "atanh") and x.numel():
        return _unit(op, base, x)
    if base == "acosh" and x.numel():  # (x.clamp_min(eps), the generic advice, is below 1)
        return (f"{op} of a number below 1 (as low as {g_apart(float(x.min()), 1.0)})",
                "acosh")
    if ins and (zero or neg):
        return (f"{op} of {'0' if zero else 'a negative number'} (at a pole or outside its "
                "domain)", "pole" if zero else "domain")
    return f"{op} at a pole or outside its domain", "pole"


def _inverse(op: str, ev: Evidence, low: str, negative: bool) -> tuple[str, str]:
    """1/x and 1/sqrt(x) at 0 or below. A 0-d divisor (``c / (x.max() - x.min())``, GPyTorch's
    ``ScaleToBounds`` over features all equal) is one value for every element, a statistic
    over the batch: no row to skip, the total's advice."""
    if negative:
        return f"{op} of a negative number (as low as {low})", "domain"
    # (one made of the weights or the data alone keeps the advice that says so)
    one = ev.zero_dim[:1] == [True] and not (ev.of_weights or ev.of_data)
    return f"{op} of 0 (a pole: 1/0){' in a 0-d divisor' if one else ''}", \
        "divide_total" if one else "divide"


def _unit(op: str, base: str, x: torch.Tensor) -> tuple[str, str]:
    """acos, asin (domain [-1, 1]) and atanh (poles at -1 and 1)."""
    top = float(x[x.abs().argmax()])
    advice = "atanh" if base == "atanh" else "unit"
    if base == "atanh" and abs(top) == 1:  # (both poles where rows hit both: +-inf)
        both = bool((x == 1).any()) and bool((x == -1).any())
        return f"{op} of {'-1 and 1 (its poles)' if both else g(top) + ' (a pole)'}", advice
    edge = "[-1, 1]" if base != "atanh" else "(-1, 1)"
    return f"{op} of a number outside {edge} ({g_apart(top, 1.0, -1.0)})", advice


def _update_quotient(op: str, ins: list[torch.Tensor]) -> tuple[str, str]:
    """``addcdiv``'s ``x + value * t1 / t2`` at t2 = 0 (an Adam-style update's
    ``m / (sqrt(v) + eps)``): t2 divides; the weights ``x`` are at no pole, whatever their
    sign (it said "of a negative number", the weights', and a root's advice)."""
    both = bool(((ins[1] == 0) & (ins[2] == 0)).any())
    return f"{op} of {'0 by 0 (0/0)' if both else 'x by 0 (x/0, a pole)'} in t1 / t2", "divide"


def _logit(op: str, x: torch.Tensor) -> tuple[str, str]:
    """logit(p) = log(p / (1 - p)): poles at 0 and 1, NaN outside [0, 1]."""
    out = x[(x < 0) | (x > 1)]
    if out.numel():
        return f"{op} of a number outside [0, 1] ({g(float(out[0]))})", "logit"
    ends = [e for e, at in (("0", x == 0), ("1", x == 1)) if bool(at.any())]
    return f"{op} of {' and '.join(ends) or 'an end of [0, 1]'} (its poles: -inf at 0, +inf at 1)", \
        "logit"


def _division(op: str, ev: Evidence, ins: list[torch.Tensor],
              den: torch.Tensor) -> tuple[str, str]:
    """A division by 0 (0/0 where the numerator is 0 too), and which advice fits."""
    # a Python number: a setting or its complement (keep_prob = 1 - p at p = 1), not data;
    # an int one is a count or a size (int(mask.sum()), a token count passed to the loss,
    # W - 1 of a one-pixel feature map)
    second = _second(ev)  # (an integer divisor is no floating input: a token count's sum())
    by, key, read = "", "divide", ""
    if len(ins) < 2 and isinstance(second, (int, float)) and not isinstance(second, bool):
        by, key = " the number", "divide_count" if isinstance(second, int) else "divide_number"
        if key == "divide_number" and second in ev.read:
            # a float .item() read (DETR's num_boxes.item()): a count or total the step
            # computed, advised on as the 0-d tensor it was read from
            key, read = "divide_total", " that .item() read from a tensor"
    if key == "divide" and (ev.zero_dim[1:2] == [True] or (
            len(ins) < 2 and isinstance(second, torch.Tensor) and second.dim() == 0)):
        # one value for every element: a count or a statistic over the batch (a Cox loss's
        # events.sum() over an all-censored batch), no row of which is to blame
        key = "divide_total"
    if key == "divide" and (cols := _whole_columns(ev.bad)):
        # the same features of every row: a divisor reduced over the batch (z.std(0)) was 0
        # there, a feature constant over the batch, which no row is to blame for
        what = "0 by 0 (0/0)" if bool(((ins[0] == 0) & (den == 0)).any()) else "x by 0"
        return (f"{op} of {what} in the same column(s) {cols} of every one of the "
                f"{ev.bad.numel() // ev.bad.shape[-1]} rows: {BATCH_STATISTIC}", "divide_feature")
    if bool(((ins[0] == 0) & (den == 0)).any()):
        return f"{op} of 0 by{by} 0{read} (0/0)", key
    return f"{op} by{by} 0{read} (x/0, a pole)", key


# what a 0/0 in whole columns says of its divisor (replay.kept_divisor names buffers instead)
BATCH_STATISTIC = "a divisor that is a statistic over the batch (z.std(0), a feature's norm) was 0 there"


def _whole_columns(bad: torch.Tensor) -> list[int] | None:
    """The columns (last dim) of a ``(rows, features)`` mask that are bad in every row, when
    they are all it holds and some columns are good; else None. Leading dims are rows too
    (``(B, T, features)``: a neuron's counts over its rate in the batch, every bin of it)."""
    if bad.dim() not in (2, 3) or bad.shape[-1] == 0 or bad.numel() // bad.shape[-1] < 2:
        return None
    bad = bad.reshape(-1, bad.shape[-1])
    cols = bad.all(0)
    if not bool(cols.any()) or bool(cols.all()) or not torch.equal(bad, cols.expand_as(bad)):
        return None
    return cols.nonzero().flatten().tolist()[:8]


def _of_matrix(op: str, base: str, ev: Evidence) -> tuple[str, str] | None:
    """A log-determinant's, an op given a failed Cholesky factor's pivot or svd's singular
    value of 0 (see :mod:`replay.factors`): what it was given, and the advice; else None."""
    if base in ("logdet", "_linalg_slogdet", "linalg_slogdet", "slogdet"):
        # (in the type it ran in: float64 may give a matrix float32 made indefinite a sign > 0)
        det = _log_determinant(op, ev.inputs[0].to(ev.input_dtypes[0]) if ev.inputs else None)
        # (a determinant of 0, not one rounding made negative: are two rows the same?)
        rows = equal_rows_text(op, ev.inputs[0], ev.bad) if det[1] == "singular" and ev.inputs \
            else None
        return rows or det
    # (the one at or below 0: a condition number s[0] / s[-1] has singular values on both sides)
    made = [(v, f) for v, e, f in zip(ev.inputs, ev.elementwise, ev.factor)
            if e and f and bool((v <= 0).any())]
    if not made:
        return None
    (v, kind), dt = made[0], str(ev.dtype).removeprefix("torch.")
    if kind == "singular_values":  # (a division's divisor: 0 only, singular values are >= 0)
        return singular_divisor(op, g(float(v.min())))
    if kind == "built_factor":
        return (f"{op} of a triangular factor's diagonal entry of {g(float(v.min()))}, a "
                "factor the code built itself (diag_embed of a raw diagonal: a Cholesky "
                "parametrisation of a mass, covariance or precision matrix) whose diagonal "
                "nothing kept positive", "built_factor")
    if kind == "cholesky":
        return (f"{op} of a Cholesky factor's diagonal entry of {g(float(v.min()))}: "
                "linalg.cholesky_ex met a pivot <= 0 there (the matrix is not positive-definite "
                f"in {dt}) and left it in the factor, saying so only in its info", "cholesky")
    return (f"{op} of eigh's eigenvalue {g(float(v.min()))}: a positive semi-definite matrix "
            "(a covariance, a Gram matrix) has eigenvalues >= 0, but those of a singular one "
            f"are 0 in exact arithmetic and rounding in {dt} leaves them slightly negative",
            "eigenvalues")


def own_factor_sign(op: str, ev: Evidence) -> str | None:
    """A log-determinant's NaN that float64 does not make on the very same input (``local64``
    finite): the matrix is positive-definite as given, and the op's own LU factorisation in
    its type rounded the determinant of a near-singular one below 0 (which factorisation
    kernel runs decides where); None for any other op or input."""
    if op.removeprefix("aten.") not in ("logdet", "_linalg_slogdet", "linalg_slogdet", "slogdet") \
            or not ev.inputs or ev.inputs[0].dim() < 2 \
            or ev.inputs[0].shape[-1] != ev.inputs[0].shape[-2]:
        return None
    x = ev.inputs[0]
    sign, logabs = torch.linalg.slogdet(x.to(ev.input_dtypes[0]))
    sign64, logabs64 = torch.linalg.slogdet(x.double())
    neg = (sign < 0) & (sign64 > 0)
    if not bool(neg.any()):
        return None
    dt = str(ev.input_dtypes[0]).removeprefix("torch.")
    det, det64 = -float(logabs[neg].min().exp()), float(logabs64[neg].min().exp())
    return (f"{op} of a matrix whose determinant is negative ({g(det)}) in {dt}'s own "
            f"factorisation and positive ({g(det64)}) in float64 on the very same input: no "
            f"value left {dt}'s range, but rounding in the op pushed a near-singular matrix's "
            "determinant across 0")


def _log_determinant(op: str, x: torch.Tensor | None) -> tuple[str, str]:
    """The log-determinant of a matrix whose determinant is negative (``logdet``'s NaN) or
    0 (``-inf``), given the whole matrix (a composite function's input, see
    :mod:`replay.composite`) or not (then only a singular one makes a non-finite log)."""
    if x is not None and x.dim() >= 2 and x.shape[-1] == x.shape[-2]:
        sign, logabs = torch.linalg.slogdet(x)
        if bool((sign < 0).any()):
            det = -float(logabs[sign < 0].min().exp())
            if z_matrix(x[sign < 0]):  # (DAGMA's s I - W * W: an M-matrix no longer)
                return m_matrix_exit(op, g(det))
            if folds(x):  # (det(I + grad u) per voxel: a deformation that folds)
                return fold_exit(op, g(det))
            return (f"{op} of a matrix whose determinant is negative ({g(det)}): the log of "
                    "a negative number", "log_det")
    return f"{op} of a singular matrix (determinant 0, whose log is -inf)", "singular"


def _pow(op: str, ev: Evidence, zero: bool) -> tuple[str, str]:
    """A power's pole (0 to a negative power) or domain edge (a negative base to a fractional
    power), for a tensor base or a number's (``base ** (i / d)``, a rotary cache)."""
    b = scalar_base(ev)
    if b is not None:
        zero, what = b == 0, f"a negative base ({g(b)})"
    else:
        p, what = exponent(ev), "a negative number"
        zero = zero and (p is None or p < 0)
    if zero:
        return f"{op} of 0 to a negative power (a pole)", "power_pole"
    return f"{op} of {what} to a fractional power", "power_domain"


# batch norm's aten ops: their running_var, the last floating input, is used when not training
_BATCH_NORMS = {"native_batch_norm": 5, "_native_batch_norm_legit": 5,
                "_native_batch_norm_legit_no_training": None, "cudnn_batch_norm": 5,
                "miopen_batch_norm": 5}


def _negative_running_var(base: str, ev: Evidence) -> float | None:
    """The lowest entry of a batch norm's running_var when the op normalised with it (eval
    mode, or a BatchNorm frozen in eval) and it is negative (below -eps); else None."""
    if base not in _BATCH_NORMS or not ev.inputs:
        return None
    at, args = _BATCH_NORMS[base], list(ev.args)
    if at is not None and (len(args) <= at or args[at] is not False):
        return None  # training: the batch's own variance, never negative
    var = ev.inputs[-1]
    eps = args[-1] if args and isinstance(args[-1], float) else 0.0
    return float(var.min()) if var.numel() and bool((var + eps < 0).any()) else None


def _second(ev: Evidence):
    args = list(ev.args)
    return args[1] if len(args) > 1 else None


def _divisor_not_taken(ev: Evidence) -> torch.Tensor | None:
    """A divisor the evidence's floating inputs leave out, in float64, where the output went
    non-finite: an integer tensor (``x / mask.sum(1)``) or a Python number (``x / self.t``, a
    temperature a schedule brought to 0); None otherwise."""
    args = list(ev.args)
    d = args[1] if len(args) > 1 else None
    if isinstance(d, (int, float)) and not isinstance(d, bool):
        return torch.full((int(ev.bad.sum()),), float(d), dtype=torch.float64)
    if not isinstance(d, torch.Tensor) or d.is_floating_point() or d.is_complex():
        return None
    try:
        return torch.broadcast_to(d.detach().cpu(), ev.bad.shape)[ev.bad.cpu()].double()
    except RuntimeError:
        return None


def _ctc(ev: Evidence) -> str:
    """Which row of a CTC loss cannot be aligned: its target needs more frames than its input
    has (one per label, plus a blank between repeated labels)."""
    args = list(ev.args) + [None] * 4
    targets, in_len, tg_len = args[1], args[2], args[3]
    rows = ev.bad.nonzero().flatten().tolist() if ev.bad.dim() == 1 else []
    text = ("CTC loss of a target that cannot be aligned to its input (longer than the input, "
            "counting a blank between repeated labels): an impossible value, +inf")
    try:
        in_len, tg_len = [int(v) for v in in_len], [int(v) for v in tg_len]
        i = rows[0]
        if isinstance(targets, torch.Tensor) and targets.dim() == 2:
            tgt = targets[i, :tg_len[i]].tolist()
        elif isinstance(targets, torch.Tensor):
            start = sum(tg_len[:i])
            tgt = targets[start:start + tg_len[i]].tolist()
        else:
            return text
        need = len(tgt) + sum(1 for a, b in zip(tgt, tgt[1:]) if a == b)
    except (TypeError, IndexError, ValueError):
        return text
    if need > in_len[i]:
        text += (f"; row {i}: target of {len(tgt)} labels needs {need} frames, the input has "
                 f"{in_len[i]}")
    return text


def _no_target(op: str, ev: Evidence) -> tuple[str, str]:
    """Why a mean nll_loss's total target weight is 0: every target is ``ignore_index``, or
    the targets left are all of classes the ``weight`` argument gives 0 (a background class
    weighted 0, a crop of background only)."""
    args = list(ev.args) + [None] * 5
    target, ignore = args[1], args[4]
    text = f"{op} divided by a total target weight of 0 (0/0)"
    if not isinstance(target, torch.Tensor) or not isinstance(ignore, int):
        return f"{text}: every target of the batch is ignored (ignore_index)", "no_target"
    kept = target[target != ignore]
    if not kept.numel():
        return f"{text}: every target of the batch is ignore_index ({ignore})", "no_target"
    classes = kept.unique().tolist()
    return (f"{text}: the batch's {kept.numel()} targets that are not ignore_index ({ignore}) "
            f"are all of class{'es' if len(classes) > 1 else ''} {_listed(classes)}, whose "
            "weight is 0"), "zero_weight"


def _listed(v: list[int]) -> str:
    return ", ".join(str(c) for c in v[:8]) + (", ..." if len(v) > 8 else "")
