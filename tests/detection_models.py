"""Object detection and dense prediction as their repositories write them, box ops by hand
(no torchvision): a one-stage FCOS-style detector (backbone, two-level FPN, shared head with
``exp`` box distances), targets as a list of per-image dicts from a ``collate_fn``, point
assignment, a sigmoid focal loss normalised by the number of positives, a GIoU loss and a
centerness branch; a RetinaNet-style loss encoding boxes as ``log(w_gt / w_anchor)``, also
computed inside the model as torchvision's detectors do (``model(images, targets)``, the
images a list)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

IMG = 32
CLASSES = 3
STRIDES = (4, 8)


# ---------------------------------------------------------------------------------------------
# data


class Shapes(Dataset):
    """Bright rectangles on noise; ``boxes`` in xyxy pixels, some images with none.
    ``empty`` lists images with no boxes, ``boxes`` overrides an image's boxes."""

    def __init__(self, n: int = 64, empty=(), boxes=None, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            img = torch.randn(3, IMG, IMG, generator=g) * 0.1
            k = 0 if i in empty else int(torch.randint(1, 4, (1,), generator=g))
            xy = torch.randint(0, IMG - 12, (k, 2), generator=g).float()
            wh = torch.randint(6, 12, (k, 2), generator=g).float()
            bx = torch.cat([xy, xy + wh], 1)
            if boxes is not None and i in boxes:
                bx = torch.tensor(boxes[i], dtype=torch.float32).view(-1, 4)
            labels = torch.randint(0, CLASSES, (len(bx),), generator=g)
            for (x1, y1, x2, y2), c in zip(bx.long().tolist(), labels.tolist()):
                img[c, y1:y2, x1:x2] += 1.0
            self.items.append((img, {"boxes": bx, "labels": labels,
                                     "image_id": torch.tensor(i)}))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate_fn(batch):
    """torchvision's detection references: ``tuple(zip(*batch))``, images then stacked."""
    images, targets = tuple(zip(*batch))
    return torch.stack(images), list(targets)


def loader(ds, batch_size: int = 4) -> DataLoader:
    return DataLoader(ds, batch_size=batch_size, shuffle=False, collate_fn=collate_fn)


# ---------------------------------------------------------------------------------------------
# the detector


def conv_gn(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1), nn.GroupNorm(4, cout), nn.ReLU())


class Scale(nn.Module):
    def __init__(self, init: float = 1.0):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(init))

    def forward(self, x):
        return x * self.scale


class FCOSHead(nn.Module):
    def __init__(self, ch: int = 16, classes: int = CLASSES, levels: int = 2,
                 box_exp: bool = True):
        super().__init__()
        self.box_exp = box_exp  # False: raw (dx, dy, dw, dh) deltas, as RetinaNet's
        self.cls_tower = conv_gn(ch, ch)
        self.box_tower = conv_gn(ch, ch)
        self.cls_logits = nn.Conv2d(ch, classes, 3, padding=1)
        self.bbox_pred = nn.Conv2d(ch, 4, 3, padding=1)
        self.centerness = nn.Conv2d(ch, 1, 3, padding=1)
        self.scales = nn.ModuleList(Scale() for _ in range(levels))
        nn.init.constant_(self.cls_logits.bias, -2.0)  # prior 0.1, as RetinaNet's init

    def forward(self, feats):
        cls, reg, ctr = [], [], []
        for f, scale, s in zip(feats, self.scales, STRIDES):
            c, b = self.cls_tower(f), self.box_tower(f)
            cls.append(self.cls_logits(c).flatten(2).transpose(1, 2))
            r = scale(self.bbox_pred(b))
            if self.box_exp:  # FCOS: distances are exp of the scaled regression, times stride
                r = torch.exp(r) * s
            reg.append(r.flatten(2).transpose(1, 2))
            ctr.append(self.centerness(b).flatten(1))
        return torch.cat(cls, 1), torch.cat(reg, 1), torch.cat(ctr, 1)


