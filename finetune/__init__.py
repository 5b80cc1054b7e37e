"""finetune: fine-tuning recipes on Hugging Face Accelerate with exact gradient accumulation.

Entry point: ``accelerate launch finetune/run.py --recipe NAME`` (or ``python finetune/run.py``).
"""

import importlib.util
import os
import sys

__version__ = "0.1.0"


def _load_checkout_recipes() -> None:
    """In a source checkout (no ``finetune/recipes/__init__.py``, a sibling ``recipes/__init__.py``), load that
    folder as ``finetune.recipes``; an installed copy has ``finetune/recipes/`` (pyproject's ``package-dir``)."""
    here = os.path.dirname(os.path.abspath(__file__))
    folder = os.path.join(os.path.dirname(here), "recipes")
    init = os.path.join(folder, "__init__.py")
    name = f"{__name__}.recipes"
    # finetune/recipes/__init__.py, not the folder: git leaves finetune/recipes/__pycache__/ where it removed the rest
    if name in sys.modules or os.path.isfile(os.path.join(here, "recipes", "__init__.py")) or not os.path.isfile(init):
        return
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    globals()["recipes"] = module


# Registered under its package name only (no top-level `recipes`, no import hook another finder could pre-empt).
_load_checkout_recipes()
