"""Multi-task networks and gradient surgery written as LibMTL, the PCGrad / GradNorm / MGDA
papers' code and NYUv2 / Cityscapes multi-task repositories write them, for
``test_gradient_surgery``.

- ``SceneNet``: a shared convolutional trunk (conv-BN-ReLU, the last shared layer named for
  GradNorm) with three heads: semantic segmentation (per-pixel logits, cross-entropy with
  ``ignore_index=255``), depth (softplus output, L1 over the valid pixels ``gt > 0``) and a
  scene classification head (global pooling, linear). ``forward(x, task_mask=None)`` takes the
  scene classifier's allowed classes as an extra argument (``-inf`` logits outside them).
- the task losses, PCGrad's projection of conflicting task gradients (vectorised, as the
  batched implementations write ``min(g_i . g_j, 0) / ||g_j||^2``), MGDA's two-task min-norm
  weight, GradNorm's weight update and uncertainty weighting.
- the data: images, segmentation labels (255 where unlabelled), depth maps (0 where the
  sensor saw nothing), scene labels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N_SEG, N_SCENE, IGNORE = 4, 3, 255


class SceneNet(nn.Module):
    """Shared trunk, three task heads; returns a dict of task outputs. ``depth_act``: the
    depth head's output activation (softplus; BTS-style heads use ReLU)."""

    def __init__(self, width: int = 8, depth_act: type = nn.Softplus):
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())
        self.seg_head = nn.Conv2d(width, N_SEG, 1)
        self.depth_head = nn.Sequential(nn.Conv2d(width, 1, 1), depth_act())
        self.scene_head = nn.Linear(width, N_SCENE)

    def last_shared(self) -> nn.Parameter:
        """The last shared layer's weight, whose task gradient norms GradNorm balances."""
        return self.trunk[3].weight

    def forward(self, x, task_mask=None):
        h = self.trunk(x)
        scene = self.scene_head(h.mean((2, 3)))
        if task_mask is not None:  # classes this dataset does not label: never predicted
            scene = scene.masked_fill(~task_mask, float("-inf"))
        return {"seg": self.seg_head(h), "depth": self.depth_head(h).squeeze(1),
                "scene": scene}


def make_scenenet() -> SceneNet:
    torch.manual_seed(0)
    return SceneNet()


def make_relu_depth() -> SceneNet:
    torch.manual_seed(0)
    return SceneNet(depth_act=nn.ReLU)


class GradNormNet(SceneNet):
    """SceneNet with GradNorm's task weights as a parameter of the model (as the GradNorm
    implementations keep them: trained by the same optimizer, renormalised to sum to the number
    of tasks after each step)."""

    def __init__(self, width: int = 8, n_tasks: int = 3):
        super().__init__(width)
        self.task_weights = nn.Parameter(torch.ones(n_tasks))


def make_gradnorm() -> GradNormNet:
    torch.manual_seed(0)
    return GradNormNet()


def depth_l1(pred, gt):
    """L1 over the pixels the depth sensor saw (``gt > 0``), as NYUv2 loaders mask them."""
    valid = gt > 0
    return (pred[valid] - gt[valid]).abs().mean()  # the bug: mean of no pixel is 0/0


def depth_l1_guarded(pred, gt):
    """The same loss with a batch without any valid pixel counted as 0 (its gradient 0)."""
    valid = (gt > 0).float()
    return ((pred - gt).abs() * valid).sum() / valid.sum().clamp_min(1)


def silog(pred, gt, lam: float = 0.85):
    """Eigen et al.'s scale-invariant log loss over the valid pixels (BTS, AdaBins)."""
    valid = gt > 0
    d = torch.log(pred[valid]) - torch.log(gt[valid])  # the bug: a ReLU head can predict 0
    return torch.sqrt((d ** 2).mean() - lam * d.mean() ** 2) * 10


def depth_mse(pred, gt):
    """Mean squared error over every pixel, for depth maps without holes (no mask)."""
    return F.mse_loss(pred, gt)