def grid_points(sizes, device=None, anchor: float = 0.0) -> torch.Tensor:
    """Each level's cell centres (x, y); with ``anchor`` > 0, square anchors of side
    ``anchor * stride`` around them (x1, y1, x2, y2)."""
    pts = []
    for (h, w), s in zip(sizes, STRIDES):
        ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device),
                                indexing="ij")
        p = torch.stack([xs, ys], -1).view(-1, 2).float() * s + s // 2
        pts.append(torch.cat([p - anchor * s / 2, p + anchor * s / 2], 1) if anchor else p)
    return torch.cat(pts)


class FCOS(nn.Module):
    def __init__(self, ch: int = 16, box_exp: bool = True):
        super().__init__()
        self.stem = conv_gn(3, ch, 2)
        self.c3 = conv_gn(ch, ch, 2)
        self.c4 = conv_gn(ch, ch, 2)
        self.lat3, self.lat4 = nn.Conv2d(ch, ch, 1), nn.Conv2d(ch, ch, 1)
        self.head = FCOSHead(ch, box_exp=box_exp)

    def forward(self, images):
        c3 = self.c3(self.stem(images))
        c4 = self.c4(c3)
        p4 = self.lat4(c4)
        p3 = self.lat3(c3) + F.interpolate(p4, size=c3.shape[-2:], mode="nearest")
        cls, reg, ctr = self.head([p3, p4])
        sizes = [p3.shape[-2:], p4.shape[-2:]]
        if not self.head.box_exp:
            return {"cls": cls, "reg": reg, "anchors": grid_points(sizes, images.device, 4.0)}
        return {"cls": cls, "reg": reg, "ctr": ctr, "points": grid_points(sizes, images.device)}


def make_fcos() -> FCOS:
    torch.manual_seed(0)
    return FCOS()


def make_retinanet() -> FCOS:
    torch.manual_seed(0)
    return FCOS(box_exp=False)


# ---------------------------------------------------------------------------------------------
# box ops and losses, written out


def sigmoid_focal_loss(inputs, targets, alpha: float = 0.25, gamma: float = 2.0):
    """torchvision.ops.sigmoid_focal_loss, reduction none."""
    p = torch.sigmoid(inputs)
    ce = F.binary_cross_entropy_with_logits(inputs, targets, reduction="none")
    p_t = p * targets + (1 - p) * (1 - targets)
    loss = ce * ((1 - p_t) ** gamma)
    return (alpha * targets + (1 - alpha) * (1 - targets)) * loss


def giou_loss_ltrb(pred, target):
    """IoU/GIoU of boxes given as distances (l, t, r, b) from one point."""
    pl, pt, pr, pb = pred.unbind(-1)
    tl, tt, tr, tb = target.unbind(-1)
    area_p = (pl + pr) * (pt + pb)
    area_t = (tl + tr) * (tt + tb)
    inter = (torch.min(pl, tl) + torch.min(pr, tr)) * (torch.min(pt, tt) + torch.min(pb, tb))
    union = area_p + area_t - inter
    iou = inter / union
    enclose = (torch.max(pl, tl) + torch.max(pr, tr)) * (torch.max(pt, tt) + torch.max(pb, tb))
    return 1 - (iou - (enclose - union) / enclose)


def centerness_target(ltrb):
    lr, tb = ltrb[:, [0, 2]], ltrb[:, [1, 3]]
    return torch.sqrt((lr.min(-1).values / lr.max(-1).values)
                      * (tb.min(-1).values / tb.max(-1).values))


def fcos_assign(points, boxes, labels, classes: int = CLASSES):
    """Each point to the smallest box it lies inside: one-hot class targets and l, t, r, b."""
    n = len(points)
    if len(boxes) == 0:
        return points.new_zeros(n, classes), points.new_zeros(n, 4)
    x, y = points[:, 0, None], points[:, 1, None]
    ltrb = torch.stack([x - boxes[:, 0], y - boxes[:, 1], boxes[:, 2] - x, boxes[:, 3] - y], -1)
    inside = ltrb.min(-1).values > 0
    area = ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]))[None].expand(n, -1)
    area = torch.where(inside, area, torch.full_like(area, float("inf")))
    best_area, best = area.min(1)
    pos = torch.isfinite(best_area)
    cls_t = points.new_zeros(n, classes)
    cls_t[pos, labels[best[pos]]] = 1.0
    return cls_t, ltrb[torch.arange(n), best]


