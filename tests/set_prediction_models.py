"""Set prediction as DETR writes it, small, for ``test_set_prediction``: a conv backbone,
DETR's sine position embedding of the padding mask, a post-norm transformer encoder and decoder
(``nn.MultiheadAttention``, sequence-first, the padding mask as ``key_padding_mask``) over
object queries, a class head (``classes + 1``, the last no-object) and a box head
(``sigmoid`` cxcywh), the decoder's every layer's outputs for the auxiliary losses.

Images of different sizes are padded into one batch by ``collate_fn`` (DETR's
``nested_tensor_from_tensor_list``: the mask True on padding), targets a list of per-image
dicts (``labels``, ``boxes`` cxcywh normalised by the image's own size), some images without
objects. ``HungarianMatcher`` matches by exhaustive search over the assignments of the
queries to the (few) targets; ``SetCriterion`` computes DETR's losses over the matched pairs
(class CE with the ``eos_coef`` weight vector, L1 and GIoU over ``num_boxes``) for the last
layer and every auxiliary one.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

CLASSES = 3
QUERIES = 6
D = 32
MAX = 32  # the largest image side


# ---------------------------------------------------------------------------------------------
# data


class Shapes(Dataset):
    """Bright rectangles on noise, each image of its own size (h, w in [16, 32]).

    ``empty``: images without objects; ``full``: images of the full 32 x 32 size (no padding in
    any batch)."""

    def __init__(self, n: int = 32, empty=(), full=(), seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            h, w = (int(v) for v in torch.randint(16, MAX + 1, (2,), generator=g))
            if i in full:
                h = w = MAX
            img = torch.randn(3, h, w, generator=g) * 0.1
            k = 0 if i in empty else int(torch.randint(1, 4, (1,), generator=g))
            wh = torch.rand(k, 2, generator=g) * 0.3 + 0.15
            c = wh / 2 + torch.rand(k, 2, generator=g) * (1 - wh)
            labels = torch.randint(0, CLASSES, (k,), generator=g)
            for (cx, cy), (bw, bh), lab in zip(c.tolist(), wh.tolist(), labels.tolist()):
                x1, y1 = int((cx - bw / 2) * w), int((cy - bh / 2) * h)
                img[lab, y1:int((cy + bh / 2) * h), x1:int((cx + bw / 2) * w)] += 1.0
            self.items.append((img, {"labels": labels, "boxes": torch.cat([c, wh], 1),
                                     "size": torch.tensor([h, w])}))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate_fn(batch):
    """DETR's ``nested_tensor_from_tensor_list``: pad to the batch's largest size, the mask True
    on padding."""
    images, targets = zip(*batch)
    h = max(im.shape[1] for im in images)
    w = max(im.shape[2] for im in images)
    x = images[0].new_zeros(len(images), 3, h, w)
    mask = torch.ones(len(images), h, w, dtype=torch.bool)
    for img, pad, m in zip(images, x, mask):
        pad[:, :img.shape[1], :img.shape[2]].copy_(img)
        m[:img.shape[1], :img.shape[2]] = False
    return x, mask, list(targets)


def hf_collate_fn(batch):
    """Hugging Face's ``DetrImageProcessor.pad``: ``pixel_mask`` 1 on the image, 0 on padding,
    the opposite of DETR's own mask."""
    x, mask, targets = collate_fn(batch)
    return x, (~mask).long(), targets


def loader(ds, batch_size: int = 4, collate=collate_fn) -> DataLoader:
    return DataLoader(ds, batch_size=batch_size, shuffle=False, collate_fn=collate)


# ---------------------------------------------------------------------------------------------
# box ops (DETR's util/box_ops.py)


def box_cxcywh_to_xyxy(x):
    cx, cy, w, h = x.unbind(-1)
    return torch.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], -1)


