"""The words for each cause: one table, read by the text, JSON and HTML reports.

``MEANING`` says in one line what each cause means (the HTML verdict shows it, the guide's
table says the same); ``HINTS`` holds what to do, the report's ``hint`` when nothing more
specific is known. :mod:`replay.cause` builds the specific hint of an op (which pole, which
type overflowed, what float64 held) from the phrases below, so every report says it the same
way. No torch here: the HTML page renders from a report alone.
"""

from __future__ import annotations

from recorder.errors import first_line

from .equal_rows import ADVICE as EQUAL_ROWS
from .factors import BUILT_FACTOR
from .folded_jacobian import ADVICE as FOLD
from .log_domain import ADVICE as LOG_DOMAIN
from .m_matrix import ADVICE as M_MATRIX
from .singular_values import ADVICE as SINGULAR_VALUES

CAUSES = ("input", "weights", "optimizer", "invalid", "overflow", "underflow", "precision",
          "not_reproduced")

MEANING = {
    "input": "the input batch already held non-finite values",
    "weights": "the parameters were already non-finite before the step",
    "optimizer": "the optimizer update made the parameters non-finite",
    "invalid": "an op made NaN/Inf that exact arithmetic makes too: a pole (log(0), x/0) or "
               "an impossible value (log of a negative, 0/0, inf - inf)",
    "overflow": "an op's true result is finite but too large for its dtype",
    "underflow": "a value rounded to 0 that exact arithmetic keeps non-zero, then fed into "
                 "log or a division",
    "precision": "rounding pushed a value across a domain boundary exact arithmetic does not "
                 "cross (a cancelled variance below 0)",
    "not_reproduced": "replaying the step from the bundle did not make a non-finite value",
}

HINTS = {
    # (an augmentation the loop runs on the batch, the Kornia tutorial's, is outside what is
    # re-run: its op can be named only from inside the model's forward)
    "input": "the batch itself holds NaN/Inf: check the data pipeline for these samples "
             "(bad files, division by zero in normalisation, an augmentation the loop ran on "
             "the batch: called in the model's forward, nanreplay re-runs it and names its op) "
             "or filter them before the model",
    "weights": "the weights were already non-finite when the step began, and no recorded "
               "update wrote them: find what writes weights outside optimizer.step() "
               "(checkpoint loading, in-place edits) and resume from an earlier checkpoint",
    "optimizer": "finite gradients became non-finite weights in optimizer.step(): check the "
                 "learning rate and schedule, eps, and clip gradients",
    "invalid": "invalid math that exact arithmetic makes too: guard the op's domain (clamp "
               "before log/sqrt, add eps to denominators, avoid fully masked softmax rows)",
    "overflow": "a result too large for its dtype: rescale, compute the op in a wider type, "
                "clamp its input range, lower the learning rate, or clip",
    "underflow": "a value rounded to 0 was fed into log or a division: compute in log space "
                 "(log_softmax, logsumexp) or clamp the value away from 0",
    "precision": "rounding crossed a domain boundary: use a numerically stable formula "
                 "(torch.var, centre before squaring) or clamp to the domain",
    "not_reproduced": "re-running the step did not give the same result: suspect "
                      "nondeterminism or a transient hardware fault; re-run on another device",
    "loss": "the loss is non-finite from finite model outputs: check the loss inputs "
            "(targets out of range, log of zero probabilities)",
}

# ... and a product by a 0/1 mask kept it (replay.masked_product): NaN * 0 is NaN
MASKED_BY_PRODUCT = (
    "{op}{at} multiplied the NaN of {tensor} (missing values, rows {rows}) by a mask's 0, and "
    "NaN * 0 is NaN: a mask applied by multiplication keeps the missing values it was meant "
    "to drop. Fill them before the first op that reads them (torch.nan_to_num(x), "
    "torch.where(observed, x, 0)) or select the observed entries (x[observed]), then weight "
    "by the mask")
