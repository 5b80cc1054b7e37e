"""Checkpoints that survive: written to ``.tmp-step_...`` and renamed, ``manifest.json`` (every file's size, the small
files' sha256) then the ``COMPLETE`` marker last, pruned only after the new one is complete, verified before a resume,
refused when resuming would change what a step means. ``checkpoints/step_00000012/`` holds ``save_state``'s output,
``trainer_state.json``, ``manifest.json``, ``COMPLETE`` (docs/resume.md#checkpoints-layout-and-who-writes)."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path

from accelerate.utils import gather_object

from finetune import distributed
from finetune.config import fields_with
from finetune.errors import FinetuneError, together
from finetune.lifecycle import elastic
from finetune.lifecycle.progress import RunProgress
from finetune.models.fetch import sha256_file

MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
HASH_LIMIT = 1 << 20  # files up to 1 MiB (the state files, configs, tokenizer) get a sha256; bigger ones a size
_NAME = re.compile(r"^step_(\d{8})$")
# The Trainer backend's checkpoints: Trainer's ``checkpoint-<step>`` folders (transformers 5.24 PREFIX_CHECKPOINT_DIR),
# sealed alike (``seal_checkpoint``), our RunProgress in PROGRESS_FILE (their ``trainer_state.json`` is Trainer's own).
_TRAINER_NAME = re.compile(r"^checkpoint-(\d+)$")
PROGRESS_FILE = "finetune_progress.json"
# Where Trainer writes its checkpoint-N; ``commit_staged`` renames the sealed folder into place, as we do ours.
TRAINER_STAGING = ".tmp-checkpoint"
BACKENDS = ("accelerate", "trainer")
# Folders a save or a prune leaves behind when killed: never named step_* or checkpoint-*, so never resumed; the
# next save removes them.
_LEFTOVERS = (".tmp-step_", ".replaced-step_", ".deleting-step_", TRAINER_STAGING, ".replaced-checkpoint-",
              ".deleting-checkpoint-")
# What the writers of a checkpoint raise when the disk is full or failing (each measured on a full tmpfs, torch
# 2.13, safetensors 0.8.0, tokenizers 0.23.3, transformers 5.23):
# - OSError (ENOSPC, EIO, ...): open/write/fsync/os.replace of our own files, and transformers' config and
#   generation-config save_pretrained (configuration_utils.py to_json_file: a plain open());
# - safetensors.SafetensorError, an Exception but not an OSError (safetensors/__init__.pyi line 291), from the
#   weights (accelerate/utils/other.py save -> safetensors.torch.save_file): "Error while serializing: I/O error:
#   No space left on device (os error 28)";
# - RuntimeError from torch.save (optimizer, scheduler, sampler, scaler, random states: accelerate/checkpointing.py):
#   its zip writer is torch._C.PyTorchFileWriter (torch/serialization.py lines 810-834), whose C++ checks raise
#   c10::Error as RuntimeError: "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534", which
#   does not even say the disk is full (so the error adds the free space);
# - a plain Exception from the tokenizers library (Tokenizer.save, reached from tokenizer.save_pretrained through
#   transformers/tokenization_utils_tokenizers.py line 1205): "No space left on device (os error 28)".
# Only the OSError carries errno ENOSPC (in itself or its chain); the others are told by their message or, for
# torch.save's, not at all: a full disk is also recognised by the free space left after the failure (_Failure).
# So each stage of a save catches Exception: an error type one process let through would skip the collectives
# the others wait in (a hang), and every process must raise the same FinetuneError.

# Settings that change what one optimizer step means, or which samples it sees: resuming under a change
# of any of them would not continue the same run. Each field declares it (``step=True``, finetune/config/). The
# effective batch B is one too (``elastic.batch_meaning``); how it is split (micro-batch, accumulation, processes)
# is not: a resume may re-split it (finetune.lifecycle.elastic).
STEP_MEANING = fields_with(step=True)
QUANTIZED_BASE = "quantized_base"  # the step meaning's entry for a quantized base: its quantization and weights' hash


def checkpoints_dir(output_dir) -> Path:
    """``<output_dir>/checkpoints``."""
    return Path(output_dir) / "checkpoints"


def step_meaning(config, num_processes: int, training_set: dict | None = None, base: dict | None = None) -> dict:
    """The settings that define a step (``STEP_MEANING``), the effective batch and its split (``elastic.batch_meaning``),
    the training set (``training_set``: ``data.training_set_identity`` with the held-out flags, ``elastic.data_meaning``)
    and a quantized base's identity (``base``: ``models.quantization.base_identity``, as ``QUANTIZED_BASE``)."""
    meaning = {name: getattr(config, name) for name in STEP_MEANING}
    meaning.update(elastic.batch_meaning(config, num_processes))
    meaning.update(elastic.data_meaning(config, training_set))
    if base is not None:
        meaning[QUANTIZED_BASE] = base
    return meaning