def task_losses(out, seg, depth, scene, depth_loss=depth_l1):
    return [F.cross_entropy(out["seg"], seg, ignore_index=IGNORE),
            depth_loss(out["depth"], depth),
            F.cross_entropy(out["scene"], scene)]


class MultiTaskLoss(nn.Module):
    """The task losses summed with fixed weights (the recorder's loss_fn)."""

    def __init__(self, weights=(1.0, 1.0, 0.5), depth_loss=depth_l1):
        super().__init__()
        self.weights, self.depth_loss = weights, depth_loss

    def forward(self, out, seg, depth, scene):
        losses = task_losses(out, seg, depth, scene, self.depth_loss)
        return sum(w * loss for w, loss in zip(self.weights, losses))


class PartialLabelLoss(MultiTaskLoss):
    """Mixed datasets: a scene label of -1 where the record's dataset has none; the scene loss
    over the records that have one (``logits[has]``), as multi-dataset loaders write it."""

    def forward(self, out, seg, depth, scene):
        has = scene >= 0
        losses = [F.cross_entropy(out["seg"], seg, ignore_index=IGNORE),
                  self.depth_loss(out["depth"], depth),
                  F.cross_entropy(out["scene"][has], scene[has])]  # the bug: no record has one
        return sum(w * loss for w, loss in zip(self.weights, losses))


class UncertaintyLoss(nn.Module):
    """Kendall et al.'s homoscedastic uncertainty weighting as LibMTL writes it:
    ``L / (2 exp(s)) + s / 2`` per task, the log-variances ``s`` trained with the model."""

    def __init__(self, n_tasks: int = 3):
        super().__init__()
        self.log_vars = nn.Parameter(torch.zeros(n_tasks))

    def forward(self, out, seg, depth, scene):
        losses = torch.stack(task_losses(out, seg, depth, scene, depth_l1_guarded))
        return (losses / (2 * self.log_vars.exp()) + self.log_vars / 2).sum()


def flat_grad(loss, params, retain_graph=True):
    grads = torch.autograd.grad(loss, params, retain_graph=retain_graph, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).flatten()
                      for p, g in zip(params, grads)])


def pcgrad(grads: torch.Tensor, order: list[int]) -> torch.Tensor:
    """PCGrad (Yu et al. 2020) over the rows of ``grads`` (tasks x shared parameters): each
    task's gradient loses its component along every other task's it conflicts with."""
    out = grads.clone()
    for i in range(len(grads)):
        for j in order:
            if j == i:
                continue
            dot = torch.dot(out[i], grads[j])
            # the bug: ||g_j||^2 = 0 for a task whose gradient is exactly 0 (0 * 0/0)
            out[i] = out[i] - torch.clamp(dot, max=0) / grads[j].norm().pow(2) * grads[j]
    return out.sum(0)


def pcgrad_guarded(grads: torch.Tensor, order: list[int]) -> torch.Tensor:
    out = grads.clone()
    for i in range(len(grads)):
        for j in order:
            if j == i:
                continue
            dot = torch.dot(out[i], grads[j])
            out[i] = out[i] - torch.clamp(dot, max=0) / (grads[j].norm().pow(2) + 1e-12) * grads[j]
    return out.sum(0)


def gradient_normalizers(grads: torch.Tensor, losses: torch.Tensor, kind: str = "loss+"):
    """Sener & Koltun's normalisers of each task's gradient before the min-norm solve."""
    if kind == "l2":
        return grads.flatten(1).norm(dim=1)
    if kind == "loss+":  # the bug: 0 for a task whose loss is 0, and its gradient 0/0
        return losses * grads.flatten(1).norm(dim=1)
    return torch.ones(len(grads))


def line_search(v1v1, v1v2, v2v2):
    """MinNormSolver._min_norm_element_from2: the min-norm point of a segment."""
    if v1v2 >= v1v1:
        return 0.999
    if v1v2 >= v2v2:
        return 0.001
    return float(-(v1v2 - v2v2) / (v1v1 + v2v2 - 2 * v1v2))


