"""Deep metric learning with pytorch-metric-learning, for ``test_metric_learning_pml``: an
embedding network (an MLP trunk, a linear embedding head, an optional hand-written L2
normalisation), class-clustered records for ``samplers.MPerClassSampler``, and the losses as
their users write them: ``TripletMarginLoss`` with a miner, ``ArcFaceLoss`` with its own
optimizer, ``NTXentLoss`` with a temperature, and three hand-written losses (a SupCon with
``exp(sim / T)``, a batch-hard triplet averaged over its valid anchors, Frosst et al.'s soft
nearest neighbour loss).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pytorch_metric_learning import distances, losses, miners, reducers
from torch import nn
from torch.utils.data import Dataset

N_CLASSES, IN_DIM, EMB = 4, 12, 8


class L2Norm(nn.Module):
    """The embedding projected onto the unit sphere, written as most repositories write it."""

    def forward(self, x):
        return x / x.norm(p=2, dim=1, keepdim=True)


class EmbeddingNet(nn.Module):
    """Trunk and embedder (pml's ``trunk`` / ``embedder`` pair in one module)."""

    def __init__(self, normalize: bool = False, bias: bool = True):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(IN_DIM, 32, bias=bias), nn.ReLU(),
                                   nn.Linear(32, 32, bias=bias), nn.ReLU())
        self.embedder = nn.Linear(32, EMB, bias=bias)
        self.norm = L2Norm() if normalize else nn.Identity()

    def forward(self, x):
        return self.norm(self.embedder(self.trunk(x)))


def make_net():
    torch.manual_seed(0)
    return EmbeddingNet()


def make_normed_net():
    torch.manual_seed(0)
    return EmbeddingNet(normalize=True, bias=False)


class Records(Dataset):
    """``n`` records of ``N_CLASSES`` Gaussian clusters; ``labels`` as MPerClassSampler reads them."""

    def __init__(self, n: int = 64, seed: int = 0, scale: float = 1.0):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.arange(n) % N_CLASSES
        centres = torch.randn(N_CLASSES, IN_DIM, generator=g) * 2.0
        self.x = (centres[self.labels] + 0.5 * torch.randn(n, IN_DIM, generator=g)) * scale

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.x[i], self.labels[i]


def triplet_loss():
    return losses.TripletMarginLoss(margin=0.2, distance=distances.LpDistance(),
                                    reducer=reducers.AvgNonZeroReducer())


def triplet_miner():
    return miners.TripletMarginMiner(margin=0.2, type_of_triplets="semihard")


def ms_miner():
    return miners.MultiSimilarityMiner(epsilon=0.1)


def xbm_loss():
    """Cross-batch memory around a contrastive loss: the miner also mines the memory."""
    return losses.CrossBatchMemory(losses.ContrastiveLoss(), embedding_size=EMB, memory_size=32,
                                   miner=miners.MultiSimilarityMiner(epsilon=0.1))


def arcface_loss():
    torch.manual_seed(1)
    return losses.ArcFaceLoss(num_classes=N_CLASSES, embedding_size=EMB, margin=28.6, scale=64)


def ntxent_loss(temperature: float = 0.07):
    return losses.NTXentLoss(temperature=temperature)


class SupConLoss(nn.Module):
    """Supervised contrastive loss as many repositories write it: ``exp(sim / T)`` summed over
    the other records, without the row maximum subtracted first."""

    def __init__(self, temperature: float = 0.1):
        super().__init__()
        self.temperature = temperature

    def forward(self, embeddings, labels):
        z = F.normalize(embeddings, dim=1)
        sim = z @ z.t()
        eye = torch.eye(len(labels), dtype=torch.bool, device=z.device)
        pos = (labels[:, None] == labels[None, :]) & ~eye
        exp = torch.exp(sim / self.temperature).masked_fill(eye, 0.0)
        log_prob = sim / self.temperature - torch.log(exp.sum(1, keepdim=True))
        return -((log_prob * pos).sum(1) / pos.sum(1).clamp_min(1)).mean()


class BatchHardTriplet(nn.Module):
    """Batch-hard triplet loss on squared Euclidean distances, averaged over the anchors that
    have a positive (written without a floor on that count)."""

    def __init__(self, margin: float = 0.3):
        super().__init__()
        self.margin = margin

    def forward(self, embeddings, labels):
        d = torch.cdist(embeddings, embeddings).pow(2)
        same = labels[:, None] == labels[None, :]
        eye = torch.eye(len(labels), dtype=torch.bool, device=d.device)
        pos = same & ~eye
        hardest_pos = (d * pos).amax(1)
        hardest_neg = d.masked_fill(same, float("inf")).amin(1)
        valid = pos.any(1).to(d.dtype)
        per_anchor = F.relu(hardest_pos - hardest_neg + self.margin) * valid
        return per_anchor.sum() / valid.sum()


class SoftNearestNeighbour(nn.Module):
    """Frosst et al.'s soft nearest neighbour loss on squared Euclidean distances of the raw
    embeddings, at temperature ``T``."""

    def __init__(self, temperature: float = 1.0):
        super().__init__()
        self.temperature = temperature

    def forward(self, embeddings, labels):
        d = torch.cdist(embeddings, embeddings).pow(2)
        eye = torch.eye(len(labels), dtype=torch.bool, device=d.device)
        sim = torch.exp(-d / self.temperature).masked_fill(eye, 0.0)
        same = (labels[:, None] == labels[None, :]) & ~eye
        return -torch.log((sim * same).sum(1) / sim.sum(1)).mean()