# an infinity made at a pole, then multiplied by a mask's 0 (replay.masked_product), appended
MASK_AFTER_POLE = (
    "; then {op} multiplied that infinity by a mask's 0, and inf * 0 is NaN: a mask applied "
    "after the op does not keep out the values it was meant to drop. Select the valid entries "
    "before it (pred[valid], gt[valid]) or make its input safe where the mask is 0 "
    "(torch.where(valid, gt, 1))")
# a NaN the loss made, then multiplied by a mask's 0 (replay.masked_after): the entry is one
# the loss leaves out by design (an invisible keypoint's all-zero target), not a bad record
MASKED_AFTER_NAN = (
    "; then {op}{at} multiplied that NaN by a mask's 0 (a weight of 0: an invisible keypoint, "
    "a background location, an ignored target), and NaN * 0 is NaN: the NaN is in entries the "
    "loss was meant to leave out, not in a bad record, so nothing is to drop. Make the op safe "
    "where the mask is 0 (clamp its denominator away from 0, "
    "t.sum(-1, keepdim=True).clamp_min(eps): entries of weight 0 train toward nothing; or "
    "torch.where(valid, t, 1) before it), or "
    "select the weighted entries before the op (x[valid])")
# What to do, by situation (the first half of the hint says what happened).
# an overflow whose true result float64 cannot hold either: no wider type is a fix
BEYOND_FLOAT64 = " and for float64 as well"
# (an underflow of a half type's value that float32 would round to 0 too: no wider type helps)
BELOW_FLOAT32 = ", as float32 would too"

