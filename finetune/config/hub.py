"""The Hub section: whether and where the run is pushed to the Hugging Face Hub, and what is pushed when."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from finetune.config.flags import flag
from finetune.errors import FinetuneError


@dataclass
class HubArguments:
    """``--push_to_hub`` and its repository, strategy and visibility (``TrainingArguments`` names)."""

    push_to_hub: bool = flag(
        False,
        "Upload the model directory to the Hugging Face Hub (huggingface_hub's HfApi, "
        "main process only): at the end, and per --hub_strategy after checkpoints. "
        "Needs a token (`hf auth login` or HF_TOKEN); checked before training.",
        step=False, trainer=None, same_run=False,
    )
    hub_model_id: str | None = flag(
        None,
        "The Hub repository (TrainingArguments' name): 'name' (your namespace) or "
        "'org/name'. Default: <your user>/<the --output_dir folder's name>.",
        step=False, trainer=None, same_run=False,
    )
    hub_strategy: Literal["end", "every_save", "checkpoint", "all_checkpoints"] = flag(
        "every_save",
        "What to push and when, as TrainingArguments: 'end' (the final model "
        "only), 'every_save' (also the model of every checkpoint, in the "
        "background), 'checkpoint' (and the newest checkpoint in "
        "last-checkpoint/, to resume from), 'all_checkpoints' (each one in "
        "its own folder).",
        step=False, trainer=None, same_run=False,
    )
    hub_private_repo: bool | None = flag(
        None,
        "Create the repository private (default: public unless the organisation's "
        "default is private; ignored if the repository exists).",
        step=False, trainer=None, same_run=False,
    )

    def _check_hub(self) -> None:
        """The Hub repository: named only with ``--push_to_hub``, and a valid repository id."""
        if self.hub_model_id is not None and not self.push_to_hub:
            raise FinetuneError("--hub_model_id is used only with --push_to_hub: add --push_to_hub, or drop "
                                "--hub_model_id.")
        if self.hub_model_id is not None:
            from huggingface_hub.utils import HFValidationError, validate_repo_id

            try:
                validate_repo_id(self.hub_model_id)
            except HFValidationError as err:
                raise FinetuneError(f"--hub_model_id {self.hub_model_id!r} is not a Hub repository id ({err}). "
                                    "Use 'name' or 'org/name'.") from None
