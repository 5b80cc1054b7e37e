"""The two training loops over one lifecycle: ``accelerate`` (the visible loop) and ``trainer``
(``transformers.Trainer``)."""
