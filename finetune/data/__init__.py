"""Loading what a run needs, below the tasks: models and tokenizers (``loading``, ``gguf``, ``fetch``, ``lora``,
``dropout``), data files and tokenization (``loading``), conversations through the chat template (``chat``),
packing (``packing``)."""
