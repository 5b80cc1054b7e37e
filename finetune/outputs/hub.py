"""``--push_to_hub``: a run's model directory on the Hugging Face Hub, through ``huggingface_hub.HfApi``, with
TrainingArguments' flags and meanings (``hub_model_id``, ``hub_strategy``, ``hub_private_repo``) and what
transformers' Trainer does with them (transformers 5.24 ``trainer.py``: ``init_hf_repo`` creates the repository
with ``exist_ok=True``; ``_push_from_checkpoint`` uploads the model after each save with ``run_as_future=True``, and
skips a save while the previous push is still running; ``push_to_hub`` waits for those, then uploads the output
directory without its checkpoints, "End of training").

Unlike Trainer, a save during a running push is queued, not skipped: the newest checkpoint always reaches the Hub
(``--hub_strategy checkpoint``: ``last-checkpoint/``). An upload queued but not started is superseded by the next
save's to the same place (the root's model files, ``last-checkpoint/``; never an ``all_checkpoints`` folder), so at
most one runs and one waits. A checkpoint an upload still reads is not pruned (``held``, given to
``checkpoint.prune``): ``--save_total_limit`` pruned it under a running upload ("... is not a directory"); the
prune it missed runs again once the uploads are done (``at_end``: ``prune_later``).

Both backends call one ``HubPush`` at the same two points: ``after_save`` once a checkpoint is complete (the Trainer
backend through its ``HubCallback``), ``at_end`` once the final model, ``metrics.json`` and the model card are
written. Only the main process (``RANK`` 0) pushes.
An upload never fails or blocks the training: the background uploads run on HfApi's own one-worker thread pool,
and a failed upload is a ``warning:`` line (the run's folder is left as it is). What cannot work (offline, no
token, a token that cannot write there) is refused by ``prepare`` before training, with one ``error:`` line.
"""

from __future__ import annotations

import json
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from huggingface_hub import HfApi, constants, get_token
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import HFValidationError, validate_repo_id
from tqdm.auto import tqdm

from finetune.distributed import WRITE_PROBE, is_main_process
from finetune.errors import FinetuneError