def box_iou(boxes1, boxes2):
    area1 = (boxes1[:, 2] - boxes1[:, 0]) * (boxes1[:, 3] - boxes1[:, 1])
    area2 = (boxes2[:, 2] - boxes2[:, 0]) * (boxes2[:, 3] - boxes2[:, 1])
    lt = torch.max(boxes1[:, None, :2], boxes2[:, :2])
    rb = torch.min(boxes1[:, None, 2:], boxes2[:, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[:, :, 0] * wh[:, :, 1]
    union = area1[:, None] + area2 - inter
    return inter / union, union


def generalized_box_iou(boxes1, boxes2):
    iou, union = box_iou(boxes1, boxes2)
    lt = torch.min(boxes1[:, None, :2], boxes2[:, :2])
    rb = torch.max(boxes1[:, None, 2:], boxes2[:, 2:])
    wh = (rb - lt).clamp(min=0)
    area = wh[:, :, 0] * wh[:, :, 1]
    return iou - (area - union) / area


# ---------------------------------------------------------------------------------------------
# the model


class Backbone(nn.Module):
    """Three stride-2 convs (stride 8) and DETR's mask downsampling to the feature map."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, 2, 1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 32, 3, 2, 1), nn.BatchNorm2d(32), nn.ReLU())

    def forward(self, x, mask):
        f = self.body(x)
        m = F.interpolate(mask[None].float(), size=f.shape[-2:]).to(torch.bool)[0]
        return f, m


def position_embedding_sine(mask, num_pos_feats: int = D // 2, temperature: float = 10000.0,
                            eps: float = 1e-6):
    """DETR's PositionEmbeddingSine(normalize=True) of the padding mask: each position's count
    of unpadded rows (columns) above it over its column's (row's) total, which is 0 in a
    column (row) of padding only."""
    not_mask = ~mask
    y_embed = not_mask.cumsum(1, dtype=torch.float32)
    x_embed = not_mask.cumsum(2, dtype=torch.float32)
    scale = 2 * math.pi
    y_embed = y_embed / (y_embed[:, -1:, :] + eps) * scale
    x_embed = x_embed / (x_embed[:, :, -1:] + eps) * scale
    dim_t = torch.arange(num_pos_feats, dtype=torch.float32)
    dim_t = temperature ** (2 * (dim_t // 2) / num_pos_feats)
    pos_x, pos_y = x_embed[:, :, :, None] / dim_t, y_embed[:, :, :, None] / dim_t
    pos_x = torch.stack((pos_x[:, :, :, 0::2].sin(), pos_x[:, :, :, 1::2].cos()), 4).flatten(3)
    pos_y = torch.stack((pos_y[:, :, :, 0::2].sin(), pos_y[:, :, :, 1::2].cos()), 4).flatten(3)
    return torch.cat((pos_y, pos_x), 3).permute(0, 3, 1, 2)


class EncoderLayer(nn.Module):
    def __init__(self, d: int = D, heads: int = 4, ff: int = 64):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d, heads, dropout=0.1)
        self.linear1, self.linear2 = nn.Linear(d, ff), nn.Linear(ff, d)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.dropout = nn.Dropout(0.1)

    def forward(self, src, key_padding_mask, pos):
        q = k = src + pos
        src2 = self.self_attn(q, k, value=src, key_padding_mask=key_padding_mask)[0]
        src = self.norm1(src + self.dropout(src2))
        src2 = self.linear2(self.dropout(F.relu(self.linear1(src))))
        return self.norm2(src + self.dropout(src2))


class DecoderLayer(nn.Module):
    def __init__(self, d: int = D, heads: int = 4, ff: int = 64):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d, heads, dropout=0.1)
        self.cross_attn = nn.MultiheadAttention(d, heads, dropout=0.1)
        self.linear1, self.linear2 = nn.Linear(d, ff), nn.Linear(ff, d)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.dropout = nn.Dropout(0.1)

    def forward(self, tgt, memory, memory_key_padding_mask, pos, query_pos):
        q = k = tgt + query_pos
        tgt = self.norm1(tgt + self.dropout(self.self_attn(q, k, value=tgt)[0]))
        tgt2 = self.cross_attn(tgt + query_pos, memory + pos, value=memory,
                               key_padding_mask=memory_key_padding_mask)[0]
        tgt = self.norm2(tgt + self.dropout(tgt2))
        tgt2 = self.linear2(self.dropout(F.relu(self.linear1(tgt))))
        return self.norm3(tgt + self.dropout(tgt2))


class MLP(nn.Module):
    def __init__(self, d_in, hidden, d_out, layers):
        super().__init__()
        dims = [d_in] + [hidden] * (layers - 1)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:] + [d_out]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = F.relu(layer(x)) if i < len(self.layers) - 1 else layer(x)
        return x


class DETR(nn.Module):
    """``pos_eps``: the position embedding's eps (DETR's 1e-6; 0 in a rewrite that drops it)."""

    def __init__(self, enc_layers: int = 2, dec_layers: int = 2, pos_eps: float = 1e-6):
        super().__init__()
        self.pos_eps = pos_eps
        self.backbone = Backbone()
        self.input_proj = nn.Conv2d(32, D, 1)
        self.query_embed = nn.Embedding(QUERIES, D)
        self.encoder = nn.ModuleList(EncoderLayer() for _ in range(enc_layers))
        self.decoder = nn.ModuleList(DecoderLayer() for _ in range(dec_layers))
        self.decoder_norm = nn.LayerNorm(D)
        self.class_embed = nn.Linear(D, CLASSES + 1)
        self.bbox_embed = MLP(D, D, 4, 3)

    def forward(self, images, mask):
        feat, mask = self.backbone(images, mask)
        pos = position_embedding_sine(mask, eps=self.pos_eps).flatten(2).permute(2, 0, 1)
        src = self.input_proj(feat).flatten(2).permute(2, 0, 1)  # (HW, B, D)
        mask = mask.flatten(1)
        for layer in self.encoder:
            src = layer(src, mask, pos)
        return self.decode(images, src, mask, pos)

    def decode(self, images, src, mask, pos):
        """The decoder over the encoder's memory ``(HW, B, D)``, and the heads."""
        query_pos = self.query_embed.weight[:, None].repeat(1, images.shape[0], 1)
        tgt, hs = torch.zeros_like(query_pos), []
        for layer in self.decoder:
            tgt = layer(tgt, src, mask, pos, query_pos)
            hs.append(self.decoder_norm(tgt).transpose(0, 1))  # (B, Q, D)
        hs = torch.stack(hs)
        logits, boxes = self.class_embed(hs), self.bbox_embed(hs).sigmoid()
        out = {"pred_logits": logits[-1], "pred_boxes": boxes[-1]}
        out["aux_outputs"] = [{"pred_logits": a, "pred_boxes": b}
                              for a, b in zip(logits[:-1], boxes[:-1])]
        return out


