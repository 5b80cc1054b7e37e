"""``finetune export``: a run's model merged (no peft), converted to GGUF, described for Ollama, and verified against
the run that made it (see docs/export.md)."""