def list_checkpoints(output_dir, backend: str = "accelerate") -> list[Path]:
    """``backend``'s checkpoint directories with a real name (``step_<8 digits>``; Trainer: ``checkpoint-<step>``),
    oldest first (complete or not)."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    name = _NAME if backend == "accelerate" else _TRAINER_NAME
    return sorted((p for p in root.iterdir() if p.is_dir() and name.match(p.name)), key=step_of)


def step_of(path: Path) -> int:
    """The optimizer step a checkpoint folder is named after (``step_00000012`` or ``checkpoint-12``: 12)."""
    match = _NAME.match(path.name) or _TRAINER_NAME.match(path.name)
    if match is None:
        raise ValueError(f"{path} is not named after a step")
    return int(match[1])


def rng_file(backend: str, rank: int, num_processes: int) -> str:
    """The file in a checkpoint that holds process ``rank``'s random-number state: Accelerate's
    ``random_states_<rank>.pkl`` (accelerate/checkpointing.py ``save_accelerator_state``), Trainer's
    ``rng_state_<rank>.pth``, or ``rng_state.pth`` on one process (transformers 5.24 trainer.py
    ``_save_rng_state``)."""
    if backend == "accelerate":
        return f"random_states_{rank}.pkl"
    return f"rng_state_{rank}.pth" if num_processes > 1 else "rng_state.pth"


def is_complete(path: Path) -> bool:
    """Whether ``path`` holds its completion marker (written last)."""
    return (path / MARKER).is_file()


def find_resume_checkpoint(output_dir, spec: str, backend: str = "accelerate") -> Path | None:
    """``spec`` "latest": the newest complete checkpoint under ``output_dir`` that verifies (``verify_checkpoint``;
    incomplete and damaged ones are skipped with a warning naming why); "auto": the same, or None where there is
    no checkpoint at all (a fresh start); otherwise the path ``spec``, which must be complete and verify. Raises
    ``FinetuneError`` if there is none ("latest"), if "auto" finds checkpoints but none verifies
    (``refuse_unverified``: a fresh start would delete or write over them), or the path is incomplete or damaged
    (naming the file). ``backend``: whose checkpoints (``list_checkpoints``)."""
    if spec in ("latest", "auto"):
        path = newest_complete_checkpoint(output_dir, warn=True, backend=backend)
        if path is None and spec == "auto":
            refuse_unverified(output_dir, backend=backend)
        if path is None and spec == "latest":
            raise FinetuneError(f"--resume_from_checkpoint latest: no complete checkpoint under "
                                f"{checkpoints_dir(output_dir)}. Start without --resume_from_checkpoint.")
        return path
    path = Path(spec)
    if not path.is_dir():
        raise FinetuneError(f"--resume_from_checkpoint {spec!r} is not a directory. Pass a checkpoint directory "
                            f"(e.g. {checkpoints_dir(output_dir)}/step_00000010) or 'latest'.")
    if not is_complete(path):
        raise FinetuneError(f"--resume_from_checkpoint {spec!r} is incomplete (no {MARKER} marker): its write was "
                            "interrupted. Use an earlier checkpoint, or 'latest' to pick the newest complete one.")
    if not verify_checkpoint(path):
        print(_unverified_note(path))
    return path


def newest_complete_checkpoint(output_dir, warn: bool = False, backend: str = "accelerate") -> Path | None:
    """The newest checkpoint under ``output_dir`` that is complete and verifies (one written before manifests
    counts, unverified), or None. ``warn``: print why each newer one was skipped (and a note for an unverified
    one)."""
    for path in reversed(list_checkpoints(output_dir, backend)):
        if not is_complete(path):
            if warn:
                print(f"warning: skipping incomplete checkpoint {path} (no {MARKER} marker: its write was interrupted)")
            continue
        problem, verified = _inspect(path)
        if problem is not None:
            if warn:
                print(f"warning: skipping damaged checkpoint {path}: {problem}")
            continue
        if warn and not verified:
            print(_unverified_note(path))
        return path
    return None


def unverified_checkpoints(output_dir, backend: str = "accelerate") -> list[tuple[Path, str]]:
    """(path, why) for each checkpoint directory under ``output_dir`` that cannot be resumed: incomplete (no
    ``COMPLETE`` marker) or damaged (``_inspect``: a file missing, truncated or changed), oldest first; for the
    Trainer backend also the accelerate backend's, which it cannot resume (``backend``)."""
    found = []
    if backend == "trainer":
        found += [(path, "written by --backend accelerate") for path in list_checkpoints(output_dir)]
    for path in list_checkpoints(output_dir, backend):
        if not is_complete(path):
            found.append((path, f"no {MARKER} marker (its write was interrupted, or the marker was removed)"))
        else:
            problem, _ = _inspect(path)
            if problem is not None:
                found.append((path, problem))
    return found


