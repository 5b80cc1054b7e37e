"""Predict with a trained model: ``finetune predict --model OUTPUT_DIR "some text" ...`` (or ``python -m
finetune.commands.predict``; ``accelerate launch -m finetune.commands.predict`` splits the texts over the processes). A thin CLI
on ``transformers.pipeline`` ("text-classification" or "text-generation"). Inputs, output lines and
``--model`` forms: see docs/outputs.md#using-the-result. User errors print one ``error:`` line and exit 2."""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path

from tqdm.auto import tqdm

from finetune.errors import FinetuneError
from finetune.lifecycle.checkpoint import MARKER, STATE_FILE, is_complete, load_checkpoint_weights
from finetune.recipes import load_recipe

# torch, transformers' pipelines, accelerate and peft are imported where they are used: together they take
# ~6 s to import, which `--help`, a mistyped --model or a bad input file should not wait for (and peft is
# optional: only adapter directories need it).

DEFAULT_MAX_LENGTH = 128
PAIR_COLUMNS = ("sentence1", "sentence2")
PIPELINE_TASKS = {"classification": "text-classification", "generation": "text-generation"}
ADAPTER_KINDS = {"SEQ_CLS": "classification", "CAUSAL_LM": "generation"}  # peft's task_type -> our kind


# ------------------------------------------------------------------------------------------ the model
def _resolve_model_dir(model_dir) -> tuple[Path, Path | None]:
    """(the model directory, the checkpoint directory or ``None``) for ``--model model_dir``; a checkpoint
    (``<run>/checkpoints/step_N``, ``Accelerator.save_state``) resolves to its run's output directory; a ``.gguf``
    file (``finetune export --to gguf``) to itself.
    Raises ``FinetuneError`` naming --model and the fix."""
    path = Path(model_dir).expanduser()
    where = f"--model {str(model_dir)!r}"
    if path.suffix == ".gguf" and path.is_file():  # finetune export --to gguf's file: the model itself
        return path, None
    if not path.exists():
        raise FinetuneError(f"{where}: no such directory. Pass the --output_dir of a training run "
                            "(it holds config.json and model.safetensors).")
    if not path.is_dir():
        raise FinetuneError(f"{where} is a file, not a model directory. Pass the --output_dir of a training run.")
    if (path / "config.json").is_file() or (path / "adapter_config.json").is_file():
        return path, None
    if (path / STATE_FILE).is_file():  # a training checkpoint: weights only
        run = path.parent.parent
        if not is_complete(path):
            raise FinetuneError(f"{where} is an incomplete checkpoint (no {MARKER} marker: its write did not "
                                "finish). Pass another checkpoint of the run, or its --output_dir.")
        if not (run / "config.json").is_file():
            raise FinetuneError(f"{where} is a training checkpoint, but its run's output directory {str(run)!r} "
                                "holds no finished model (config.json) to take the configuration and tokenizer "
                                "from. Let the run finish (resume it with --resume_from_checkpoint), then predict.")
        return run, path
    hint = (" It holds run_config.json but no model: the training run did not finish."
            if (path / "run_config.json").is_file() else "")
    raise FinetuneError(f"{where} is not a Hugging Face model directory (no config.json).{hint} "
                        "Pass the --output_dir of a finished training run.")


