"""``finetune eval``: lm-evaluation-harness benchmarks of a trained run, a checkpoint, a LoRA adapter directory or a
GGUF file, in process (``finetune.outputs.lm_eval.run_benchmarks``), with lm-eval's names for its flags (``--tasks``,
``--limit``, ``--num_fewshot``, ``--apply_chat_template``, ``--batch_size``, ``--include_path``,
``--output_path``). ``--baseline`` scores a second model on the same documents and prints base, tuned and the
difference with its standard error (paired: over the per-document differences).

    finetune eval --model outputs/bbc-headlines --tasks bbc_topic,bbc_headline --limit 100
    finetune eval --model outputs/lora-run --tasks bbc_topic --baseline ~/.cache/finetune/SmolLM2-135M-Instruct.Q4_1.gguf

Writes ``<output_path>/eval_results.json`` (lm-eval's results, configs, versions, sample counts, seeds, and the
chat template used) and ``<output_path>/samples_<task>.jsonl`` (lm-eval's per-document records: arguments,
log-likelihoods or generations, metrics). For a run directory (results in ``<run>/eval``), the run's model card gets
a benchmarks section: base, tuned and the difference with standard errors."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from finetune.config.cadence import task_names
from finetune.errors import FinetuneError, reports_errors


def load_for_eval(model_arg: str):
    """(model, tokenizer, kind) for ``--model``: a run's output directory or any model directory (``config.json``),
    a training checkpoint (the run's model with the checkpoint's weights), a LoRA adapter directory (a peft model on
    its base, not merged), or a ``.gguf`` file (de-quantized to fp32 as training loads it). fp32, eval mode. Raises
    ``FinetuneError`` naming ``--model`` and the fix."""
    from transformers import AutoModelForCausalLM

    from finetune.commands.predict import _resolve_model_dir
    from finetune.lifecycle.checkpoint import load_checkpoint_weights
    from finetune.models.loading import load_causal_lm, load_tokenizer
    from finetune.models.lora import ADAPTER_CONFIG, load_adapter_model

    where = f"--model {model_arg!r}"
    if model_arg.endswith(".gguf"):
        if not Path(model_arg).is_file():
            raise FinetuneError(f"{where}: no such GGUF file (the shipped one: python -m finetune.fetch smollm2-gguf).")
        return load_causal_lm(model_arg).float().eval(), load_tokenizer(model_arg), "gguf"
    path, checkpoint = _resolve_model_dir(model_arg)
    try:
        if (path / ADAPTER_CONFIG).is_file():
            return load_adapter_model(path).eval(), load_tokenizer(str(path)), "adapter"
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype="float32")
    except (OSError, ValueError) as err:
        raise FinetuneError(f"{where} could not be loaded as a causal LM: {str(err).splitlines()[0]} Benchmarks "
                            "score causal LMs (a bbc-news classifier has no language-model head).") from None
    if checkpoint is not None:
        load_checkpoint_weights(model, checkpoint, where)
    return model.eval(), load_tokenizer(str(path)), "checkpoint" if checkpoint is not None else "model"


def evaluate_model(model_arg: str, args) -> dict:
    """``run_benchmarks`` on ``--model`` with the command's flags; lm-eval's results dict."""
    from finetune.outputs.lm_eval import run_benchmarks

    model, tokenizer, _ = load_for_eval(model_arg)
    return run_benchmarks(model, tokenizer, args.tasks, limit=args.limit, num_fewshot=args.num_fewshot,
                          apply_chat_template=args.apply_chat_template, batch_size=args.batch_size,
                          include_path=args.include_path, device=args.device, seed=args.seed)


def write_results(results: dict, output_path: Path, model_arg: str) -> Path:
    """``eval_results.json`` (everything but the per-document records, with ``finetune.model``: the ``--model`` or
    ``--baseline`` it scored) and one ``samples_<task>.jsonl`` per task; returns the results file's path."""
    from lm_eval.utils import handle_non_serializable

    from finetune.outputs.lm_eval import write_samples

    output_path.mkdir(parents=True, exist_ok=True)
    summary = {k: v for k, v in results.items() if k != "samples"}
    summary["finetune"] = {"model": model_arg}
    path = output_path / "eval_results.json"
    path.write_text(json.dumps(summary, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n")
    write_samples(results, output_path)
    return path


def default_output_path(model_arg: str) -> Path:
    """Where results go without ``--output_path``: ``<run>/eval`` for a run or adapter directory,
    ``<run>/eval/step_N`` for a checkpoint (its folder is sealed), ``./eval_results`` for a GGUF file."""
    from finetune.commands.predict import _resolve_model_dir

    if model_arg.endswith(".gguf"):
        return Path("eval_results")
    path, checkpoint = _resolve_model_dir(model_arg)
    return path / "eval" / (checkpoint.name if checkpoint is not None else "")


def build_parser() -> argparse.ArgumentParser:
    """``finetune eval``'s arguments, with lm-eval's names (``--tasks``, ``--limit``, ``--num_fewshot``, ...)."""
    parser = argparse.ArgumentParser(prog="finetune eval", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="a run's --output_dir, a checkpoint (<run>/checkpoints/step_N), a LoRA adapter "
                             "directory, or a .gguf file")
    parser.add_argument("--tasks", required=True,
                        help="lm-eval task names, comma-separated; shipped offline: bbc_topic, bbc_headline")
    parser.add_argument("--limit", type=float, default=None,
                        help="documents per task (a count; below 1: a fraction of the task), lm-eval's --limit")
    parser.add_argument("--num_fewshot", type=int, default=None, help="few-shot examples (lm-eval's --num_fewshot)")
    parser.add_argument("--apply_chat_template", action="store_true",
                        help="render each request with the tokenizer's chat template (lm-eval's flag)")
    parser.add_argument("--batch_size", type=int, default=1, help="requests per forward (default 1)")
    parser.add_argument("--include_path", default=None, help="a folder of your own lm-eval task configs (YAML)")
    parser.add_argument("--baseline", default=None,
                        help="also score this model (same forms as --model) and print base, tuned and the difference")
    parser.add_argument("--output_path", default=None,
                        help="where eval_results.json and samples_<task>.jsonl go (default: <model dir>/eval, or "
                             "./eval_results for a GGUF file)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--seed", type=int, default=0, help="lm-eval's random, numpy, torch and few-shot seeds")
    return parser


@reports_errors
def main(argv: list[str] | None = None) -> int:
    """``finetune eval``; exit 0, or 2 after one ``error:`` line (``FinetuneError``)."""
    args = build_parser().parse_args(argv)
    if not task_names(args.tasks):
        raise FinetuneError(f"--tasks {args.tasks!r} names no task: give lm-eval task names, comma-separated "
                            "(shipped offline: bbc_topic, bbc_headline).")
    args.tasks = task_names(args.tasks)
    if args.limit is not None and args.limit <= 0:
        raise FinetuneError(f"--limit must be positive (documents per task, or a fraction below 1), got {args.limit}.")
    if args.limit is not None and args.limit >= 1:
        if args.limit != int(args.limit):
            raise FinetuneError(f"--limit {args.limit}: a count of documents is a whole number (or give a fraction "
                                "below 1).")
        args.limit = int(args.limit)
    from finetune.outputs.card import BENCHMARKS, benchmarks_section, update_benchmarks_section
    from finetune.outputs.lm_eval import comparison_rows, document_values, flat_metrics

    tuned = evaluate_model(args.model, args)
    base = evaluate_model(args.baseline, args) if args.baseline else None
    out = Path(args.output_path) if args.output_path else default_output_path(args.model)
    path = write_results(tuned, out, args.model)
    if base is not None:
        write_results(base, out / "baseline", args.baseline)
    else:  # an earlier --baseline's results no longer describe these (the card would pair them)
        shutil.rmtree(out / "baseline", ignore_errors=True)
    rows = comparison_rows(flat_metrics(tuned), flat_metrics(base) if base else None,
                           (document_values(tuned.get("samples")), document_values(base.get("samples"))) if base
                           else None)
    width = max((len(r[0]) for r in rows), default=10)
    header = ("metric".ljust(width), "base".rjust(18), "tuned".rjust(18), "difference".rjust(18)) if base else (
        "metric".ljust(width), "value".rjust(18))
    print("  ".join(header))
    for key, b, t, d in rows:
        print("  ".join((key.ljust(width), b.rjust(18), t.rjust(18), d.rjust(18)) if base else
                        (key.ljust(width), t.rjust(18))))
    print(f"results: {path}")
    run_dir = _run_dir(args.model, out)
    if run_dir is not None and update_benchmarks_section(run_dir / "README.md", benchmarks_section(run_dir)):
        print(f"model card: {run_dir / 'README.md'} (section {BENCHMARKS!r})")
    return 0


def _run_dir(model_arg: str, output_path: Path) -> Path | None:
    """The run directory whose card shows these results: ``--model``'s when the results went to its ``eval/``
    folder (the final model, not a checkpoint's), else None."""
    if model_arg.endswith(".gguf"):
        return None
    from finetune.commands.predict import _resolve_model_dir

    path, checkpoint = _resolve_model_dir(model_arg)
    if checkpoint is not None or output_path.resolve() != (path / "eval").resolve():
        return None
    return path