def refuse_unverified(output_dir, spec: str = "auto", backend: str = "accelerate") -> None:
    """For ``--resume_from_checkpoint auto`` where no checkpoint verifies: raise ``FinetuneError`` naming every
    checkpoint under ``output_dir`` and why it cannot be resumed, and the two ways on, if there is any (``auto``
    never starts a run over checkpoints it could not verify: with ``--overwrite_output_dir`` the fresh start would
    delete them, without it the next saves would write over them). Returns where there are none."""
    unverified = unverified_checkpoints(output_dir, backend)
    if not unverified:
        return
    root = checkpoints_dir(output_dir)
    listed = "; ".join(f"{path.name}: {why}" for path, why in reversed(unverified))
    raise FinetuneError(f"--resume_from_checkpoint {spec}: no checkpoint under {root} can be resumed ({listed}), and "
                        f"{spec} does not start over checkpoints it cannot verify. To start afresh, remove them "
                        f"(rm -r {root}); to resume anyway, pass a checkpoint you trust: --resume_from_checkpoint PATH.")


def is_resumable(path: Path) -> bool:
    """Whether ``path`` is complete and verifies (``verify_checkpoint``), without printing anything."""
    return is_complete(path) and _inspect(path)[0] is None


def verify_checkpoint(path: Path) -> bool:
    """Check a complete checkpoint against its ``manifest.json``: every file recorded there exists with its
    recorded size, and each small file (up to ``HASH_LIMIT``) has its sha256; the manifest itself has the sha256
    the ``COMPLETE`` marker records. Cheap: sizes, and hashes of small files only. Returns True when verified,
    False for a checkpoint written before manifests (its marker names none: unverified). Raises
    ``FinetuneError`` naming the first missing, truncated or changed file and the fix."""
    problem, verified = _inspect(path)
    if problem is not None:
        raise FinetuneError(f"checkpoint {path} is damaged: {problem}. Resume from another checkpoint: "
                            "--resume_from_checkpoint latest takes the newest one that verifies, or pass an earlier "
                            "one's path.")
    return verified


def _unverified_note(path: Path) -> str:
    return (f"note: checkpoint {path} has no {MANIFEST} (written before checkpoints recorded their files): "
            "resuming without verifying its files.")


def load_checkpoint_weights(model, checkpoint: Path, where: str) -> None:
    """Overwrite ``model``'s weights with ``checkpoint/model.safetensors`` (``Accelerator.save_state``: names
    may carry DDP's ``module.`` or torch.compile's ``_orig_mod.`` prefix, and one of two tied tensors is
    left out). Raises ``FinetuneError`` if the file is missing or does not fit the model."""
    from safetensors.torch import load_file  # lazy: this module is imported by light commands

    file = checkpoint / "model.safetensors"
    if not file.is_file():
        raise FinetuneError(f"{where} holds no model.safetensors. Pass a checkpoint written by finetune, "
                            "or the run's --output_dir.")
    state = {}
    for name, tensor in load_file(str(file)).items():
        while name.startswith(("module.", "_orig_mod.")):
            name = name.split(".", 1)[1]
        state[name] = tensor
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = model.state_dict()
    loaded = {params[name].data_ptr() for name in state if name in params}
    missing = [name for name in missing if params[name].data_ptr() not in loaded]  # a tied copy is loaded too
    if missing or unexpected:
        raise FinetuneError(f"{where}: the checkpoint's weights do not fit the run's model ({len(missing)} missing, "
                            f"{len(unexpected)} unexpected, e.g. {(missing + unexpected)[0]!r}). Pass a checkpoint "
                            "of the run whose --output_dir holds it.")


def _inspect(path: Path) -> tuple[str | None, bool]:
    """(what is wrong with complete checkpoint ``path``, or None; whether a manifest vouched for it)."""
    try:
        marker = (path / MARKER).read_text()
    except (OSError, UnicodeDecodeError) as err:
        return f"{MARKER} is unreadable ({err})", False
    recorded = re.search(rf"^{re.escape(MANIFEST)} sha256 ([0-9a-f]{{64}})$", marker, re.MULTILINE)
    if recorded is None:
        return None, False  # written before manifests: nothing to check against
    problem, entries = _read_manifest(path / MANIFEST, recorded[1])
    problems = (_check_file(path / name, name, size, sha256) for name, size, sha256 in entries)
    return problem or next((p for p in problems if p is not None), None), True


def _read_manifest(manifest: Path, sha256: str) -> tuple[str | None, list[tuple[str, int, str | None]]]:
    """(what is wrong with ``manifest``, or None; its entries (name, size, sha256 or None), [] where it is
    wrong). ``sha256``: what the ``COMPLETE`` marker recorded for it."""
    try:
        if sha256_file(manifest) != sha256:
            return f"{MANIFEST} does not match the sha256 its {MARKER} marker recorded", []
        files = json.loads(manifest.read_text())["files"]
        return None, [(name, int(entry["size"]), entry.get("sha256")) for name, entry in files.items()]
    except FileNotFoundError:
        return f"{MANIFEST} is missing", []
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{MANIFEST} is unreadable ({type(err).__name__}: {err})", []