def min_norm_weights(grads: torch.Tensor, iters: int = 25) -> torch.Tensor:
    """MGDA's Frank-Wolfe min-norm solver over the tasks' (normalised) gradients."""
    flat = grads.flatten(1)
    gram = flat @ flat.T
    sol = torch.full((len(flat),), 1 / len(flat))
    for _ in range(iters):
        t = int(torch.argmin(gram @ sol))
        v1v1, v1v2, v2v2 = sol @ gram @ sol, sol @ gram[:, t], gram[t, t]
        gamma = line_search(v1v1, v1v2, v2v2)
        sol = gamma * sol + (1 - gamma) * F.one_hot(torch.tensor(t), len(flat))
    return sol


def gradnorm_step(model, losses, initial, alpha: float = 1.5) -> None:
    """GradNorm (Chen et al. 2018) as its PyTorch ports write it: the weighted loss's
    gradients, then the task weights' own gradient from the L1 gap between each task's
    gradient norm at the last shared layer (autograd.grad with create_graph) and the mean norm
    times its relative inverse training rate."""
    w, task = model.task_weights, torch.stack(losses)
    (w * task).sum().backward(retain_graph=True)
    shared = model.last_shared()
    norms = torch.stack([torch.autograd.grad(w[i] * task[i], shared, retain_graph=True,
                                             create_graph=True)[0].norm()
                         for i in range(len(losses))])
    ratio = task.detach() / initial
    rate = ratio / ratio.mean()
    target = (norms.mean() * rate ** alpha).detach()
    w.grad = torch.autograd.grad((norms - target).abs().sum(), w)[0]


def renormalise(weights: nn.Parameter) -> None:
    """GradNorm's renormalisation after the update: the weights sum to the number of tasks."""
    with torch.no_grad():
        weights.mul_(len(weights) / weights.sum())


def write_grads(params, flat: torch.Tensor) -> None:
    """The merged gradient written into ``p.grad`` by hand, as gradient-surgery loops do."""
    i = 0
    for p in params:
        p.grad = flat[i:i + p.numel()].view_as(p).clone()
        i += p.numel()


def scene_batch(g: torch.Generator, n: int = 8, size: int = 8):
    """Images, segmentation labels (255 at unlabelled pixels), depth (0 where the sensor saw
    nothing), scene labels."""
    x = torch.randn(n, 3, size, size, generator=g)
    seg = torch.randint(0, N_SEG, (n, size, size), generator=g)
    seg[torch.rand(n, size, size, generator=g) < 0.2] = IGNORE
    depth = 0.5 + 4 * torch.rand(n, size, size, generator=g)
    depth[torch.rand(n, size, size, generator=g) < 0.1] = 0.0
    scene = torch.randint(0, N_SCENE, (n,), generator=g)
    return x, seg, depth, scene


# ---------------------------------------------------------------------------------------------
# the training loops (``plant(step, x, seg, depth, scene)`` edits a step's batch in place)

FACTORY = "gradient_surgery_models:"


def batches(steps: int, plant=None):
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        x, seg, depth, scene = scene_batch(g)
        if plant is not None:
            plant(step, x, seg, depth, scene)
        yield x, seg, depth, scene


def recorder(model, opt, out_dir, make: str, **kw):
    from recorder import FlightRecorder
    return FlightRecorder(model, opt, out_dir=out_dir, factory=FACTORY + make, **kw)