class FCOSLoss(nn.Module):
    """``num_pos_floor``: the normaliser's lower bound (``max(num_pos, 1)``); None divides by
    the bare count, as a loss written for batches that always hold a box does."""

    def __init__(self, num_pos_floor: float | None = 1.0, centerness_everywhere: bool = False):
        super().__init__()
        self.num_pos_floor = num_pos_floor
        # the centerness target of every location, masked after: a background location's
        # l, t, r, b are 0, and min / max is 0/0
        self.centerness_everywhere = centerness_everywhere

    def forward(self, out, targets):
        cls, reg, ctr, points = out["cls"], out["reg"], out["ctr"], out["points"]
        assigned = [fcos_assign(points, t["boxes"], t["labels"]) for t in targets]
        cls_t = torch.stack([a[0] for a in assigned])
        reg_t = torch.stack([a[1] for a in assigned])
        pos = cls_t.sum(-1) > 0
        num_pos = pos.sum().float()
        if self.num_pos_floor is not None:
            num_pos = num_pos.clamp(min=self.num_pos_floor)
        loss_cls = sigmoid_focal_loss(cls, cls_t).sum() / num_pos
        ctr_t = centerness_target(reg_t[pos])
        loss_box = (giou_loss_ltrb(reg[pos], reg_t[pos]) * ctr_t).sum() \
            / ctr_t.sum().clamp(min=1e-6)
        if self.centerness_everywhere:
            ctr_all = centerness_target(reg_t.flatten(0, 1)).view_as(ctr)
            loss_ctr = (F.binary_cross_entropy_with_logits(ctr, ctr_all, reduction="none")
                        * pos).sum() / num_pos
        else:
            loss_ctr = F.binary_cross_entropy_with_logits(ctr[pos], ctr_t,
                                                          reduction="sum") / num_pos
        return loss_cls + loss_box + loss_ctr