def _check_file(file: Path, name: str, size: int, sha256: str | None) -> str | None:
    """What is wrong with the checkpoint's ``file`` (manifest name ``name``) against its manifest entry (``size``
    in bytes; ``sha256``, or None for a file over ``HASH_LIMIT``), or None."""
    try:
        actual = file.stat().st_size
        if actual != size:
            return f"{name} has {actual} bytes, {size} when saved (truncated or overwritten)"
        if sha256 is not None and sha256_file(file) != sha256:
            return f"{name} does not match the sha256 recorded when it was saved"
    except FileNotFoundError:
        return f"{name} is missing (it had {size} bytes when saved)"
    except OSError as err:
        return f"{name} is unreadable ({err})"
    return None


def read_state(path: Path) -> RunProgress:
    """The ``RunProgress`` saved in checkpoint ``path`` (``PROGRESS_FILE`` in a Trainer checkpoint, else
    ``STATE_FILE``). Raises ``FinetuneError`` if it is unreadable."""
    name = PROGRESS_FILE if _TRAINER_NAME.match(Path(path).name) else STATE_FILE
    try:
        saved = json.loads((path / name).read_text())
        if "loss_sum" in saved:  # the names before round 3
            saved["step_loss_total"] = saved.pop("loss_sum")
            saved.setdefault("patience_best", saved.get("best_metric"))
        return RunProgress(**saved)
    except (OSError, ValueError, TypeError) as err:
        raise FinetuneError(f"checkpoint {path} is corrupt ({name}: {err}). Resume from another checkpoint "
                            "(--resume_from_checkpoint PATH) or start again.") from None


def check_compatible(state: RunProgress, meaning: dict, path: Path, allow: bool) -> list[str]:
    """Refuse to resume when the training set (``elastic.check_training_set``), the effective batch B
    (``elastic.check_batch``) or a setting of ``STEP_MEANING`` differs from the checkpoint's, each with an error
    naming what changed; ``allow`` (``--ignore_checkpoint_mismatch``) overrides. Another split of the same B is no
    difference. Returns what ``allow`` let through ("training set: ...", "name: checkpoint X, now Y"), [] for
    none. Raises ``FinetuneError``."""
    data_change = elastic.check_training_set(state.step_meaning, meaning, path, allow)
    elastic.check_batch(state.step_meaning, meaning, path, allow)
    differences = elastic.step_differences(state.step_meaning, meaning)
    if differences and not allow:
        raise FinetuneError(
            f"cannot resume from {path}: these settings change what a step means: {'; '.join(differences)}. "
            "Resume with the checkpoint's settings, or pass --ignore_checkpoint_mismatch to continue anyway.")
    before, now = elastic.effective_batch(state.step_meaning), elastic.effective_batch(meaning)
    batch = [f"effective batch: checkpoint B = {before}, now B = {now}"] if before not in (None, now) else []
    return [f"training set: {data_change}"] * (data_change is not None) + batch + differences


def checkpoint_path(output_dir, step: int, backend: str = "accelerate") -> Path:
    """``<output_dir>/checkpoints/step_<8 digits>`` (Trainer backend: ``checkpoint-<step>``)."""
    name = f"step_{step:08d}" if backend == "accelerate" else f"checkpoint-{step}"
    return checkpoints_dir(output_dir) / name


def save_checkpoint(accelerator, output_dir, state: RunProgress, save_total_limit: int | None,
                    model=None, tokenizer=None, layout=None, held=frozenset()) -> Path:
    """Write ``state.step``'s checkpoint atomically, then prune to ``save_total_limit`` (oldest complete first,
    never the new or the best one, nor one in ``held``: see ``prune``); returns its path. Collective: every process
    calls it. With ``model`` and ``tokenizer`` it is also a ``from_pretrained`` directory. ``layout``
    (``distributed.StorageLayout``; None: global rank 0 writes): ``per_machine`` gives each machine a complete copy
    (docs/resume.md#checkpoints-layout-and-who-writes).

    Every process writes its part into ``.tmp-step_N``; whether every write succeeded is agreed on (one
    ``gather_object``) before anything is committed; then the writers record ``manifest.json``, fsync, write the
    ``COMPLETE`` marker and rename the folder to ``step_N``, and the outcome of that is agreed on too. Every
    process reaches both exchanges whatever failed where. Raises ``FinetuneError`` on every process, the same
    message naming the rank(s), stage and error, if any write fails (e.g. disk full): the partial write is
    removed, the previous checkpoints untouched."""
    writes = accelerator.is_main_process if layout is None else layout.writes
    per_machine = layout is not None and layout.per_machine
    root = checkpoints_dir(output_dir)
    final = checkpoint_path(output_dir, state.step)
    tmp = root / f".tmp-{final.name}"
    failure = _Failure(accelerator.process_index, root, tmp, lambda: _expected_size(output_dir, model))
    if writes:
        failure.run("preparing", lambda: clear_leftovers(output_dir))
    accelerator.wait_for_everyone()
    failure.run("accelerator.save_state", lambda: accelerator.save_state(str(tmp), safe_serialization=True))
    rng_states = []
    if per_machine:  # collective: every process, also one whose write failed
        name = f"random_states_{accelerator.process_index}.pkl"
        own = failure.run("reading its random state", lambda: (tmp / name).read_bytes())
        rng_states = gather_object([(name, own)])
    if writes:
        failure.run("writing model files and trainer state",
                    lambda: _write_rest(accelerator, tmp, state, model, tokenizer, rng_states))
    _agree(accelerator, failure, final, tmp, writes)  # nothing is committed unless every write succeeded
    if writes:
        failure.run("committing", lambda: _commit(tmp, final, state.step))
    _agree(accelerator, failure, final, tmp, writes)
    if writes:
        prune(output_dir, final, state.best_step, save_total_limit, held=held)
    return final