DO = {
    "pole": "clamp the op's input away from the pole (x.clamp_min(eps)) or add an eps",
    # (clamp_min(eps) would move -1 to +eps and 1 nowhere: each pole has its own bound)
    "log1p_pole": "keep the input above -1 (x.clamp_min(-1 + eps)); for log(1 - p) of a "
                  "probability p = sigmoid(z) use the logits (F.logsigmoid(-z), "
                  "binary_cross_entropy_with_logits), and squash a value in [0, 1] into "
                  "(alpha, 1 - alpha) before log(1 - y)",
    "logit": "keep the input inside (0, 1): torch.logit(x, eps=1e-6) clamps it to "
             "[eps, 1 - eps]; data in [0, 1] (pixels) is exactly 0 or 1 at its ends, so "
             "dequantize it ((x * 255 + torch.rand_like(x)) / 256) and squash it into "
             "(alpha, 1 - alpha) (alpha + (1 - 2 * alpha) * x, RealNVP's alpha = 0.05) before "
             "the logit",
    "power_pole": "keep the base away from 0 (x.clamp_min(eps)); a count or a degree (a "
                  "graph's deg.pow(-0.5) at an isolated node, or at a padded node of a dense "
                  "batch, whose row the collate_fn left all 0): deg.clamp(min=1), or give the "
                  "pow a safe base (torch.where(deg > 0, deg, 1)) and set inv[deg == 0] = 0 (a "
                  "fill after the pow of a learned degree still makes inf * 0 = NaN gradients)",
    "divide": "add an eps to the denominator (std + eps, d.clamp_min(eps)) or skip the rows "
              "where it is 0",
    "divide_feature": "no sample is to blame: a feature was constant over the batch (a dead "
                      "ReLU unit, a collapsed projector output): add an eps to the "
                      "statistic ((z - z.mean(0)) / (z.std(0) + eps), or BatchNorm1d("
                      "affine=False), as Barlow Twins' own code normalises) and look at why the "
                      "feature stopped varying",
    "divide_number": "the divisor is a Python number, the same for every element, so an eps "
                     "in the data does not help: find the setting that made it 0 (a drop "
                     "probability of 1 leaves keep_prob = 1 - p = 0, a temperature or scale "
                     "annealed to 0) and keep it away from 0, or skip the division where it is "
                     "0 (timm's drop_path divides only if keep_prob > 0)",
    "divide_count": "the divisor is a Python integer, the same for every element, so no row "
                    "is to blame and an eps in the data does not help: a count or size the code "
                    "computed reached 0, a count taken from the batch (int(mask.sum()), the "
                    "labelled tokens of a micro-batch, num_items_in_batch) with nothing to count "
                    "in this step, or a size (W - 1 or H - 1 of a feature map one pixel wide, as "
                    "grid_sample's align_corners=True normalisation 2 * x / (W - 1) - 1 takes "
                    "it; n - 1 of one element): divide by max(count, 1), normalise without the "
                    "- 1 (align_corners=False: (2 * x + 1) / W - 1), or skip such batches",
    "divide_total": "the divisor is one 0-d value for every element (a count, sum or "
                    "statistic over the batch: events.sum(), mask.sum(), y.std(); or a scalar "
                    "parameter), 0 in this step (no event among the batch's samples, every "
                    "element masked, every value equal): no row is to blame; divide by "
                    "count.clamp_min(1) (a sum over nothing is 0 already), add an eps to a "
                    "statistic, or skip such batches",
    # an op that took nothing the model learns (replay.lineage): the record is degenerate
    # (not for a 0-d total over the batch, which has its own advice: divide_total)
    "of_data": "what it took there was computed from the batch's data alone (the loss's "
               "targets, anchors, constants: nothing the model learns), so a record of the "
               "samples named is degenerate (a box of zero width or height, an empty mask, "
               "repeated or collinear points, such as four corners on one line, which fix no "
               "homography, a label out of range, a target on the edge of a likelihood's "
               "support: 0 or 1 under a Beta, 0 under a Gamma or a LogNormal): drop or repair "
               "such records "
               "where the data is made (the dataset, its transforms, the collate_fn), or skip "
               "them in the loss; an eps there would train toward a made-up target",
    # such an op whose result on the model's output the loss compares with it (lineage)
    "compared": "what it took there was computed from the batch's data alone (a target), and "
                "the loss compares the result with the same op of the model's output (a "
                "log-magnitude or log-power spectrum, a log-scaled target, a ratio of two "
                "channels: NDVI's (nir - red) / (nir + red)), where a sound record "
                "hits the pole too: a target of 0 there is either a value the op has no floor "
                "for (silence in a spectrum: floor both sides alike before the op, "
                "x.clamp_min(eps), as parallel_wavegan's STFT magnitude clamps the power at "
                "1e-7) or a position that holds no target (zero padding, a depth map's "
                "hole, an image's nodata pixels): leave those out of the loss with a mask (from the lengths, or "
                "target > 0)",
    # an op that took only the weights and values made of them alone (no sample's data)
    "of_weights": "its inputs were made from the model's parameters and buffers alone (no "
                  "sample's data reaches it, so every sample hits it): a parametrisation reached "
                  "the op's pole or left its domain (a rate -relu(a) at 0, a scale trained to 0: "
                  "a Cholesky diagonal learned as is, not as exp of a parameter; a matrix divided "
                  "by its spectral radius or norm, which is 0 for an all-zero or nilpotent one: a "
                  "delay line, a sparsity of 1), or a buffer the model was built with holds such "
                  "a value (two mesh nodes at one position: an edge of length 0); keep it away "
                  "(a.clamp_min(eps), or -exp(a_log) as S4 and Mamba parametrise A), fix the code "
                  "that builds the buffer, or add an eps",
    "domain": "clamp the op's input into its domain (x.clamp_min(eps) before log or sqrt) "
              "or fix what drives it out",
    "log_domain": LOG_DOMAIN,
    # (not domain's "x.clamp_min(eps) before log or sqrt": a power's base may be 0, and a
    # negative one is often a normalised value the power was meant to see before)
    "power_domain": "keep the base at or above 0 where it must be (x.clamp_min(0) ** p, an "
                    "eps for a p below 1 trained through: its slope is infinite at 0; a gamma "
                    "curve of intensities belongs before a normalisation by mean and std), or "
                    "write a signed power as torch.sign(x) * x.abs() ** p",
    "running_var": "a variance is never negative, so the module's running_var buffer was "
                   "written so (a checkpoint converted with other statistics, an edit of the "
                   "state_dict): reload or fix it, or estimate it again "
                   "(torch.optim.swa_utils.update_bn, or a few forwards in train mode)",
    "literal_inf": "if the infinity is intended (masked logits, which cross_entropy reads "
                   "only at allowed targets), record with allow_inf naming that module (the "
                   "note says which); else mask with a large finite negative number "
                   "(torch.finfo(dtype).min) instead of -inf",
    "nan_fill": "only the nan-aware reductions skip such values (nanmean, nansum), and "
                "they too make NaN of a row with no other value: reduce with them and give "
                "every row a kept value, or fill with 0 and divide by the count of kept values "
                "clamped to at least 1",
    "inf_weight": "give the masked entries zero weight in the loss (label smoothing or soft "
                  "targets spread over masked classes, a target on a masked class), or mask "
                  "with a large finite negative number instead of -inf",
    "empty_group": "give every group an element (leave empty graphs out of the batch), or "
                   "give the reduction a finite start (torch.zeros, segment_reduce's "
                   "initial=0) and fill the empty groups after it (out[count == 0] = 0)",
    "masked_row": "a fully masked row has no key to attend to (no element to pool, no "
                  "allowed pair for a point of a transport plan whose forbidden pairs cost "
                  "+inf): keep at least one key per row (skip or fill empty rows), or mask "
                  "with a large finite negative number (a large finite cost) instead of -inf",
    # (after masked_row, for a max: the shift of a hand-written logsumexp or softmax)
    "max_shift": "; where this max shifts a hand-written logsumexp, m + log(sum(exp(x - m))) "
                 "(a CRF's forward algorithm over forbidden transitions), or is the running "
                 "max of an online softmax over blocks of keys (FlashAttention's, whose row may "
                 "have keys in later blocks: keeping one per row is then no fix), x - m is "
                 "-inf - -inf on such a row: call torch.logsumexp, which returns -inf for it, "
                 "or replace an infinite m by 0 before the shift (torch.where(m == -inf, 0, m))",
    "qr_rank": "keep the input full-rank (no repeated or zero column: add a small random "
               "perturbation or drop the dependent column), or make the orthonormal basis "
               "without QR's backward (torch.nn.utils.parametrizations.orthogonal)",
    "value_gap": "differentiate only what has no such term (torch.linalg.eigvalsh, svdvals, "
                 "a matrix norm; detach the matrix when its vectors are features, e.g. "
                 "positional encodings), compute the matrix function without the decomposition "
                 "(a Newton-Schulz iteration for an inverse square root or a whitening), or "
                 "skip degenerate inputs (a batch of identical samples); initialise a learned "
                 "matrix without ties (orthogonal, or the identity plus small noise, for a "
                 "Koopman operator or a recurrent weight); eps * I does not help, it shifts "
                 "every value alike",
    "inf_literal": "put the infinity in with masked_fill(mask, float('-inf')) or "
                   "torch.where(mask, float('-inf'), 0.0) rather than multiplying by it, or mask "
                   "with a large finite negative number (torch.finfo(dtype).min)",
    "backward_inf": "give the infinite entries their limit before the arithmetic in the "
                    "backward (torch.where(torch.isinf(r), -inf, r) where exp of the difference "
                    "must be 0, as soft-DTW's kernels set R = -inf there), or save a large "
                    "finite value in their place",
    "inf_arith": "an infinity met another in arithmetic: find the op that made the first "
                 "infinity (the chain) and keep it finite",
    "mask_first": "leave the masked entries out of the arithmetic (torch.where(mask, a - b, "
                  "0.0), or a masked_fill of the operands with 0 first) or mask with a large "
                  "finite negative number (torch.finfo(dtype).min) instead of -inf",
    "zero_times_mask": "a weight of 0 on a masked entry (a target probability of 0 on a "
                       "masked class times its log-probability of -inf, as F.kl_div and a "
                       "soft-target cross entropy compute target * log_prob) still multiplies "
                       "it: leave the masked entries out of the product (the KL over the "
                       "unmasked columns only, torch.where(target > 0, target * log_prob, 0)) "
                       "or mask with a large finite negative number (torch.finfo(dtype).min) "
                       "instead of -inf",
    "log_det": "a determinant of either sign has a log-absolute value only: use "
               "torch.linalg.slogdet(W).logabsdet (a flow's log-Jacobian, as Glow's invertible "
               "1x1 convolution writes it), or, for a covariance (a kernel matrix, which float32 "
               "rounding makes indefinite where it is near-singular), keep it positive-definite "
               "with a jitter on its diagonal that the dtype can hold and take "
               "2 * L.diagonal().log().sum() of its Cholesky factor L",
    "m_matrix": M_MATRIX, "fold": FOLD, "built_factor": BUILT_FACTOR,  # (their modules')
    "cholesky": "check info (or call torch.linalg.cholesky, which raises) and make the "
                "matrix positive-definite: a jitter on its diagonal that the dtype can hold "
                "(about 1e-6 of the diagonal in float32, where 1 + 1e-9 rounds to 1; gpytorch's "
                "psd_safe_cholesky retries with 1e-6, 1e-5, 1e-4), or factor it in float64; "
                "repeated inputs (identical rows) make a kernel matrix singular up to its "
                "noise",
    "singular_values": SINGULAR_VALUES,
    "eigenvalues": "clamp the eigenvalues before the op (evals.clamp_min(eps), as matrix "
                   "square roots and whitening do) or add eps * I to the matrix first; a "
                   "covariance of fewer samples than features is singular, so a larger batch "
                   "or a shrinkage estimate keeps it positive-definite",
    "autocast_precision": "compute what feeds this op in float32 (under autocast: "
                          "torch.autocast(device_type, enabled=False) around it, its inputs "
                          "cast with .float() first; else without the cast to the narrow "
                          "type)",
    "iteration": "make the iteration converge rather than widen the type (a Newton-Schulz square "
                 "root or inverse converges only for a matrix scaled to a norm below 1: divide "
                 "it by its trace or Frobenius norm first and rescale the result; a power "
                 "iteration: normalise every step; a fixed-point iteration, as a "
                 "deep-equilibrium layer's g = Jᵀg + grad, converges only while the Jacobian's "
                 "spectral radius is below 1: stop it at a tolerance, solve with Anderson or "
                 "Broyden, or penalise ‖J‖ (a Jacobian regulariser); a descent x - lr * grad on "
                 "an energy in the forward (a Hopfield retrieval): lr below 2 / its curvature), "
                 "or bound the steps of an unrolled solver or recurrence",
    "equal_rows": EQUAL_ROWS,
    "singular": "keep the matrix full-rank: a covariance or kernel matrix with jitter on its "
                "diagonal (K + eps * I, as gpytorch's psd_safe_cholesky does) and without "
                "repeated rows; a learned invertible map (a flow's 1x1 convolution) "
                "parametrised to stay invertible (Glow's LU form with log|s| on U's diagonal, "
                "an orthogonal initialisation, no zero-initialised rows or columns)",
    "ctc": "drop or fix samples whose target cannot be aligned (a target needs at least its "
           "length plus one frame per repeated label), or pass zero_infinity=True to CTCLoss "
           "(a Hugging Face CTC model: config.ctc_zero_infinity=True)",
    "no_target": "skip batches whose targets are all ignored, or use reduction='sum' and "
                 "divide by max(count, 1)",
    "zero_weight": "a class weight of 0 leaves a batch of only that class no target weight: "
                   "skip such batches, give the class a small weight above 0, or use "
                   "reduction='sum' and divide by the total weight clamped to at least 1",
    "masked_target": "a loss that skips NaN targets in its value (nanmean, torch.where or a "
                     "mask on its output) still multiplies them in its backward (0 * NaN is "
                     "NaN): select the valid rows before the op (pred[mask], y[mask]) or fill "
                     "the targets first (torch.nan_to_num(y)), then mask",
    "masked_rounding": "rounding took the op's input outside its domain where exact "
                       "arithmetic keeps it inside (a squared distance written "
                       "|a|^2 + |b|^2 - 2 a.b cancels below 0 for a point and itself, most "
                       "in bfloat16/float16 under autocast): clamp the input to the domain "
                       "before the op (sq.clamp_min(0)), compute the cancelling term outside "
                       "autocast in float32, or use torch.cdist; masking after the op "
                       "does not stop its gradient (torch.where, masked_fill send it through "
                       "both branches)",
    "masked": "torch.where and masked_fill still send the gradient through both branches, "
              "so make the op's input safe before the op (torch.where(mask, x, 1)), not its "
              "output",
    # a slice of logsumexp/logcumsumexp given only -inf (a mask's fill): its result is -inf
    # there, and the derivative exp(x - result) is exp(-inf + inf)
    "lse_all_inf": "{op} multiplied a -Inf it saved in the forward: {name} was given -inf "
                   "in every position of a slice (a mask's fill over a whole row, or over a "
                   "scan's first steps: a left-padded row), so its result there is -inf and "
                   "its derivative exp(x - result) is exp(-inf + inf) = NaN, though the "
                   "forward was finite after it; fill masked positions with a large finite "
                   "negative (-1e9; -1e4 in float16) instead of -inf, or keep one finite "
                   "term in every slice (an initial state h0 in a log-space scan)",
    # logaddexp(-inf, -inf): a lattice's unreachable cells (a CTC or transducer alpha
    # recursion started at -inf); the same 0/0 derivative, one cell at a time
    "lae_both_inf": "{op} multiplied a -Inf it saved in the forward: {name} was given -inf "
                    "in both arguments (a log-space recursion's unreachable cells, a CTC or "
                    "transducer lattice's alpha started at -inf), so its result there is -inf "
                    "and its derivative exp(a - result) is exp(-inf + inf) = NaN, though the "
                    "loss was finite; start the unreachable cells at a large finite negative "
                    "(-1e30; -1e4 in float16) instead of -inf, or use F.ctc_loss / "
                    "torchaudio.functional.rnnt_loss, whose gradients skip those cells",
    "backward_pole": "a forward that masks the value out (torch.where, masked_fill) still "
                     "sends the gradient through both branches, so make the op's input safe "
                     "before the op (torch.where(mask, x, 1)) or add an eps",
    "sqrt_pole": "; a distance or norm written as the sqrt of a sum of squares is 0 where "
                 "two points coincide (a padded triple's zero vectors, an entity paired with "
                 "itself) or where dropout zeroed every term: torch.linalg.vector_norm(d, "
                 "dim=-1) takes it with a gradient of 0 there (a complex modulus written "
                 "elementwise, sqrt(re ** 2 + im ** 2): torch.complex(re, im).abs()), or take "
                 "sqrt(x + eps)",
    "few": "reduce over more than one value (a batch of 1, an empty selection), pass "
           "correction=0 to var/std, or skip such batches",
    "wider": "compute this op in float32 (outside autocast, or .float() before it), "
             "autocast to bfloat16 (float32's range) or rescale its inputs",
    "wider64": "rescale its inputs (subtract the row max before exp, normalise before a "
               "product or sum) or compute it in float64",
    "wider64_exp": "rescale its inputs (subtract the row max before exp), bound a learned "
                   "exponent (s.clamp(max=...), or scale * tanh(s) as flows' affine couplings "
                   "do) or compute it in float64",
    "diverging": "lower the learning rate or clip the gradients (record with "
                 "FlightRecorder(..., rewind=N) so that --try lr=0.1x and clip=1.0 re-run the "
                 "steps that grew)",
    "diverging_window": "lower the learning rate or clip the gradients (--try lr=0.1x and "
                        "clip=1.0 re-run the bundle's rewind window with either)",
    "near_pole": "keep the input further from the pole (a larger eps, 1e-6 for float32: "
                 "GaussianNLLLoss(eps=1e-6), y.clamp_min(1e-6)) or compute it in float64",
    # (after near_pole or log_space, for a gradient beyond float16's range only)
    "pole_half": "; the gradient left float16's range, not float32's: first compute this op "
                 "in float32 (outside autocast, or .float() before it)",
    "clamp": "clamp the input range (x.clamp(-c, c)) or rescale the inputs, or lower the "
             "learning rate",
    "clamp_exp": "clamp the exponent or the input range (subtract the row max before exp, "
                 "clamp the input), or lower the learning rate",
    "wider_under": "float32 holds it: compute in float32 from where the value is made "
                   "(x.float() before the squares, the softmax or the product; outside "
                   "autocast)",
    "log_space": "compute in log space (log_softmax instead of log(softmax), logsigmoid or "
                 "BCEWithLogitsLoss on the logits instead of log(sigmoid), logsumexp, "
                 "logcumsumexp instead of log(cumsum(exp)): a Cox loss's risk sets; for a "
                 "KLDivLoss whose target is softmax probabilities, give it log_softmax and "
                 "log_target=True, as TRADES' KL between clean and adversarial outputs can) or "
                 "clamp the value away from 0 (x.clamp_min(eps)) before log or division",
    "unit": "clamp the input into the domain (cos.clamp(-1 + eps, 1 - eps): a cosine of unit "
            "vectors can round past 1, and the derivative is infinite at the edge) or use "
            "atan2 for an angle",
    "acosh": "acosh's domain is [1, inf): clamp its input, x.clamp_min(1 + eps) (an eps the "
             "type resolves: 1e-6 in float32), or compute the distance in float64. A Poincare "
             "distance's argument 1 + 2|u-v|^2 / ((1-|u|^2)(1-|v|^2)) is exactly 1 where "
             "u = v (a negative sampled equal to its anchor: resample it) and below 1 only "
             "where a point left the ball (project every row back inside after each update: "
             "renorm to 1 - eps); a Lorentz distance's -<x, y>_L rounds below 1 for points "
             "close together",
    "erfinv": "clamp its input inside (-1, 1) with an eps the type resolves; a normal's "
              "icdf, sqrt(2) * erfinv(2p - 1), of a probability rounded to 1 or 0 (a "
              "softmax's or a smoothed classifier's top probability, below 1 in exact "
              "arithmetic) is at that edge: clamp p first, p.clamp(1e-6, 1 - 1e-6) in float32 "
              "(MACER clamps to [0.02, 0.98]), or take the quantile of a probability kept in "
              "log space",
    "atanh": "clamp its input inside (-1, 1) with an eps the type resolves (x.clamp(-1 + 1e-5, "
             "1 - 1e-5) in float32, where 1 - 1e-8 and 1 - 1e-15 are 1), or compute in float64; "
             "a tanh-squashed policy's atanh(a) of an expert action at its bound (+-1): clamp "
             "the actions first, as SB3's TanhBijector.inverse does; a hyperbolic log map's "
             "artanh(sqrt(c) |x|) of a point on the ball's boundary: project to a norm 1 - eps",
    "stable": "use a numerically stable formula (torch.var / torch.std or centring before "
              "squaring for a variance; logsigmoid or binary_cross_entropy_with_logits for "
              "log(1 - sigmoid(z)); log1p, expm1) or clamp to the domain before the op",
    # (a norm of vectors whose parts cancel: no stable formula of the sum keeps sqrt off 0)
    "root": "for sqrt of a sum of squares (a norm of vectors that cancel to 0), put an eps "
            "under the root (torch.sqrt(x + 1e-8))",
}