def box_iou(a, b):
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    lt, rb = torch.max(a[:, None, :2], b[None, :, :2]), torch.min(a[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    return inter / (area_a[:, None] + area_b[None] - inter)


def encode(gt, anchors):
    """Faster R-CNN's box coder (weights 1): centre offsets over the anchor's size, log of the
    size ratios."""
    aw, ah = anchors[:, 2] - anchors[:, 0], anchors[:, 3] - anchors[:, 1]
    ax, ay = anchors[:, 0] + 0.5 * aw, anchors[:, 1] + 0.5 * ah
    gw, gh = gt[:, 2] - gt[:, 0], gt[:, 3] - gt[:, 1]
    gx, gy = gt[:, 0] + 0.5 * gw, gt[:, 1] + 0.5 * gh
    return torch.stack([(gx - ax) / aw, (gy - ay) / ah,
                        torch.log(gw / aw), torch.log(gh / ah)], 1)


class RetinaLoss(nn.Module):
    """torchvision's RetinaNet ``compute_loss``: per image, IoU >= 0.5 positive, < 0.4
    negative, each box's best anchor positive too (low-quality matches); focal loss and smooth
    L1 on the encoded boxes, each over ``max(1, num_foreground)``, averaged over the images."""

    def forward(self, out, targets):
        cls, reg, anchors = out["cls"], out["reg"], out["anchors"]
        cls_losses, box_losses = [], []
        for i, t in enumerate(targets):
            boxes, labels = t["boxes"], t["labels"]
            cls_t = torch.zeros_like(cls[i])
            valid = torch.ones(len(anchors), dtype=torch.bool)
            if len(boxes) == 0:
                cls_losses.append(sigmoid_focal_loss(cls[i], cls_t).sum())
                box_losses.append(reg[i].sum() * 0)
                continue
            iou = box_iou(boxes, anchors)  # (G, A)
            best_iou, match = iou.max(0)
            pos = best_iou >= 0.5
            valid &= ~((best_iou >= 0.4) & ~pos)  # between the thresholds: ignored
            best_anchor = iou.argmax(1)
            pos[best_anchor] = True
            match[best_anchor] = torch.arange(len(boxes))
            valid[best_anchor] = True
            cls_t[pos, labels[match[pos]]] = 1.0
            n = max(1, int(pos.sum()))
            cls_losses.append(sigmoid_focal_loss(cls[i][valid], cls_t[valid]).sum() / n)
            deltas = encode(boxes[match[pos]], anchors[pos])
            box_losses.append(F.smooth_l1_loss(reg[i][pos], deltas, beta=1 / 9,
                                               reduction="sum") / n)
        return sum(cls_losses) / len(targets) + sum(box_losses) / len(targets)


class Detector(nn.Module):
    """torchvision's detection models: ``model(images, targets)`` returns the dict of losses in
    training, the loss computed inside the model."""

    def __init__(self):
        super().__init__()
        self.net = FCOS(box_exp=False)
        self.criterion = RetinaLoss()

    def forward(self, images, targets=None):
        out = self.net(images)
        if self.training and targets is not None:
            return self.criterion(out, targets)
        return out


def make_detector() -> Detector:
    torch.manual_seed(0)
    return Detector()


class ListDetector(Detector):
    """torchvision's ``GeneralizedRCNNTransform``: the images come as a list (sizes may
    differ), normalised one by one and padded into one batch in the model."""

    def forward(self, images, targets=None):
        mean = torch.tensor([0.1, 0.1, 0.1]).view(3, 1, 1)
        images = [(im - mean) / 0.5 for im in images]
        batch = images[0].new_zeros(len(images), 3, IMG, IMG)
        for b, im in zip(batch, images):
            b[:, :im.shape[1], :im.shape[2]].copy_(im)
        return super().forward(batch, targets)


def make_list_detector() -> ListDetector:
    torch.manual_seed(0)
    return ListDetector()


# ---------------------------------------------------------------------------------------------
# a two-stage box head: RoIAlign written with grid_sample, the ground-truth boxes as proposals


def roi_align(feat, rois, out: int = 2, scale: float = 1.0):
    """RoIAlign by ``grid_sample(align_corners=True)``: ``rois`` ``(K, 5)`` of batch index,
    x1, y1, x2, y2 in image pixels, sampled at ``out`` x ``out`` points of ``feat``'s grid."""
    h, w = feat.shape[-2:]
    idx, x1, y1, x2, y2 = rois.unbind(1)
    t = torch.linspace(0, 1, out)
    gx = (x1[:, None] + (x2 - x1)[:, None] * t) * scale / (w - 1) * 2 - 1
    gy = (y1[:, None] + (y2 - y1)[:, None] * t) * scale / (h - 1) * 2 - 1
    grid = torch.stack(torch.broadcast_tensors(gx[:, None, :], gy[:, :, None]), -1)
    return F.grid_sample(feat[idx.long()], grid, align_corners=True)


class RoIPool(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, feat, rois):
        return roi_align(feat, rois, scale=self.scale)


class TwoStage(nn.Module):
    """Five stride-2 stages (stride 32: a 32-pixel image's last map is 1 x 1), a pooler and a
    box classifier over the proposals."""

    def __init__(self, ch: int = 16):
        super().__init__()
        self.body = nn.Sequential(conv_gn(3, ch, 2), *(conv_gn(ch, ch, 2) for _ in range(4)))
        self.pooler = RoIPool(1 / 32)
        self.box_head = nn.Linear(ch * 4, CLASSES)

    def forward(self, images, rois):
        return self.box_head(self.pooler(self.body(images), rois).flatten(1))


def make_two_stage() -> TwoStage:
    torch.manual_seed(0)
    return TwoStage()


def proposals(targets) -> tuple[torch.Tensor, torch.Tensor]:
    """The boxes as RoIs ``(K, 5)`` (image index first) and their labels."""
    rois = torch.cat([torch.cat([torch.full((len(t["boxes"]), 1), float(i)), t["boxes"]], 1)
                      for i, t in enumerate(targets)])
    return rois, torch.cat([t["labels"] for t in targets])
