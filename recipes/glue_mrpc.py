"""glue-mrpc: paraphrase detection on GLUE MRPC with bert-base-cased, the canonical Accelerate example
(`examples/nlp_example.py`). Needs the Hugging Face Hub, or local copies:
``--model_name_or_path /path/to/bert-base-cased --train_file train.csv --validation_file dev.csv``
with columns ``sentence1``, ``sentence2``, ``label`` (0 = not equivalent, 1 = equivalent).
"""

from __future__ import annotations

NAME = "glue-mrpc"
DESCRIPTION = "Paraphrase detection on GLUE MRPC (3,668 train pairs), bert-base-cased; needs the hub."
TASK = "sequence-classification"
DATASET = "GLUE MRPC (nyu-mll/glue, config mrpc, from the hub)"
NEEDS_HUB = True
TEXT_COLUMNS = ("sentence1", "sentence2")
METRICS = {"accuracy": {}, "f1": {"average": "binary"}}  # GLUE reports binary F1 for MRPC
HUB_DATASET = ("nyu-mll/glue", "mrpc")

# As in Accelerate's nlp_example.py: lr 2e-5, 3 epochs, batch 16, seed 42.
DEFAULTS = {
    "model_name_or_path": "bert-base-cased",
    "per_device_train_batch_size": 16,
    "gradient_accumulation_steps": 1,
    "learning_rate": 2e-5,
    "num_train_epochs": 3.0,
    "warmup_steps": 100,
    "max_length": 128,
    "per_device_eval_batch_size": 32,
}


def load_raw_datasets(config):
    """GLUE MRPC train/validation from the hub. Raises ``HubUnreachableError`` (fast, with the local
    alternative) when the hub cannot be reached."""
    import datasets

    from finetune.data.loading import require_hub

    require_hub(
        f"dataset {HUB_DATASET[0]}/{HUB_DATASET[1]}",
        "pass local copies with --train_file train.csv --validation_file dev.csv "
        "(columns sentence1, sentence2, label)",
    )
    raw = datasets.load_dataset(*HUB_DATASET, cache_dir=config.cache_dir)
    return datasets.DatasetDict({"train": raw["train"], "validation": raw["validation"]})
