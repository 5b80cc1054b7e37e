"""A test recipe whose model normalises over the batch: bbc-news with a ``BatchNorm1d`` before the classifier of
``--model_name_or_path`` (a BERT). BatchNorm makes training depend on the micro-batch, so ``finetune verify``
must call it not exact and name BatchNorm. Shows the recipe contract's optional ``build_model``."""

from torch import nn

from finetune.models.loading import load_classifier
from finetune.recipes.bbc_news import DATASET, DEFAULTS, METRICS, NEEDS_HUB, TASK, TEXT_COLUMNS, load_raw_datasets  # noqa: F401

NAME = "batchnorm-news"
DESCRIPTION = "bbc-news with a BatchNorm1d before the classifier (a model that depends on the micro-batch)."


def build_model(config, label_names):
    model = load_classifier(config.model_name_or_path, label_names, disable_dropout=config.disable_dropout)
    hidden = model.config.hidden_size
    model.classifier = nn.Sequential(nn.BatchNorm1d(hidden), model.classifier)
    return model