def prune(output_dir, newest: Path, best_step: int | None, save_total_limit: int | None,
          backend: str = "accelerate", held=frozenset()) -> None:
    """Keep at most ``save_total_limit`` complete checkpoints of ``backend``: delete the oldest complete ones,
    never ``newest`` (just completed) nor ``best_step``'s; incomplete ones are left (a resume skips them, a save of
    their step replaces them). ``held``: resolved paths an upload still reads (``hub.HubPush.held``): left for a
    later prune. Each is renamed to ``.deleting-<name>`` before its files go, so a kill mid-way never leaves a named
    folder with part of its files. None or 0: keep every one."""
    if not save_total_limit:
        return
    root = checkpoints_dir(output_dir)
    keep = {newest, checkpoint_path(output_dir, best_step, backend) if best_step is not None else newest}
    complete = [p for p in list_checkpoints(output_dir, backend) if is_complete(p) and p not in keep]
    for old in complete[: max(len(complete) + 1 - save_total_limit, 0)]:
        if old.resolve() not in held:
            _remove(old, root / f".deleting-{old.name}")


def seal_checkpoint(path: Path, state: RunProgress) -> None:
    """Make the checkpoint folder ``path`` resumable the way ours are: write ``state`` to ``PROGRESS_FILE``, fsync
    every file, record ``manifest.json``, fsync it, then the ``COMPLETE`` marker (naming the manifest's sha256),
    fsync. Until the marker is there the folder is incomplete and ``latest``/``auto`` skip it; afterwards
    ``verify_checkpoint`` catches a file changed or truncated. Raises ``OSError`` from the writes."""
    (path / MARKER).unlink(missing_ok=True)  # the same step written again: incomplete until sealed anew
    (path / PROGRESS_FILE).write_text(json.dumps(asdict(state)) + "\n")
    _seal(path, state.step)


def trainer_staging(output_dir) -> Path:
    """Where the Trainer backend has Trainer write its checkpoints: ``<output_dir>/checkpoints/.tmp-checkpoint``
    (never resumed; cleared as a leftover)."""
    return checkpoints_dir(output_dir) / TRAINER_STAGING


def commit_staged(staged: Path, final: Path, state: RunProgress) -> None:
    """Make the Trainer checkpoint ``staged`` (Trainer's ``checkpoint-<step>``, written by transformers 5.24
    trainer.py ``_save_checkpoint``, lines 3363-3430, straight into the folder it is given: the staging folder)
    the checkpoint ``final``: sealed (``seal_checkpoint``) then renamed into place, a ``final`` already there
    renamed aside first, as ``save_checkpoint`` commits ours. A kill before the rename leaves only the staging
    folder, which no resume considers and the next start clears. Raises ``OSError`` from the writes."""
    seal_checkpoint(staged, state)
    _rename_into_place(staged, final)
    shutil.rmtree(staged.parent, ignore_errors=True)  # the staging folder, empty now


def clear_leftovers(output_dir) -> None:
    """Create ``output_dir``'s checkpoints folder; remove what killed saves and prunes left there (never a
    checkpoint)."""
    root = checkpoints_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    for entry in root.iterdir():
        if entry.name.startswith(_LEFTOVERS) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


