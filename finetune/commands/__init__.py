"""The commands besides training: ``verify``, ``plan``, ``predict``, ``check_data``, ``compare``, ``env``, and
``launch`` (``finetune train``'s launcher)."""