def make_detr() -> DETR:
    torch.manual_seed(0)
    return DETR()


def make_detr_no_eps() -> DETR:
    torch.manual_seed(0)
    return DETR(pos_eps=0.0)


# ---------------------------------------------------------------------------------------------
# Deformable DETR's encoder (one feature level): valid ratios of the padding mask, reference
# points normalised by them, deformable attention sampling the value map by grid_sample


def get_valid_ratio(mask):
    """Deformable DETR's: the unpadded share of each image's height and width, read on its
    first column and row."""
    _, h, w = mask.shape
    valid_h, valid_w = torch.sum(~mask[:, :, 0], 1), torch.sum(~mask[:, 0, :], 1)
    return torch.stack([valid_w.float() / w, valid_h.float() / h], -1)


def get_reference_points(h, w, valid_ratios):
    """Each cell's centre, normalised by the image's own unpadded size (B, HW, 2)."""
    ref_y, ref_x = torch.meshgrid(torch.linspace(0.5, h - 0.5, h),
                                  torch.linspace(0.5, w - 0.5, w), indexing="ij")
    ref_y = ref_y.reshape(-1)[None] / (valid_ratios[:, None, 1] * h)
    ref_x = ref_x.reshape(-1)[None] / (valid_ratios[:, None, 0] * w)
    return torch.stack((ref_x, ref_y), -1) * valid_ratios[:, None]