def module_label(name):
    """A module's name as every report writes it: the root module (``""``) is ``<root>``."""
    return "<root>" if name == "" else name


# what an op computed when it made NaN of infinities
# a custom Function's backward (the user's code) whose own op did arithmetic on an infinity
# its forward saved (soft-DTW's R outside a band: inf - inf), not a forward op at its pole
OWN_INF = ("{op} is a custom autograd.Function's backward: its own {inner} computed {what} "
           "from a {saved} that the forward saved (a table's +inf border or cells left "
           "infinite on purpose), NaN in exact arithmetic too; " + DO["backward_inf"])
# a division's gradient too large near the pole of a tiny positive sum of exp (1/y²)
NEAR_POLE_EXP = ("{op}'s gradient is too large for {dtype} and finite in float64: {fn} grows "
                 "without bound near its pole (1/y² for a division by y), and the op's input, "
                 "made by exp, softmax, sigmoid or softplus (or a sum of products of positive "
                 "values: Sinkhorn's K @ v with K = exp(-C / eps), linear attention's "
                 "phi(q) . sum phi(k)), is tiny though not 0; "
                 + DO["log_space"] + ", or compute it in float64")
INF_ARITH = {"sub": "inf - inf", "add": "inf + (-inf)", "mul": "0 * inf", "div": "inf / inf"}
# NaN of infinities that were all put in on purpose (OpHit.from_mask): what met them, and
# what to do; a masked entry minus a masked entry (ListMLE's tail logcumsumexp minus the
# score on a padded slot of the list) is -inf - -inf
_MASKED_PAIR = ("infinities", "; both were masked entries, which a later mask (* mask, "
                "masked_fill) cannot take back from NaN: " + DO["mask_first"])