class _Failure:
    """The first error of this process in a save: its stage and a one-line description. A full disk is named as
    such ("no space left on <folder>: N MiB free, the checkpoint needs about M MiB"), since torch.save's
    RuntimeError does not say so: recognised by ENOSPC in the exception chain, the writers' "No space left on
    device" message, or less free space on ``root``'s disk after the failure than the checkpoint needs
    (``needed()``: bytes, ``_expected_size``). N counts the space the partial write ``tmp`` takes, which is
    removed before the error is raised."""

    def __init__(self, rank: int, root: Path, tmp: Path | None = None, needed=lambda: None):
        self.rank, self.root, self.tmp, self.needed, self.report = rank, root, tmp, needed, None

    def run(self, stage: str, action):
        """``action()``'s value, unless an earlier stage failed or it raises (then None, the error recorded)."""
        if self.report is not None:
            return None
        try:
            return action()
        except Exception as err:  # noqa: BLE001 - every type the writers raise, see the comment at the top
            text = (str(err).strip().splitlines() or [""])[0][:300]
            cause = f"{stage}: {type(err).__name__}: {text}"
            full = self._no_space(err)
            self.report = {"rank": self.rank, "text": f"{full} ({cause})" if full else cause + self._free()}
            return None

    def _no_space(self, err: BaseException) -> str | None:
        """"no space left on <root>: N free, the checkpoint needs about M" where the disk is full, else None."""
        try:
            free = shutil.disk_usage(self.root).free + _tree_bytes(self.tmp)
        except (OSError, ValueError):
            return None
        try:
            needed = self.needed()
        except Exception:  # noqa: BLE001 - an estimate only: without it the message says less
            needed = None
        if not (_says_no_space(err) or (needed is not None and free < needed)):
            return None
        return (f"no space left on {self.root}: {_format_bytes(free, 'MiB')} free"
                + (f", the checkpoint needs about {_format_bytes(needed, 'MiB')}" if needed is not None else ""))

    def _free(self) -> str:
        try:
            return f"; {_format_bytes(shutil.disk_usage(self.root).free)} free on its disk"
        except (OSError, ValueError):
            return ""


def _says_no_space(err: BaseException) -> bool:
    """Whether ``err`` or an exception in its chain is ENOSPC, or says "No space left on device" (safetensors'
    and the tokenizers library's errors carry only the message: "... (os error 28)")."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if getattr(err, "errno", None) == errno.ENOSPC or "no space left on device" in str(err).lower():
            return True
        err = err.__cause__ or err.__context__
    return False


def _tree_bytes(path: Path | None) -> int:
    """Bytes in the files under ``path`` (0 where there is nothing)."""
    if path is None or not path.is_dir():
        return 0
    total = 0
    for file in path.rglob("*"):
        try:
            total += file.stat().st_size if file.is_file() else 0
        except OSError:
            pass
    return total


def _expected_size(output_dir, model) -> int | None:
    """About how many bytes a checkpoint takes: the newest complete one's (every file), or before the first, the
    model's weights and AdamW's two moments per trainable parameter (``preemption.checkpoint_bytes``); None
    without either."""
    for path in reversed(list_checkpoints(output_dir)):
        if is_complete(path):
            return _tree_bytes(path)
    if model is None:
        return None
    from finetune.lifecycle.preemption import (
        checkpoint_bytes,  # it imports the engines, which import this module's users
    )

    return checkpoint_bytes(model)


def _format_bytes(count: int, unit: str | None = None) -> str:
    """``count`` bytes in the largest unit that keeps it >= 1 (bytes, KiB, MiB, GiB), or in ``unit``."""
    if unit is not None:
        return f"{count / 1024 ** ('KiB', 'MiB', 'GiB').index(unit) / 1024:.1f} {unit}"
    for name in ("bytes", "KiB", "MiB", "GiB"):
        if count < 1024 or name == "GiB":
            return f"{count} {name}" if name == "bytes" else f"{count:.1f} {name}"
        count /= 1024
    return f"{count} bytes"


def _agree(accelerator, failure: _Failure, final: Path, tmp: Path, writes: bool) -> None:
    """Exchange the failures (collective with several processes); raise the same ``FinetuneError`` everywhere
    if any process failed, after its writers removed the partial folder."""
    reports = gather_object([failure.report]) if accelerator.num_processes > 1 else [failure.report]
    failed = sorted((r for r in reports if r is not None), key=lambda r: r["rank"])
    if not failed:
        return
    if writes:
        shutil.rmtree(tmp, ignore_errors=True)
    if accelerator.num_processes > 1:
        where = " on " + "; ".join(f"rank {r['rank']} ({r['text']})" for r in failed)
    else:
        where = f" ({failed[0]['text']})"
    raise together(FinetuneError(f"writing checkpoint {final.name} failed{where}; the previous checkpoints are intact. "
                                 "Free disk space (or choose another --output_dir) and resume with "
                                 "--resume_from_checkpoint latest."))


def _write_rest(accelerator, tmp: Path, state: RunProgress, model, tokenizer, rng_states) -> None:
    """What a writer adds to ``save_state``'s files: other machines' random states (``per_machine``), the
    model's config (or a PEFT adapter), the tokenizer, ``trainer_state.json``."""
    for name, data in rng_states:
        if data is not None and not (tmp / name).exists():
            (tmp / name).write_bytes(data)
    if model is not None and hasattr(accelerator.unwrap_model(model), "peft_config"):
        accelerator.unwrap_model(model).save_pretrained(tmp)  # a PEFT adapter dir (adapter weights are small)
    elif model is not None:
        unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
        unwrapped.config.architectures = [type(unwrapped).__name__]  # as save_pretrained records it
        unwrapped.config.save_pretrained(tmp)
        if getattr(unwrapped, "generation_config", None) is not None and unwrapped.can_generate():
            unwrapped.generation_config.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    (tmp / STATE_FILE).write_text(json.dumps(asdict(state)) + "\n")