class MSDeformAttn(nn.Module):
    """Deformable attention over one level, ``ms_deform_attn_core_pytorch``'s grid_sample."""

    def __init__(self, d: int = D, heads: int = 4, points: int = 4):
        super().__init__()
        self.heads, self.points = heads, points
        self.sampling_offsets = nn.Linear(d, heads * points * 2)
        self.attention_weights = nn.Linear(d, heads * points)
        self.value_proj, self.output_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, query, reference_points, value, shape, padding_mask):
        b, lq, d = query.shape
        h, w = shape
        value = self.value_proj(value).masked_fill(padding_mask[..., None], 0.0)
        value = value.view(b, h * w, self.heads, d // self.heads).permute(0, 2, 3, 1)
        value = value.reshape(b * self.heads, d // self.heads, h, w)
        off = self.sampling_offsets(query).view(b, lq, self.heads, self.points, 2)
        attn = self.attention_weights(query).view(b, lq, self.heads, self.points).softmax(-1)
        loc = reference_points[:, :, None, None, :] + off / torch.tensor([w, h])
        grid = (2 * loc - 1).permute(0, 2, 1, 3, 4).reshape(b * self.heads, lq, self.points, 2)
        sampled = F.grid_sample(value, grid, mode="bilinear", padding_mode="zeros",
                                align_corners=False)  # (B*heads, d_h, Lq, points)
        attn = attn.permute(0, 2, 1, 3).reshape(b * self.heads, 1, lq, self.points)
        out = (sampled * attn).sum(-1).view(b, d, lq).transpose(1, 2)
        return self.output_proj(out)


class DeformableEncoderLayer(nn.Module):
    def __init__(self, d: int = D, ff: int = 64):
        super().__init__()
        self.self_attn = MSDeformAttn(d)
        self.linear1, self.linear2 = nn.Linear(d, ff), nn.Linear(ff, d)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, src, pos, reference_points, shape, padding_mask):
        src = self.norm1(src + self.self_attn(src + pos, reference_points, src, shape,
                                              padding_mask))
        return self.norm2(src + self.linear2(F.relu(self.linear1(src))))


class DeformableDETR(DETR):
    """DETR with Deformable DETR's encoder (batch-first), the decoder kept."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.ModuleList(DeformableEncoderLayer() for _ in range(2))

    def forward(self, images, mask):
        feat, mask = self.backbone(images, mask)
        h, w = feat.shape[-2:]
        valid_ratios = get_valid_ratio(mask)
        reference_points = get_reference_points(h, w, valid_ratios)
        pos = position_embedding_sine(mask, eps=self.pos_eps).flatten(2).transpose(1, 2)
        src, mask = self.input_proj(feat).flatten(2).transpose(1, 2), mask.flatten(1)
        for layer in self.encoder:
            src = layer(src, pos, reference_points, (h, w), mask)
        return self.decode(images, src.transpose(0, 1), mask, pos.transpose(0, 1))


def make_deformable_detr() -> DeformableDETR:
    torch.manual_seed(0)
    return DeformableDETR()


def param_groups(model: DETR, lr: float = 1e-4, lr_backbone: float = 1e-5):
    """DETR's main.py: the backbone at its own, lower learning rate."""
    return [{"params": [p for n, p in model.named_parameters() if "backbone" not in n]},
            {"params": [p for n, p in model.named_parameters() if "backbone" in n],
             "lr": lr_backbone}]


# ---------------------------------------------------------------------------------------------
# matching and losses


class HungarianMatcher(nn.Module):
    """DETR's matcher, the assignment by exhaustive search (a few targets per image): the
    queries assigned to the targets whose summed cost is least."""

    def __init__(self, cost_class: float = 1.0, cost_bbox: float = 5.0, cost_giou: float = 2.0):
        super().__init__()
        self.cost_class, self.cost_bbox, self.cost_giou = cost_class, cost_bbox, cost_giou

    @torch.no_grad()
    def forward(self, outputs, targets):
        indices = []
        for logits, boxes, t in zip(outputs["pred_logits"], outputs["pred_boxes"], targets):
            n = len(t["labels"])
            if n == 0:
                indices.append((torch.empty(0, dtype=torch.long),) * 2)
                continue
            prob = logits.softmax(-1)
            c = (self.cost_bbox * torch.cdist(boxes, t["boxes"], p=1)
                 - self.cost_class * prob[:, t["labels"]]
                 - self.cost_giou * generalized_box_iou(box_cxcywh_to_xyxy(boxes),
                                                        box_cxcywh_to_xyxy(t["boxes"])))
            perms = torch.tensor(list(itertools.permutations(range(len(boxes)), n)))
            best = perms[c[perms, torch.arange(n)].sum(1).argmin()]
            indices.append((best, torch.arange(n)))
        return indices


class SetCriterion(nn.Module):
    """DETR's SetCriterion: labels, boxes and GIoU over the matched pairs, for the last layer
    and each auxiliary one.

    ``clamp_num_boxes``: DETR's ``torch.clamp(num_boxes, min=1)``; ``per_image``: each image's
    box losses as a mean over its own matches, then over the images."""

    def __init__(self, eos_coef: float = 0.1, clamp_num_boxes: bool = True,
                 per_image: bool = False):
        super().__init__()
        self.matcher = HungarianMatcher()
        self.weight_dict = {"loss_ce": 1.0, "loss_bbox": 5.0, "loss_giou": 2.0}
        self.clamp_num_boxes, self.per_image = clamp_num_boxes, per_image
        empty_weight = torch.ones(CLASSES + 1)
        empty_weight[-1] = eos_coef
        self.register_buffer("empty_weight", empty_weight)

    def loss_labels(self, outputs, targets, indices):
        logits = outputs["pred_logits"]
        target_classes = torch.full(logits.shape[:2], CLASSES, dtype=torch.long)
        for b, (t, (src, tgt)) in enumerate(zip(targets, indices)):
            target_classes[b, src] = t["labels"][tgt]
        return F.cross_entropy(logits.transpose(1, 2), target_classes, self.empty_weight)

    def loss_boxes(self, outputs, targets, indices, num_boxes):
        if self.per_image:
            l1, giou = [], []
            for boxes, t, (src, tgt) in zip(outputs["pred_boxes"], targets, indices):
                src_b, tgt_b = boxes[src], t["boxes"][tgt]
                l1.append(F.l1_loss(src_b, tgt_b, reduction="none").sum(1).mean())
                giou.append((1 - torch.diag(generalized_box_iou(
                    box_cxcywh_to_xyxy(src_b), box_cxcywh_to_xyxy(tgt_b)))).mean())
            return torch.stack(l1).mean(), torch.stack(giou).mean()
        src_boxes = torch.cat([b[s] for b, (s, _) in zip(outputs["pred_boxes"], indices)])
        tgt_boxes = torch.cat([t["boxes"][j] for t, (_, j) in zip(targets, indices)])
        loss_bbox = F.l1_loss(src_boxes, tgt_boxes, reduction="none")
        loss_giou = 1 - torch.diag(generalized_box_iou(box_cxcywh_to_xyxy(src_boxes),
                                                       box_cxcywh_to_xyxy(tgt_boxes)))
        return loss_bbox.sum() / num_boxes, loss_giou.sum() / num_boxes

    def layer_losses(self, outputs, targets, num_boxes):
        indices = self.matcher(outputs, targets)
        l1, giou = self.loss_boxes(outputs, targets, indices, num_boxes)
        losses = {"loss_ce": self.loss_labels(outputs, targets, indices),
                  "loss_bbox": l1, "loss_giou": giou}
        return sum(self.weight_dict[k] * v for k, v in losses.items())

    def forward(self, outputs, targets):
        num_boxes = torch.as_tensor([float(sum(len(t["labels"]) for t in targets))])
        if self.clamp_num_boxes:
            num_boxes = torch.clamp(num_boxes, min=1)
        num_boxes = num_boxes.item()
        loss = self.layer_losses(outputs, targets, num_boxes)
        for aux in outputs["aux_outputs"]:
            loss = loss + self.layer_losses(aux, targets, num_boxes)
        return loss