def train_pcgrad(out_dir, steps=4, plant=None, surgery=pcgrad, record=True, amp=False):
    """PCGrad over the shared trunk (task order shuffled each step, as the paper's code does),
    the heads' own gradients from the summed loss; Adam. ``amp``: the forward under float16
    autocast, every task gradient taken of the GradScaler's scaled loss, ``scaler.step``."""
    import random
    model = make_scenenet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    shared = list(model.trunk.parameters())
    heads = [p for n, p in model.named_parameters() if not n.startswith("trunk")]
    rng = random.Random(0)
    rec = recorder(model, opt, out_dir, "make_scenenet",
                   scaler=scaler if amp else None).attach() if record else None
    try:
        for x, seg, depth, scene in batches(steps, plant):
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                out = model(x)
            out = {k: v.float() for k, v in out.items()}
            losses = [scaler.scale(loss) for loss in
                      task_losses(out, seg, depth, scene, depth_l1_guarded)]
            grads = torch.stack([flat_grad(loss, shared) for loss in losses])
            order = list(range(len(losses)))
            rng.shuffle(order)
            opt.zero_grad()
            write_grads(shared, surgery(grads, order))
            for p, g in zip(heads, torch.autograd.grad(sum(losses), heads)):
                p.grad = g
            scaler.step(opt)
            scaler.update()
    finally:
        if rec is not None:
            rec.detach()
    return model


def train_weighted(out_dir, crit, steps=4, plant=None, record=True):
    """A loss module over the three heads (fixed weights, or uncertainty weighting whose
    log-variances AdamW trains with the model) under bfloat16 autocast, the scene head
    restricted to the dataset's classes by a ``-inf`` mask, clipping, a step schedule. The
    dataset labels the first two scene classes only."""
    model = make_scenenet()
    opt = torch.optim.AdamW([*model.parameters(), *crit.parameters()], lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    allowed = torch.tensor([True, True, False])
    rec = recorder(model, opt, out_dir, "make_scenenet", loss_fn=crit,
                   allow_inf=[""]).attach() if record else None
    loss_fn = rec.loss_fn if rec is not None else crit
    try:
        for step, (x, seg, depth, scene) in enumerate(batches(steps)):
            scene = scene % 2
            if plant is not None:
                plant(step, x, seg, depth, scene)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x, task_mask=allowed)
            out = {k: v.float() for k, v in out.items()}
            loss_fn(out, seg, depth, scene).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
    finally:
        if rec is not None:
            rec.detach()
    return model


def train_mgda(out_dir, steps=4, plant=None, kind="loss+", record=True,
               depth_loss=depth_l1_guarded):
    """MGDA over the shared parameters (LibMTL's ``rep_grad=False``): each task's gradient by
    autograd.grad, normalised, Frank-Wolfe's min-norm scales, then the scaled loss's backward;
    SGD with momentum."""
    model = make_scenenet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    shared = list(model.trunk.parameters())
    rec = recorder(model, opt, out_dir, "make_scenenet").attach() if record else None
    try:
        for x, seg, depth, scene in batches(steps, plant):
            losses = task_losses(model(x), seg, depth, scene, depth_loss)
            grads = torch.stack([flat_grad(loss, shared) for loss in losses])
            norms = gradient_normalizers(grads, torch.stack(losses).detach(), kind)
            scales = (torch.ones(len(losses)) if kind == "equal"  # (the equal-weight baseline)
                      else min_norm_weights(grads / norms[:, None]))
            opt.zero_grad()
            sum(s * loss for s, loss in zip(scales, losses)).backward()
            opt.step()
    finally:
        if rec is not None:
            rec.detach()
    return model


def train_gradnorm(out_dir, steps=4, plant=None, record=True):
    """GradNorm: the task weights trained by their own learning rate in the same Adam, and
    renormalised after each update; the initial task losses are the first step's."""
    model = make_gradnorm()
    opt = torch.optim.Adam([
        {"params": [p for n, p in model.named_parameters() if n != "task_weights"]},
        {"params": [model.task_weights], "lr": 0.025}], lr=1e-3)
    rec = recorder(model, opt, out_dir, "make_gradnorm").attach() if record else None
    initial = None
    try:
        for x, seg, depth, scene in batches(steps, plant):
            opt.zero_grad()
            losses = task_losses(model(x), seg, depth, scene, depth_l1_guarded)
            if initial is None:
                initial = torch.stack(losses).detach()
            gradnorm_step(model, losses, initial)
            opt.step()
            renormalise(model.task_weights)
    finally:
        if rec is not None:
            rec.detach()
    return model
