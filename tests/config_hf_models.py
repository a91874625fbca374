"""A Hugging Face config and the model built from it (``test_config_args``), apart from
``config_models`` so that only the test that needs transformers imports it."""

from __future__ import annotations

from config_models import DIM
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel


class TinyConfig(PretrainedConfig):
    model_type = "nanreplay-tiny"

    def __init__(self, n_layers=1, layer_norm_eps=1e-5, **kwargs):
        self.n_layers, self.layer_norm_eps = n_layers, layer_norm_eps
        super().__init__(**kwargs)


class TinyModel(PreTrainedModel):
    config_class = TinyConfig

    def __init__(self, config):
        super().__init__(config)
        self.norm = nn.LayerNorm(DIM, eps=config.layer_norm_eps)
        self.fcs = nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(config.n_layers)])
        self.head = nn.Linear(DIM, 3)

    def forward(self, x):
        return self.head(self.fcs(self.norm(x)))