def write_manifest(path: Path, step: int) -> str:
    """Record every file under ``path`` in ``path/manifest.json``: its size, and the sha256 of each file of at
    most ``HASH_LIMIT`` bytes. Returns the manifest's own sha256 (for the ``COMPLETE`` marker). Format::

        {"format": 1, "step": 12, "hash_limit": 1048576,
         "files": {"model.safetensors": {"size": 4001412},
                   "trainer_state.json": {"size": 815, "sha256": "<64 hex digits>"}, ...}}

    (names relative to ``path``, "/"-separated, sorted)."""
    files = {}
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        name = file.relative_to(path).as_posix()
        if name in (MANIFEST, MARKER):
            continue
        size = file.stat().st_size
        files[name] = {"size": size, "sha256": sha256_file(file)} if size <= HASH_LIMIT else {"size": size}
    (path / MANIFEST).write_text(json.dumps({"format": MANIFEST_FORMAT, "step": step, "hash_limit": HASH_LIMIT,
                                             "files": files}, indent=1) + "\n")
    return sha256_file(path / MANIFEST)


def _commit(tmp: Path, final: Path, step: int) -> None:
    """Make ``tmp`` the checkpoint ``final``: sealed (``_seal``), then renamed into place (``_rename_into_place``)."""
    _seal(tmp, step)
    _rename_into_place(tmp, final)


def _seal(path: Path, step: int) -> None:
    """Fsync the files under ``path``, then write and fsync ``manifest.json`` (``write_manifest``), the ``COMPLETE``
    marker (naming the manifest's sha256) and the folder: neither reaches the disk before the files they vouch for."""
    for file in path.rglob("*"):
        if file.is_file():
            _fsync_file(file)
    manifest_sha256 = write_manifest(path, step)
    _fsync_file(path / MANIFEST)
    (path / MARKER).write_text(f"step {step}\n{MANIFEST} sha256 {manifest_sha256}\n")
    _fsync_file(path / MARKER)
    _fsync_file(path)


def _rename_into_place(tmp: Path, final: Path) -> None:
    """Rename the complete checkpoint ``tmp`` to ``final``; a ``final`` already there (the same step saved again
    after a resume) is renamed aside first, so no moment shows a half-deleted checkpoint."""
    aside = final.parent / f".replaced-{final.name}"
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    try:
        os.replace(tmp, final)
    except OSError:
        if aside.exists() and not final.exists():
            os.replace(aside, final)  # put the previous one back
        raise
    try:  # best effort from here: the checkpoint is in place
        _fsync_file(final.parent)
    except OSError:
        pass
    shutil.rmtree(aside, ignore_errors=True)


def _remove(path: Path, doomed: Path) -> None:
    """Delete checkpoint ``path``: renamed to ``doomed`` first, so a kill mid-way never leaves a ``step_*``
    folder with part of its files."""
    try:
        os.replace(path, doomed)
    except OSError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------ agreement between processes
class _NoCheckpoint(Exception):
    """``--resume_from_checkpoint auto`` found no checkpoint on this process."""


def held_checkpoints(state, output_dir, backend: str = "accelerate") -> list[int]:
    """The steps this process could resume from in its ``output_dir``: complete checkpoints that verify
    (``checkpoint.is_resumable``) and hold this process's random-number state where they were written by as many
    processes (``checkpoint.rng_file``), oldest first. ``backend``: whose checkpoints."""
    held = []
    for path in list_checkpoints(output_dir, backend):
        if not is_resumable(path):
            continue
        try:
            saved = read_state(path)
        except FinetuneError:
            continue
        rng = rng_file(backend, state.process_index, state.num_processes)
        if saved.num_processes == state.num_processes and not (path / rng).is_file():
            continue
        held.append(step_of(path))
    return held


def common_checkpoint(outcomes: list[dict]) -> int | None:
    """The newest step every process holds (each outcome's ``held``: ``held_checkpoints`` on its machine), or None
    where no step is held by all. ``--resume_from_checkpoint auto`` resumes there when the machines' newest
    checkpoints differ (each machine with its own files: a machine stopped before its newest save completed,
    or lost it)."""
    held = [set(o["held"]) for o in outcomes]
    common = set.intersection(*held) if held else set()
    return max(common) if common else None


