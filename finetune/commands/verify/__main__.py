"""``python -m finetune.commands.verify`` (``accelerate launch --module finetune.commands.verify``): ``main``."""

import sys

from finetune.commands.verify import main

sys.exit(main())
