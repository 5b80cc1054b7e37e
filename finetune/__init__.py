"""finetune: fine-tuning recipes on Hugging Face Accelerate with exact gradient accumulation.

Entry point: ``accelerate launch finetune/run.py --recipe NAME`` (or ``python finetune/run.py``).
"""

__version__ = "0.1.0"
