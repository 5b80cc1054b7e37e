"""A test recipe whose model's outputs depend on padding: bbc-news on a BERT that averages the last hidden states
over every position, pad tokens included (the attention mask ignored when pooling). Each micro-batch pads to its
own longest sample, so ``finetune verify`` must call it not exact and name padding as the cause."""

from transformers.modeling_outputs import SequenceClassifierOutput

from finetune.models.loading import load_classifier
from finetune.recipes.bbc_news import DATASET, DEFAULTS, METRICS, NEEDS_HUB, TASK, TEXT_COLUMNS, load_raw_datasets  # noqa: F401

NAME = "padding-news"
DESCRIPTION = "bbc-news on a BERT that mean-pools over pad tokens too (outputs depend on padding)."


def _forward(self, input_ids=None, attention_mask=None, token_type_ids=None, **kwargs):
    hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state
    return SequenceClassifierOutput(logits=self.classifier(hidden.mean(dim=1)))


def build_model(config, label_names):
    model = load_classifier(config.model_name_or_path, label_names, disable_dropout=config.disable_dropout)
    model.forward = _forward.__get__(model)  # mean over all positions: pad tokens count
    return model