def _run_config(path: Path) -> dict:
    """The ``run_config.json`` of the run that wrote ``path`` (for a checkpoint, its run's), or {}."""
    if not (path / "run_config.json").is_file() and (path / STATE_FILE).is_file():
        path = path.parent.parent  # <run>/checkpoints/step_N
    try:
        config = json.loads((path / "run_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _run_max_length(path: Path) -> int:
    """``max_length`` of the run that wrote ``path``, else 128."""
    value = _run_config(path).get("max_length")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else DEFAULT_MAX_LENGTH


def _trained_on_chats(path: Path) -> bool:
    """Whether the run that wrote ``path`` was trained on conversations (its recipe's task's ``chat``): its model
    answers prompts rendered with the chat template, not raw text."""
    recipe = _run_config(path).get("recipe")
    if not isinstance(recipe, str):
        return False
    from finetune.tasks import task_of  # imports transformers: see the note at the top

    try:
        return task_of(load_recipe(recipe)).chat
    except (FinetuneError, OSError, ImportError, SyntaxError, KeyError):
        return False


def model_kind(config, where: str = "--model") -> str:
    """``"classification"`` or ``"generation"`` from ``config.architectures``; ``FinetuneError`` for a
    model with neither head (e.g. a bare ``BertModel``)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,  # lazy: slow import (see the top)
    )

    architectures = list(config.architectures or [])
    if not architectures:
        return "classification"  # no record of the head: the classifier is what finetune trains
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return "classification"
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if any(a in causal or a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in architectures):
        return "generation"
    raise FinetuneError(f"{where} holds a {', '.join(architectures)}, which has no sequence-classification or "
                        "causal-LM head to predict with. Pass the --output_dir of a finetune training run.")


def _load_adapter(path: Path, adapter: dict, where: str):
    """(the PEFT model: base model + adapter, the tokenizer) of the adapter directory ``path`` (``adapter``:
    its adapter_config.json). The tokenizer is the adapter directory's if it holds one, else the base
    model's. Raises ``FinetuneError`` without peft, or naming the base model if loading fails."""
    from transformers import AutoTokenizer  # lazy: slow import (see the top)

    from finetune.models.lora import load_adapter_model  # lazy: slow import (see the top)

    base = adapter.get("base_model_name_or_path")
    try:
        model = load_adapter_model(path)  # a classification adapter's labels come from its config.json
        tokenizer = AutoTokenizer.from_pretrained(str(path) if (path / "tokenizer_config.json").is_file() else base)
    except (OSError, ValueError, TypeError) as err:
        raise FinetuneError(f"{where}: the PEFT adapter or its base model {base!r} (base_model_name_or_path in "
                            f"adapter_config.json) could not be loaded: {err} Point base_model_name_or_path "
                            "at the base model's directory.") from None
    return model, tokenizer


class Predictor:
    """A ``transformers.pipeline`` for ``model_dir`` (as ``predict`` takes it), for repeated ``predict`` calls.
    ``max_length``: truncation in tokens (default: the run's ``run_config.json``, else 128); ``device``: default
    the pipeline's. Attributes ``kind``, ``max_length``, ``pipe``. Raises ``FinetuneError`` for a missing
    directory, no loadable model/tokenizer, or a ``max_length`` above the model's position limit."""

    def __init__(self, model_dir, max_length: int | None = None, device=None):
        from transformers import (  # lazy: slow import (see the top)
            AutoConfig,
            AutoModelForCausalLM,
            AutoModelForSequenceClassification,
            AutoTokenizer,
            pipeline,  # lazy: slow import (see the top)
        )

        where = f"--model {str(model_dir)!r}"
        path, checkpoint = _resolve_model_dir(model_dir)
        gguf = path.is_file()  # a .gguf file (finetune export --to gguf): its run_config.json lies beside it
        self.max_length = _run_max_length(path.parent if gguf else path) if max_length is None else max_length
        if not isinstance(self.max_length, int) or isinstance(self.max_length, bool) or self.max_length < 1:
            raise FinetuneError(f"--max_length must be a positive integer, got {self.max_length!r}.")
        try:
            if gguf:
                from finetune.models.gguf import load_gguf_causal_lm  # lazy: slow import (see the top)

                self.kind = "generation"
                model, tokenizer = load_gguf_causal_lm(path)
            elif (path / "adapter_config.json").is_file():
                adapter = json.loads((path / "adapter_config.json").read_text())
                if adapter.get("task_type") not in ADAPTER_KINDS:
                    raise FinetuneError(f"{where} is a PEFT adapter for task_type {adapter.get('task_type')!r}; "
                                        f"predict handles {' and '.join(ADAPTER_KINDS)} adapters.")
                self.kind = ADAPTER_KINDS[adapter["task_type"]]
                model, tokenizer = _load_adapter(path, adapter, where)
            else:
                config = AutoConfig.from_pretrained(str(path))
                self.kind = model_kind(config, where)
                loader = AutoModelForSequenceClassification if self.kind == "classification" else AutoModelForCausalLM
                model = loader.from_pretrained(str(path), config=config)
                tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError, KeyError) as err:
            raise FinetuneError(f"{where} could not be loaded: {err}") from None
        limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
        if limit is not None and self.max_length > limit:
            raise FinetuneError(f"--max_length {self.max_length} exceeds this model's position limit of {limit} "
                                f"tokens; use --max_length {limit} or less.")
        if checkpoint is not None:
            load_checkpoint_weights(model, checkpoint, where)
        if self.kind == "generation":
            tokenizer.truncation_side = "left"  # keep the end of a long prompt, where the continuation starts
            if tokenizer.pad_token is None:  # batches are padded (on the left: the pipeline sees to that)
                tokenizer.pad_token = tokenizer.eos_token
        if device is not None:  # under torch.distributed the pipeline runs where the model is
            model.to(device)
        self.pipe = pipeline(PIPELINE_TASKS[self.kind], model=model, tokenizer=tokenizer, device=device)
        # prompts go through the chat template
        self.chat = self.kind == "generation" and _trained_on_chats(path.parent if gguf else path)

    def predict(self, texts: list, batch_size: int = 32, max_new_tokens: int = 40, progress: bool | None = None):
        """Predict for N ``texts`` (strings, or (first, second) pairs for a classifier), ``batch_size`` per forward
        pass, longest first. Returns N dicts in input order: ``{"text", "label", "score", "scores"}`` (probabilities
        0..1, the pipeline's softmax) or ``{"text", "generated"}`` (greedy, <= ``max_new_tokens`` tokens); ``[]`` for
        none. ``progress``: a tqdm bar on stderr (None: if more than one batch). Raises ``FinetuneError`` for a size
        below 1, or pairs mixed with texts or given to a causal LM."""
        for name, value in (("batch_size", batch_size), ("max_new_tokens", max_new_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise FinetuneError(f"--{name} must be a positive integer, got {value!r}.")
        texts = list(texts)
        pairs = sum(isinstance(t, (tuple, list)) for t in texts)
        if pairs and pairs != len(texts):
            raise FinetuneError("texts mix single texts and sentence pairs; give one kind only.")
        if pairs and self.kind == "generation":
            raise FinetuneError("a causal LM continues single texts; give texts, not sentence pairs.")
        if self.kind == "classification":
            options = {"top_k": None, "truncation": True, "max_length": self.max_length}  # top_k=None: every label
        else:
            options = {"max_new_tokens": max_new_tokens, "do_sample": False, "return_full_text": False,
                       "tokenizer_encode_kwargs": {"truncation": True, "max_length": self.max_length}}
        if self.chat:  # as the run evaluated its generations: one user turn, the template, stop at end of turn
            from finetune.data.chat import generate_completions  # imports transformers: see the note at the top

            generated = generate_completions(self.pipe.model, self.pipe.tokenizer, texts, max_new_tokens, batch_size,
                                             self.max_length) if texts else []
            return [{"text": text, "generated": completion} for text, completion in zip(texts, generated)]
        order = sorted(range(len(texts)), key=lambda i: -len("".join(texts[i])))
        inputs = ({"text": texts[i][0], "text_pair": texts[i][1]} if pairs else texts[i] for i in order)
        outputs = self.pipe(inputs, batch_size=batch_size, **options) if texts else []
        show = len(texts) > batch_size if progress is None else progress
        results: list = [None] * len(texts)
        bar = tqdm(outputs, total=len(texts), desc="Predicting", unit="text", disable=not show, file=sys.stderr)
        for i, output in zip(order, bar):
            if self.kind == "classification":  # output: {"label", "score"} per label, most probable first
                results[i] = {"text": texts[i], "label": output[0]["label"], "score": output[0]["score"],
                              "scores": {o["label"]: o["score"] for o in output}}
            else:
                results[i] = {"text": texts[i], "generated": output[0]["generated_text"]}
        return results


def predict(model_dir, texts: list, batch_size: int = 32, max_length: int | None = None, *,
            max_new_tokens: int = 40, device=None, progress: bool | None = None) -> list[dict]:
    """Load ``model_dir`` (a run's output directory, a checkpoint in it, or a PEFT adapter directory) and
    return ``Predictor.predict``'s N dicts for ``texts``. Raises ``FinetuneError`` for no texts, a missing or
    unloadable directory, or a bad ``batch_size``/``max_length``. Loads the model per call: reuse a ``Predictor``."""
    texts = list(texts)
    if not texts:
        raise FinetuneError("no texts to predict. Pass texts as arguments, --file PATH, or lines on stdin.")
    return Predictor(model_dir, max_length=max_length, device=device).predict(
        texts, batch_size=batch_size, max_new_tokens=max_new_tokens, progress=progress)


# ------------------------------------------------------------------------------------------ input
def _clean(text) -> str | None:
    return None if text is None or not str(text).strip() else str(text)


def _rows_to_texts(rows: list[dict], source: str) -> list:
    """``text`` (or ``sentence1``/``sentence2``) of each row; raise ``FinetuneError`` for a missing column
    or an empty text, naming the row."""
    if not rows:
        raise FinetuneError(f"--file {source!r} has no rows.")
    columns = list(rows[0].keys())
    if "text" in columns:
        wanted = ("text",)
    elif all(c in columns for c in PAIR_COLUMNS):
        wanted = PAIR_COLUMNS
    else:
        raise FinetuneError(f"--file {source!r} has no 'text' column (it has {', '.join(map(str, columns)) or 'none'}). "
                            "Name the column holding the texts 'text' (or 'sentence1' and 'sentence2' for pairs).")
    texts = []
    for n, row in enumerate(rows, start=1):
        values = [_clean(row.get(c)) for c in wanted]
        if any(v is None for v in values):
            raise FinetuneError(f"--file {source!r}: data row {n} has an empty {'/'.join(wanted)}. "
                                "Remove or fill that row.")
        texts.append(values[0] if len(values) == 1 else tuple(values))
    return texts


def read_texts_file(path_str: str) -> list:  # noqa: C901 - over the budget; to split
    """Texts from ``path_str``: ``.csv``/``.jsonl``/``.json`` rows' ``text`` (or (``sentence1``, ``sentence2``)
    pairs), anything else one text per line (blank lines skipped). Raises ``FinetuneError`` naming --file for
    a missing, empty or unreadable file, a missing column, or an empty text."""
    path = Path(path_str).expanduser()
    if not path.is_file():
        raise FinetuneError(f"--file {path_str!r} does not exist or is not a file. Pass a text file (one text per line), "
                            "or a CSV/JSON-lines file with a 'text' column.")
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise FinetuneError(f"--file {path_str!r} is not UTF-8 text.") from None
    except OSError as err:
        raise FinetuneError(f"--file {path_str!r} could not be read: {err}") from None
    if not content.strip():
        raise FinetuneError(f"--file {path_str!r} is empty. Put one text per line, or a CSV/JSON-lines "
                            "file with a 'text' column.")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        try:
            rows = list(csv.DictReader(io.StringIO(content, newline="")))  # quoted fields may hold newlines
        except csv.Error as err:
            raise FinetuneError(f"--file {path_str!r} could not be read as CSV: {err}") from None
        return _rows_to_texts(rows, path_str)
    if suffix in (".jsonl", ".json"):
        rows = None
        if suffix == ".json":
            try:
                data = json.loads(content)
                rows = data if isinstance(data, list) else None
            except ValueError:
                rows = None
        if rows is None:
            rows = []
            for n, line in enumerate(content.splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except ValueError as err:
                    raise FinetuneError(f"--file {path_str!r}: line {n} is not JSON ({err}).") from None
        if not all(isinstance(r, dict) for r in rows):
            raise FinetuneError(f"--file {path_str!r}: every line must be a JSON object with a 'text' key.")
        return _rows_to_texts(rows, path_str)
    return [line for line in content.splitlines() if line.strip()]


def read_stdin() -> list[str]:
    """One text per line from stdin (blank lines skipped)."""
    if sys.stdin is None:
        return []
    if sys.stdin.isatty():
        print("Reading texts from stdin, one per line (end with Ctrl-D).", file=sys.stderr)
    return [line.rstrip("\r\n") for line in sys.stdin if line.strip()]


def gather_texts(args) -> tuple[list, bool]:
    """The texts the command line asks for, and whether they came from a file or stdin (bulk input)."""
    if args.texts and args.file:
        raise FinetuneError("give texts as arguments or --file, not both.")
    if args.file and args.file != "-":
        return read_texts_file(args.file), True
    if args.file == "-" or not args.texts or args.texts == ["-"]:
        texts = read_stdin()
        if not texts:
            raise FinetuneError("no texts to predict: stdin was empty. Pass texts as arguments, --file PATH, "
                                "or lines on stdin.")
        return texts, True
    if "-" in args.texts:
        raise FinetuneError("'-' (stdin) cannot be mixed with texts given as arguments.")
    texts = [t for t in args.texts if t.strip()]
    if not texts:
        raise FinetuneError("no texts to predict: the arguments are blank.")
    return texts, False


# ------------------------------------------------------------------------------------------ output
def _preview(text, width: int = 80) -> str:
    text = " [SEP] ".join(text) if isinstance(text, (tuple, list)) else text
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def format_result(result: dict, top_k: int = 1) -> str:
    """One output line: ``label<TAB>probability`` (x ``top_k``, most probable first), then the text's
    start; for a causal LM the prompt's start, then the continuation."""
    if "generated" in result:
        return f"{_preview(result['text'], 40)}\t{' '.join(result['generated'].split())}"
    ranked = sorted(result["scores"].items(), key=lambda kv: -kv[1])[:max(1, top_k)]
    return "\t".join(f"{label}\t{score:.4f}" for label, score in ranked) + f"\t{_preview(result['text'])}"


def _jsonable(result: dict) -> dict:
    text = result["text"]
    return {**result, "text": list(text) if isinstance(text, tuple) else text}


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser of ``python -m finetune.commands.predict``."""
    parser = argparse.ArgumentParser(
        prog="finetune predict",
        description="Predict with a model trained by finetune (its --output_dir, a checkpoint in it, or a PEFT "
                    "adapter directory), through a transformers pipeline.",
        epilog="Texts: positional arguments, --file PATH (one per line; CSV/JSONL with a 'text' column), "
               "or stdin (no texts, or '-').")
    parser.add_argument("texts", nargs="*", help="texts to predict ('-' reads stdin)")
    parser.add_argument("--model", required=True, help="a training run's --output_dir, a checkpoint directory "
                        "in it, a PEFT adapter directory (adapter_config.json), or an exported model (finetune export: "
                        "its merged/ folder or .gguf file)")
    parser.add_argument("--file", help="texts: one per line, or .csv/.jsonl/.json with a 'text' column ('-' = stdin)")
    parser.add_argument("--batch_size", type=int, default=32, help="texts per forward pass (default 32)")
    parser.add_argument("--max_length", type=int, default=None,
                        help="truncate to this many tokens (default: the run's max_length, else 128)")
    parser.add_argument("--top_k", type=int, default=1, help="labels printed per text, most probable first (default 1)")
    parser.add_argument("--max_new_tokens", type=int, default=40,
                        help="causal LMs: most tokens to generate, greedily (default 40)")
    parser.add_argument("--output", help="also write one JSON object per text to this JSON-lines file")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``); returns the exit code (0, or 2 after one ``error:``
    line). With several processes each predicts a contiguous share; the main process prints all, in order."""
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging  # lazy: slow import (see the top)

    hf_logging.disable_progress_bar()  # the CLI prints results; loading bars and load reports are noise
    hf_logging.set_verbosity_error()
    try:
        for name in ("top_k", "batch_size", "max_new_tokens"):
            if getattr(args, name) < 1:
                raise FinetuneError(f"--{name} must be a positive integer, got {getattr(args, name)}.")
        if args.output and Path(args.output).is_dir():
            raise FinetuneError(f"--output {args.output!r} is a directory; give a file path.")
        _resolve_model_dir(args.model)  # before reading stdin: a wrong --model fails at once
        state = _process_state()
        texts, bulk = _gather_texts_once(args, state)
        predictor = Predictor(args.model, max_length=args.max_length, device=state.device)
        with state.split_between_processes(texts) as share:
            results = predictor.predict(share, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                                        progress=(None if bulk else False) if state.is_main_process else False)
        from accelerate.utils import gather_object  # lazy: slow import (see the top)

        results = gather_object(results)  # one process: unchanged; several: every share, in rank order
        from finetune.distributed import leave  # imported by _process_state already

        leave()  # the last collective is done: every process leaves the group before the main one writes
        if not state.is_main_process:
            return 0
        if args.output:
            out = Path(args.output)
            try:
                out.parent.mkdir(parents=True, exist_ok=True)
                with open(out, "w", encoding="utf-8") as f:
                    for result in results:
                        f.write(json.dumps(_jsonable(result), ensure_ascii=False) + "\n")
            except OSError as err:
                raise FinetuneError(f"--output {args.output!r} could not be written: {err}") from None
    except FinetuneError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    for result in results:
        print(format_result(result, args.top_k))
    return 0


def _process_state():
    """Accelerate's ``PartialState``: one process, or one of ``accelerate launch``'s. CPU processes
    (``ACCELERATE_USE_CPU``, or several processes and no GPU) join a gloo group, as ``Accelerator`` does."""
    import torch  # lazy: slow import (see the top)

    from finetune.distributed import process_state, world_size  # lazy: slow import (see the top)

    several = world_size() > 1
    state = process_state(cpu=several and not torch.cuda.is_available())
    if state.num_processes > 1 and state.is_main_process:
        print(f"Predicting on {state.num_processes} processes ({state.device.type}).", file=sys.stderr)
    return state


def _gather_texts_once(args, state) -> tuple[list, bool]:
    """``gather_texts`` on the main process, shared with the others (stdin can be read only once)."""
    if state.num_processes <= 1:
        return gather_texts(args)
    from accelerate.utils import broadcast_object_list  # lazy: slow import (see the top)

    payload = [None]
    if state.is_main_process:
        try:
            payload = [("ok", gather_texts(args))]
        except FinetuneError as err:
            payload = [("error", str(err))]
    broadcast_object_list(payload)
    status, value = payload[0]
    if status == "error":
        raise FinetuneError(value)
    return value


if __name__ == "__main__":
    sys.exit(main())
