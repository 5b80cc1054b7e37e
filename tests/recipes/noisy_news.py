"""A test recipe whose model stays random with dropout off: bbc-news with a noise layer (not a ``torch.nn.Dropout``,
and no dropout setting of the config) before the classifier of ``--model_name_or_path`` (a BERT). ``finetune
verify`` must find its determinism premise broken, call the check inconclusive and name the noise layer."""

import torch
from torch import nn

from finetune.models.loading import load_classifier
from finetune.recipes.bbc_news import DATASET, DEFAULTS, METRICS, NEEDS_HUB, TASK, TEXT_COLUMNS, load_raw_datasets  # noqa: F401

NAME = "noisy-news"
DESCRIPTION = "bbc-news with Gaussian noise on the pooled output in training mode (a model that is not deterministic)."


class Noise(nn.Module):
    """Adds N(0, 0.1²) noise in training mode, as a regulariser would."""

    def forward(self, x):
        return x + 0.1 * torch.randn_like(x) if self.training else x


def build_model(config, label_names):
    model = load_classifier(config.model_name_or_path, label_names, disable_dropout=config.disable_dropout)
    model.classifier = nn.Sequential(Noise(), model.classifier)
    return model