# What the end-of-training upload leaves out: the checkpoints (Trainer: f"{PREFIX_CHECKPOINT_DIR}-*"; ours live in
# checkpoints/, where the Trainer backend's TensorBoard runs/ also is, which goes up), Trainer's "_*", write probes.
END_IGNORE = ["checkpoints/step_*", "checkpoints/checkpoint-*", "checkpoints/.*", "_*", f"{WRITE_PROBE}*"]
# A checkpoint's model files (every_save: weights, config, generation config, tokenizer), not its training state.
# Trainer copies CONFIG_NAME, GENERATION_CONFIG_NAME, the weights and the tokenizer the same way.
MODEL_FILES = ["*.safetensors", "*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
TRAINING_STATE = ["trainer_state.json", "manifest.json", "finetune_progress.json", "optimizer*", "scheduler*",
                  "random_states*", "rng_state*", "scaler*"]
WHOAMI_TIMEOUT_S = 15.0  # huggingface_hub's session has no timeout (utils/_http.py: timeout=None)


def _whoami(api: HfApi, token: str, timeout_s: float) -> dict:
    """``api.whoami(token=token)``, bounded by ``timeout_s`` seconds (a daemon thread, as ``data.hub_reachable``).
    Raises what ``whoami`` raised, or ``TimeoutError``."""
    outcome: dict = {}

    def ask() -> None:
        try:
            outcome["value"] = api.whoami(token=token)
        except Exception as err:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = err

    thread = threading.Thread(target=ask, name="finetune-hub-whoami", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if "error" in outcome:
        raise outcome["error"]
    if "value" not in outcome:
        raise TimeoutError(f"no answer within {timeout_s:.0f} s")
    return outcome["value"]


def resolve_repo_id(config, user: str) -> str:
    """The repository ``config`` pushes to: ``--hub_model_id`` (``name`` goes to ``user``'s namespace), else
    ``user/<the --output_dir folder's name>`` (Trainer's ``init_hf_repo`` default). Raises ``FinetuneError`` for a
    name the Hub does not accept (``huggingface_hub.utils.validate_repo_id``)."""
    name = config.hub_model_id or Path(config.output_dir).absolute().name
    repo_id = name if "/" in name else f"{user}/{name}"
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise FinetuneError(f"--push_to_hub: {repo_id!r} is not a Hub repository id ({err}). Name the repository "
                            "with --hub_model_id NAME or ORG/NAME.") from None
    return repo_id


def prepare(config, api: HfApi | None = None, timeout_s: float = WHOAMI_TIMEOUT_S) -> "HubPush | None":
    """Before training: whether this run can push, and to which repository; the ``HubPush`` on the main process
    (None elsewhere, or without ``--push_to_hub``). Creates nothing: the repository is created at the first push
    (``create_repo(exist_ok=True)``, queued before the upload on HfApi's thread pool).

    Raises ``FinetuneError`` (one line: the problem and the fix) when the Hub is off (``HF_HUB_OFFLINE``), no token
    is set (``huggingface_hub.get_token``: ``HF_TOKEN``, then ``hf auth login``'s file), the Hub does not answer
    ``whoami`` within ``timeout_s`` seconds or refuses the token, the token is read-only, or the repository's
    namespace is neither the token's user nor one of its organisations."""
    if not config.push_to_hub:
        return None
    # offline mode and the token: the same answer on every process (each says it, as one error); the Hub: rank 0
    later = f"or drop --push_to_hub (upload {config.output_dir} later with `hf upload REPO {config.output_dir}`)"
    if constants.is_offline_mode():
        raise FinetuneError("--push_to_hub needs the Hugging Face Hub, and offline mode is on (HF_HUB_OFFLINE or "
                            f"TRANSFORMERS_OFFLINE is set). Unset it where the Hub can be reached, {later}.")
    api = api if api is not None else HfApi()
    token = api.token if isinstance(api.token, str) else get_token()
    if token is None:
        raise FinetuneError(f"--push_to_hub needs a Hugging Face token with write access, and none is set. Run `hf "
                            f"auth login` or set HF_TOKEN, {later}.")
    if not is_main_process():
        return None
    try:
        who = _whoami(api, token, timeout_s)
    except HfHubHTTPError as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        what = "refused the token" if status == 401 else f"answered HTTP {status}"
        raise FinetuneError(f"--push_to_hub: the Hugging Face Hub {what} ({str(err).splitlines()[0]}). Set a valid "
                            f"token (`hf auth login --force` or HF_TOKEN), {later}.") from None
    except Exception as err:  # noqa: BLE001 - httpx connection errors, TimeoutError: the Hub is out of reach
        raise FinetuneError(f"--push_to_hub: the Hugging Face Hub cannot be reached from this machine "
                            f"({type(err).__name__}: {err}). Check the network, HF_ENDPOINT and HTTPS_PROXY, "
                            f"{later}.") from None
    user = who.get("name")
    role = ((who.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise FinetuneError(f"--push_to_hub: the token of {user!r} is read-only. Create a token with write access "
                            f"(https://huggingface.co/settings/tokens) and `hf auth login` with it, {later}.")
    repo_id = resolve_repo_id(config, user)
    namespaces = [user, *(org.get("name") for org in who.get("orgs") or [])]
    if repo_id.split("/")[0] not in namespaces:
        raise FinetuneError(f"--hub_model_id {repo_id}: {user!r} cannot create repositories in "
                            f"{repo_id.split('/')[0]!r} (the token's namespaces: {', '.join(map(str, namespaces))}). "
                            f"Use one of those, {later}.")
    return HubPush(api, repo_id, config)


@dataclass
class Job:
    """One background job on HfApi's one-worker pool: ``future``; ``folder``: the checkpoint folder it reads (None
    for ``create_repo``); ``step``: that checkpoint's optimizer step; ``supersedable``: a newer checkpoint's upload
    to the same place replaces it while it has not started."""

    future: Future
    folder: Path | None = None
    step: int | None = None
    supersedable: bool = False


class HubPush:
    """One run's uploads to ``repo_id`` (main process only): ``after_save`` per ``hub_strategy``, ``at_end``.
    ``pending``: the background jobs (``Job``) not yet reaped, oldest first. ``prune_later``: the last save's
    ``checkpoint.prune`` (set by ``lifecycle.RunState.saved``), run again by ``at_end`` once no upload holds a
    checkpoint."""

    def __init__(self, api: HfApi, repo_id: str, config):
        self.api, self.repo_id, self.config = api, repo_id, config
        self.strategy = config.hub_strategy
        self.pending: list[Job] = []
        self.failures: list[str] = []  # one line per failed upload, as warned
        self.repo_queued = False
        self.prune_later: Callable[[], None] | None = None

    def _warn(self, what: str, err: BaseException, after: str = "training goes on") -> None:
        line = (f"warning: {what} to the Hub ({self.repo_id}) failed ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}); {after} and {self.config.output_dir} is "
                f"intact. Upload it later with `hf upload {self.repo_id} {self.config.output_dir}`.")
        self.failures.append(line)
        tqdm.write(line, file=sys.stderr)  # on a line of its own, above a progress bar

    def _queue_repo(self) -> None:
        """``create_repo(exist_ok=True)`` (Trainer's ``init_hf_repo``), queued ahead of the first upload on HfApi's
        one-worker pool (``HfApi.run_as_future``: jobs run in order), so it never blocks the training."""
        if not self.repo_queued:
            self.pending.append(Job(self.api.run_as_future(self.api.create_repo, self.repo_id,
                                                           private=self.config.hub_private_repo, exist_ok=True)))
            self.repo_queued = True

    def _reap(self) -> None:
        """Warn once for each finished background job that failed; keep the others."""
        running = []
        for job in self.pending:
            if not job.future.done():
                running.append(job)
            elif not job.future.cancelled() and job.future.exception() is not None:
                self._warn("a background upload", job.future.exception())
        self.pending = running

    def held(self) -> set[Path]:
        """The checkpoint folders (resolved paths) that a queued or running upload still reads: not to be pruned."""
        return {job.folder.resolve() for job in self.pending if job.folder is not None and not job.future.done()}

    def _supersede(self, step: int) -> None:
        """Cancel the supersedable uploads that have not started (``Future.cancel``: False once running): step
        ``step``'s upload to the same place follows. Says which steps' uploads it replaced."""
        replaced = sorted({job.step for job in self.pending if job.supersedable and job.future.cancel()})
        self.pending = [job for job in self.pending if not job.future.cancelled()]
        if replaced:
            tqdm.write(f"hub: step {', '.join(map(str, replaced))}'s upload to {self.repo_id} had not started; step "
                       f"{step}'s replaces it.")

    def after_save(self, checkpoint, step: int) -> None:
        """After checkpoint ``checkpoint`` (a complete folder) of optimizer step ``step``: with ``every_save`` and
        after, upload its model files to the repository's root in the background (``run_as_future=True``); with
        ``checkpoint`` also the whole folder to ``last-checkpoint/`` (``all_checkpoints``: to a folder of its own
        name). Queued behind a running push (not skipped, as Trainer does); an older upload to the root or
        ``last-checkpoint/`` that has not started is cancelled (``_supersede``). Never raises."""
        if self.strategy == "end":
            return
        self._reap()
        self._supersede(step)
        checkpoint = Path(checkpoint)
        message = f"Training in progress, step {step}"
        ignore = TRAINING_STATE + (["model.safetensors"] if (checkpoint / "adapter_config.json").is_file() else [])
        try:
            self._queue_repo()
            self.pending.append(Job(self.api.upload_folder(
                repo_id=self.repo_id, folder_path=str(checkpoint), commit_message=message,
                allow_patterns=list(MODEL_FILES), ignore_patterns=ignore, run_as_future=True), checkpoint, step, True))
            if self.strategy in ("checkpoint", "all_checkpoints"):
                folder = "last-checkpoint" if self.strategy == "checkpoint" else checkpoint.name
                self.pending.append(Job(self.api.upload_folder(
                    repo_id=self.repo_id, folder_path=str(checkpoint), path_in_repo=folder,
                    commit_message=message + ", checkpoint", run_as_future=True), checkpoint, step,
                    self.strategy == "checkpoint"))
        except Exception as err:  # noqa: BLE001 - an upload never stops the training
            self._warn(f"pushing step {step}'s checkpoint", err)

    def _point_card_at_the_hub(self, output_dir: Path) -> None:
        """Write the model card again with its usage snippets loading from ``repo_id`` (as Trainer's card names
        ``hub_model_id``), from the run's own ``run_config.json`` and ``metrics.json`` (the config as it ran, after
        the batch planner). A failure keeps the card as it was (a warning)."""
        from finetune.config import TrainConfig
        from finetune.outputs.reporting import write_card
        from finetune.recipes import load_recipe

        try:
            config = TrainConfig(**json.loads((output_dir / "run_config.json").read_text()))
            metrics = json.loads((output_dir / "metrics.json").read_text())
            write_card(output_dir, config, load_recipe(config.recipe), metrics, hub_repo_id=self.repo_id)
        except Exception as err:  # noqa: BLE001 - the card written by the run stays
            tqdm.write(f"warning: the model card could not name {self.repo_id} ({type(err).__name__}: {err}); it "
                       "is pushed as the run wrote it.", file=sys.stderr)

    def at_end(self, output_dir) -> str | None:
        """After the final outputs: wait for the background uploads, prune the checkpoints they held
        (``prune_later``), write the model card with the repository in
        its usage snippets, then upload ``output_dir`` without its checkpoints (``END_IGNORE``), "End of training",
        and print where it went. Returns the commit URL, or None after a failure (warned). Never raises."""
        for job in self.pending:
            try:
                job.future.result()
            except Exception as err:  # noqa: BLE001
                self._warn("a background upload", err, after="the run is finished")
        self.pending = []
        if self.prune_later is not None:  # --save_total_limit, now that no upload holds a checkpoint
            try:
                self.prune_later()
            except OSError as err:
                tqdm.write(f"warning: pruning the checkpoints after the uploads failed ({err}).", file=sys.stderr)
        self._point_card_at_the_hub(Path(output_dir))
        try:
            if not self.repo_queued:
                self.api.create_repo(self.repo_id, private=self.config.hub_private_repo, exist_ok=True)
                self.repo_queued = True
            info = self.api.upload_folder(repo_id=self.repo_id, folder_path=str(output_dir),
                                          commit_message="End of training", ignore_patterns=list(END_IGNORE))
        except Exception as err:  # noqa: BLE001 - the run is done and its folder intact: a warning
            self._warn("pushing the final model", err, after="the run is finished")
            return None
        url = getattr(info, "commit_url", None) or f"{constants.ENDPOINT}/{self.repo_id}"
        print(f"pushed {output_dir} to the Hub: {constants.ENDPOINT}/{self.repo_id} ({url})", flush=True)
        return url

