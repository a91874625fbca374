"""replay.external_grads: the gradient each root output received from outside the model, for a
model whose logits are computed from other outputs it returns (a Hugging Face decoder's cached
keys and values): one backward per set of senders, the same split as one backward per output."""

import torch
from torch import nn

from replay import external_grads


class CachedDecoder(nn.Module):
    """Returns its logits and each layer's cached keys, the logits computed from all of them."""

    def __init__(self, layers=4, dim=8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.head = nn.Linear(dim, 5)

    def forward(self, x):
        cache = []
        for layer in self.layers:
            x = torch.tanh(layer(x))
            cache.append(x * 1.0)
        return self.head(x + sum(cache)), cache


def _recorded(model, x, extra_on):
    """Root outputs and the gradients training recorded for them: the loss's on the logits,
    each cached tensor what the logits sent it, one cached tensor also a term of its own."""
    torch.manual_seed(1)
    logits, cache = model(x)
    g_logits = torch.randn_like(logits)
    sent = torch.autograd.grad(logits, cache, g_logits, retain_graph=True)
    own = torch.randn_like(cache[extra_on])
    recorded = [s + own if i == extra_on else s for i, s in enumerate(sent)]
    return [(logits, g_logits)] + list(zip(cache, recorded)), own


def test_cached_outputs_split_in_one_backward(monkeypatch):
    torch.manual_seed(0)
    model, x = CachedDecoder(), torch.randn(3, 8)
    pairs, own = _recorded(model, x, extra_on=2)
    calls = []
    grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or grad(*a, **k))
    kept = external_grads.external(pairs)
    # the logits keep the loss's gradient; of the cached tensors only the one with a term of
    # its own is kept, with that term alone; one backward for all four cached tensors
    assert [t is pairs[0][0] for t, _ in kept] == [True, False]
    assert torch.equal(kept[0][1], pairs[0][1])
    assert kept[1][0] is pairs[3][0]
    torch.testing.assert_close(kept[1][1], own)
    assert len(calls) == 1


def test_split_matches_one_backward_per_output():
    torch.manual_seed(0)
    model, x = CachedDecoder(layers=3), torch.randn(2, 8)
    pairs, _ = _recorded(model, x, extra_on=0)
    logits, g = pairs[0]
    kept = dict((id(t), v) for t, v in external_grads.external(pairs))
    for out, rec in pairs[1:]:
        sent = torch.autograd.grad(logits, out, g, retain_graph=True)[0]
        rest = (rec.double() - sent.double()).to(rec.dtype)
        if id(out) in kept:
            assert torch.equal(kept[id(out)], rest)  # bit for bit the per-output result
        else:
            assert float(rest.double().norm()) <= 1e-3 * float(rec.double().norm())