MASK_ARITH = {"mul": ("an infinity", " and a 0: " + DO["zero_times_mask"]),
              "sub": _MASKED_PAIR, "add": _MASKED_PAIR}


def inf_arith(op: str, default: str) -> str:
    """What aten op ``op`` (in place or not) computed when it made NaN of an infinity."""
    return INF_ARITH.get(op.removeprefix("aten.").rstrip("_"), default)


# ops that reduce groups of elements into the rows an index names (a scatter max pooling per
# graph): a row no element lands in keeps the value the reduction started from
GROUP_REDUCTIONS = frozenset({"scatter_reduce", "index_reduce", "scatter"})


def no_float64(e: Exception) -> str:
    """The hint of an origin whose cause the float64 re-run could not tell: the model raised
    in float64 (a kernel for half types only, a dtype check)."""
    first = first_line(e, 200)
    return (f"the model raised in the float64 re-run that tells invalid from overflow, "
            f"underflow and precision ({type(e).__name__}: {first}), so the cause is not "
            "told: the origin above is where the value was made; read its op and inputs, or "
            "let the code run in float64 (a fallback for the half-only kernel)")


# a backward event of a step with no micro-batch: an update the recorder made a step of its own
NO_FORWARD = ("the step ran no forward of the recorded model with gradients on (one under "
              "torch.no_grad, an evolution strategy's evaluation of perturbed weights, is not "
              "kept with the step): the loop wrote the gradients of this update itself, from "
              "a copy of the model it trained (Reptile) or other code the replay cannot re-run")

# the forward ops whose derivative exp(x - result) is 0/0 where every term is -inf: which text
LSE_ALL_INF = {"logsumexp": "lse_all_inf", "logcumsumexp": "lse_all_inf",
               "logaddexp": "lae_both_inf", "logaddexp2": "lae_both_inf"}