def agree_on_checkpoint(state, output_dir, spec: str, backend: str = "accelerate") -> Path | None:
    """The checkpoint to resume from (``checkpoint.find_resume_checkpoint`` in this process's
    ``output_dir``), checked to be the same step on every process (collective; every process calls it).

    Each process resolves ``spec`` on its own machine (verifying the checkpoint's files against its manifest:
    ``checkpoint.verify_checkpoint``; "latest" and "auto" skip damaged ones, "auto" refuses where there are
    checkpoints but none verifies) and also checks that the checkpoint holds its own random-number state
    (``random_states_<rank>.pkl``; without it Accelerate resumes with other dropout masks, silently). The results
    are exchanged. If they differ, "auto" takes the newest checkpoint every process holds complete and verified
    (``common_checkpoint``) and says so; otherwise (or where no step is held by all) every process raises the
    same ``FinetuneError`` naming which machine and rank lacks what, and how to fix it: copy the checkpoint to
    the machine that lacks it, or resume every machine from a step all of them hold. ``backend``: whose
    checkpoints (the Trainer backend's ``checkpoint-<step>`` folders are sealed and checked alike).
    """
    mine, path, caught = _resolve_here(state, output_dir, spec, backend)
    if state.num_processes <= 1:
        if caught is not None:
            raise caught
        return path
    mine.update(machine=distributed.machine_index(state), rank=state.process_index,
                held=held_checkpoints(state, output_dir, backend), dir=str(Path(output_dir).resolve()))
    outcomes = gather_object([mine])
    names = {o["name"] for o in outcomes}
    if len(names) == 1 and (None not in names or not any(o["error"] for o in outcomes)):
        return path  # the same checkpoint everywhere, or ("auto") none anywhere
    machines = distributed.num_machines(state)
    common = common_checkpoint(outcomes) if spec == "auto" else None
    if common is not None:
        chosen = checkpoint_path(output_dir, common, backend)
        if state.is_main_process:
            newest = "; ".join(f"{distributed.describe(where, machines)}: {name}" for name, where in
                               distributed.group_outcomes([{**o, "name": o["name"] or "none"} for o in outcomes],
                                                          "name").items())
            print(f"--resume_from_checkpoint auto: the processes' newest resumable checkpoints differ ({newest}); "
                  f"resuming every process from {chosen.name}, the newest that all of them hold complete and "
                  "verified.")
        return chosen
    raise together(_disagreement(outcomes, output_dir, spec, machines, caught))


def _resolve_here(state, output_dir, spec: str, backend: str) -> tuple[dict, Path | None, FinetuneError | None]:
    """This process's answer for ``agree_on_checkpoint``: (its outcome: the checkpoint's name and step, or the
    error; the checkpoint, or None; the ``FinetuneError`` it met, or None)."""
    mine: dict = {"name": None, "error": None, "step": None}
    try:
        path = find_resume_checkpoint(output_dir, spec, backend)
        if path is None:  # "auto" with no checkpoint: a fresh start, if every process agrees
            raise _NoCheckpoint()
        saved = read_state(path)
        rng = path / rng_file(backend, state.process_index, state.num_processes)
        if saved.num_processes == state.num_processes and not rng.is_file():
            raise FinetuneError(f"checkpoint {path} lacks this process's random-number state ({rng.name})")
        mine.update(name=path.name, step=saved.step)
        return mine, path, None
    except _NoCheckpoint:
        return mine, None, None
    except FinetuneError as err:
        mine["error"] = str(err)
        return mine, None, err


def _disagreement(outcomes: list[dict], output_dir, spec: str, machines: int, caught) -> FinetuneError:
    """The error every process raises where the processes' checkpoints (``outcomes``) differ and none is held by
    all: which machine and rank would resume from what or cannot, and the fixes. ``caught``: this process's own
    error (None where it found a checkpoint or none)."""
    for o in outcomes:  # "auto": some processes found a checkpoint, these none
        if o["name"] is None and o["error"] is None:
            o["error"] = f"no complete checkpoint under {checkpoints_dir(o['dir'])}"
    if caught is None:  # this process found none ("auto")
        caught = FinetuneError(f"no complete checkpoint under {checkpoints_dir(output_dir)}")
    failed = distributed.group_outcomes(outcomes, "error")
    if len(failed) == 1 and all(o["error"] is not None for o in outcomes):
        return caught  # the same on every process: as on one process
    parts = [f"{distributed.describe(where, machines)} would resume from {name}" for name, where in distributed.group_outcomes(outcomes, "name").items()]
    parts += [f"{distributed.describe(where, machines)} cannot: {message}" for message, where in failed.items()]
    newest = max((o["step"] for o in outcomes if o["step"] is not None), default=None)
    fixes = []
    if newest is not None:
        name = checkpoint_path("", newest).name
        source = next(o for o in outcomes if o["step"] == newest)
        targets = {o["machine"]: o["dir"] for o in outcomes if o["step"] != newest}
        fixes.append(f"copy {name} from {checkpoints_dir(source['dir'])} on machine {source['machine']} to "
                     + ", ".join(f"{checkpoints_dir(d)} on machine {m}" for m, d in sorted(targets.items())))
    common = set.intersection(*(set(o["held"]) for o in outcomes))
    if common:
        fixes.append(f"resume every machine from step {max(common)}, which all hold: --resume_from_checkpoint "
                     f"<its --output_dir>/checkpoints/{checkpoint_path('', max(common)).name}")
    fix = (", or ".join(fixes) + ".") if fixes else "start the run again without --resume_from_checkpoint."
    return FinetuneError(f"--resume_from_checkpoint {spec}: every process must resume from the same checkpoint, "
                         f"but {'; '.join(parts)}. To fix it, {fix}")
