"""Input optimisation as the well-known repositories write it: a frozen VGG-like feature
extractor and the IMAGE as the only tensor an optimizer trains.

- PyTorch's neural style tutorial (``advanced/neural_style_tutorial.py``): a ``Normalization``
  module, ``gram_matrix`` normalised by ``a * b * c * d``, ``ContentLoss``/``StyleLoss``
  modules spliced into an ``nn.Sequential`` named ``conv_i``/``relu_i``/``pool_i`` that keep
  their ``self.loss`` aside, ``optim.LBFGS([input_img])`` with a closure that clamps the image
  in place under ``no_grad``.
- pytorch/examples' ``fast_neural_style`` (``Vgg16`` returning the relu slices, ``gram_matrix``
  as ``features.bmm(features_t) / (ch * h * w)``) with a loss function beside the model, and
  the total-variation prior of Mahendran & Vedaldi (``TV^beta`` with ``beta = 1``:
  ``sqrt(dx ** 2 + dy ** 2)``), as neural-style re-implementations write it.
- neural-style-pt's ``TVLoss`` module spliced first into the net (with the ``beta = 1`` sqrt
  above) and its Caffe-range pixels (0..255, BGR means subtracted).
- DeepDream (google/deepdream's ``make_step``, gordicaleksa/pytorch-deepdream): the loss is a
  layer's activation, the loop ascends ``img.data += lr * g / g.abs().mean()`` itself.

The recorder refuses an optimizer that holds no parameter of the model, so the image an
optimizer trains is held in the model as an ``nn.Parameter`` (``StyleTransfer``: lucent's
``param.image`` keeps it beside the net the same way); a leaf image stepped by the loop is the
model's input, recorded with ``optimizer=None``.

The factories of ``test_style_transfer.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SIDE = 16
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # ImageNet's, as the tutorial's
CAFFE_MEAN = [103.939, 116.779, 123.68]


class Normalization(nn.Module):
    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(-1, 1, 1))
        self.register_buffer("std", torch.tensor(std).view(-1, 1, 1))

    def forward(self, img):
        return (img - self.mean) / self.std


def vgg_features() -> nn.Sequential:
    """A tiny ``vgg19().features``: conv-relu pairs and max-pools, frozen."""
    torch.manual_seed(0)
    cnn = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2, 2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(inplace=True))
    return cnn.eval().requires_grad_(False)


def gram_matrix(input):
    a, b, c, d = input.size()  # a=batch size(=1), b=number of feature maps, (c,d)=dims
    features = input.view(a * b, c * d)
    G = torch.mm(features, features.t())
    return G.div(a * b * c * d)


class ContentLoss(nn.Module):
    def __init__(self, target):
        super().__init__()
        self.target = target.detach()

    def forward(self, input):
        self.loss = F.mse_loss(input, self.target)
        return input


class StyleLoss(nn.Module):
    def __init__(self, target_feature):
        super().__init__()
        self.target = gram_matrix(target_feature).detach()

    def forward(self, input):
        G = gram_matrix(input)
        self.loss = F.mse_loss(G, self.target)
        return input


def content_image() -> torch.Tensor:
    """A photo-like content image with a flat white sky over its top rows (a saturated
    region: every pixel exactly 1.0), as real photos have."""
    g = torch.Generator().manual_seed(1)
    img = torch.rand(1, 3, SIDE, SIDE, generator=g) * 0.8 + 0.1
    img[..., :4, :] = 1.0
    return img


def style_image() -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.rand(1, 3, SIDE, SIDE, generator=g)


def get_style_model_and_losses(cnn, style_img, content_img, content_layers=("conv_4",),
                               style_layers=("conv_1", "conv_2", "conv_3", "conv_4"),
                               normalization=None):
    """The tutorial's builder: the losses spliced into a fresh ``nn.Sequential``."""
    model = nn.Sequential(normalization or Normalization(MEAN, STD))
    content_losses, style_losses = [], []
    i = 0
    for layer in cnn.children():
        if isinstance(layer, nn.Conv2d):
            i += 1
            name = f"conv_{i}"
        elif isinstance(layer, nn.ReLU):
            name = f"relu_{i}"
            layer = nn.ReLU(inplace=False)  # the in-place one doesn't play well with the losses
        else:
            name = f"pool_{i}"
        model.add_module(name, layer)
        if name in content_layers:
            target = model(content_img).detach()
            content_loss = ContentLoss(target)
            model.add_module(f"content_loss_{i}", content_loss)
            content_losses.append(content_loss)
        if name in style_layers:
            target_feature = model(style_img).detach()
            style_loss = StyleLoss(target_feature)
            model.add_module(f"style_loss_{i}", style_loss)
            style_losses.append(style_loss)
    return model.requires_grad_(False), style_losses, content_losses


class TVLoss(nn.Module):
    """neural-style-pt's ``TVLoss``, spliced first into the net, with Mahendran & Vedaldi's
    ``beta = 1`` prior: ``sqrt(dx ** 2 + dy ** 2)`` per pixel (neural-style-pt takes abs)."""

    def __init__(self, strength):
        super().__init__()
        self.strength = strength

    def forward(self, input):
        self.x_diff = input[:, :, 1:, :-1] - input[:, :, :-1, :-1]
        self.y_diff = input[:, :, :-1, 1:] - input[:, :, :-1, :-1]
        self.loss = self.strength * torch.sqrt(self.x_diff ** 2 + self.y_diff ** 2).sum()
        return input


class StyleTransfer(nn.Module):
    """The image the optimizer trains, held in the model as a parameter (lucent's
    ``param.image`` keeps it beside the net the same way), fed to the tutorial's net."""

    def __init__(self, net, init):
        super().__init__()
        self.image = nn.Parameter(init.clone())
        self.net = net

    def forward(self):
        return self.net(self.image)


def make_style_model(tv_weight: float = 0.0, caffe: bool = False) -> StyleTransfer:
    """``caffe``: images in 0..255 with the BGR means subtracted, as the Caffe VGG weights
    that jcjohnson's neural-style and neural-style-pt load expect."""
    scale, norm = (255.0, Normalization(CAFFE_MEAN, [1.0, 1.0, 1.0])) if caffe else (1.0, None)
    net = get_style_model_and_losses(vgg_features(), style_image() * scale,
                                     content_image() * scale, normalization=norm)[0]
    if tv_weight:
        net = nn.Sequential(TVLoss(tv_weight), *net)  # (names 0, 1, ...: neural-style-pt's)
    return StyleTransfer(net, content_image() * scale)


def make_style_model_caffe() -> StyleTransfer:
    return make_style_model(caffe=True)


def make_style_model_tv() -> StyleTransfer:
    return make_style_model(tv_weight=1e-3)


def tutorial_losses(model):
    """The loss modules of the tutorial's model: style, content and TV, in order."""
    kinds = (StyleLoss, ContentLoss, TVLoss)
    return [[m for m in model.modules() if isinstance(m, k)] for k in kinds]


# ---------------------------------------------------------------------------------------------
# pytorch/examples' fast_neural_style: a feature extractor returning slices, a loss beside it


class Vgg16(nn.Module):
    def __init__(self):
        super().__init__()
        features = vgg_features()
        self.norm = Normalization(MEAN, STD)
        self.slice1 = features[:4]
        self.slice2 = features[4:]
        self.requires_grad_(False)

    def forward(self, X):
        h_relu1_2 = self.slice1(self.norm(X))
        h_relu2_2 = self.slice2(h_relu1_2)
        return h_relu1_2, h_relu2_2


def make_vgg16() -> Vgg16:
    return Vgg16().eval()


def make_fast_style() -> StyleTransfer:
    """The content image as the parameter, fed to ``Vgg16``."""
    return StyleTransfer(Vgg16().eval(), content_image())


def style_targets(vgg: Vgg16):
    """The content target (relu2_2 of the content image) and the style image's Grams."""
    with torch.no_grad():
        return vgg(content_image())[1], [gram(f) for f in vgg(style_image())]


def gram(y):
    (b, ch, h, w) = y.size()
    features = y.view(b, ch, w * h)
    features_t = features.transpose(1, 2)
    return features.bmm(features_t) / (ch * h * w)


def tv_loss(img, beta: float = 1.0):
    """Mahendran & Vedaldi's ``TV^beta``: ``sum((dx^2 + dy^2) ** (beta / 2))``, beta = 1."""
    dx = img[:, :, :-1, 1:] - img[:, :, :-1, :-1]
    dy = img[:, :, 1:, :-1] - img[:, :, :-1, :-1]
    return torch.sqrt(dx ** 2 + dy ** 2).sum() if beta == 1 else \
        ((dx ** 2 + dy ** 2) ** (beta / 2)).sum()


def tv_loss_eps(img, eps: float = 1e-8):
    dx = img[:, :, :-1, 1:] - img[:, :, :-1, :-1]
    dy = img[:, :, 1:, :-1] - img[:, :, :-1, :-1]
    return torch.sqrt(dx ** 2 + dy ** 2 + eps).sum()


def style_transfer_loss(features, content_target, style_grams, img,
                        content_weight=1.0, style_weight=1e5, tv_weight=1e-3):
    """Content loss on relu2_2, Gram style loss on both slices, and the TV prior of the image."""
    content = F.mse_loss(features[1], content_target)
    style = sum(F.mse_loss(gram(f), s) for f, s in zip(features, style_grams))
    return content_weight * content + style_weight * style + tv_weight * tv_loss(img)


def style_transfer_loss_eps(features, content_target, style_grams, img,
                            content_weight=1.0, style_weight=1e5, tv_weight=1e-3):
    content = F.mse_loss(features[1], content_target)
    style = sum(F.mse_loss(gram(f), s) for f, s in zip(features, style_grams))
    return content_weight * content + style_weight * style + tv_weight * tv_loss_eps(img)


# ---------------------------------------------------------------------------------------------
# DeepDream: the activation of a layer is the objective


class DreamNet(nn.Module):
    """The extractor up to the dreamed layer (relu1_2); returns that layer's activation."""

    def __init__(self, upto: int = 4):
        super().__init__()
        self.norm = Normalization(MEAN, STD)
        self.features = vgg_features()[:upto]
        self.requires_grad_(False)

    def forward(self, x):
        return self.features(self.norm(x))


def make_dream_net() -> DreamNet:
    return DreamNet().eval()


def dream_objective(act, channel: int):
    """google/deepdream's ``objective_L2`` on one channel (lucent's ``channel`` objective):
    ascend that unit's energy."""
    return act[:, channel].pow(2).mean()


def gray_image() -> torch.Tensor:
    """Feature visualisation's usual start: a flat gray image."""
    return torch.full((1, 3, SIDE, SIDE), 0.5)
