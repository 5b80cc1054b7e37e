"""What an export leaves beside the model: ``export_report.json`` (every figure, tolerance and verdict) and the export
folder's ``README.md`` (a model card: what was exported, from which run, and the verification figures)."""

from __future__ import annotations

import json
from pathlib import Path

REPORT = "export_report.json"
INCOMPLETE = "EXPORT_INCOMPLETE"  # present from the start of an export until its verification passes


def write_report(folder: Path, report: dict) -> Path:
    """``folder/export_report.json``: ``report`` as indented JSON."""
    path = folder / REPORT
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return path


def _row(comparison: dict) -> str:
    greedy = f"{comparison['greedy_identical']}/{comparison['greedy_total']}"
    verdict = "pass" if comparison["passed"] else "FAIL: " + "; ".join(comparison["failures"])
    return (f"| {comparison['name']} | {comparison['positions']} | {comparison['max_abs_logit_diff']:.3g} "
            f"({comparison['relative_logit_diff']:.3g} relative) | "
            f"{comparison['top1_agreement']:.4%} | {comparison['mean_kl']:.3g} | {greedy} | {verdict} |")


def _calibration(report: dict) -> str:
    """The card's sentence on what the merge's tolerance was calibrated on ("" for a float32 merge of a full run)."""
    calibration = report.get("merge_calibration") or {}
    parts = [f"{c['name']}: largest logit difference {c['max_abs_logit_diff']:.3g}, mean KL {c['mean_kl']:.3g}"
             for c in (calibration.get("adapter_effect"), calibration.get("floor")) if c]
    return ("Measured to calibrate the merge's tolerance: " + "; ".join(parts) + ".") if parts else ""


def write_card(folder: Path, report: dict) -> Path:
    """``folder/README.md`` (``huggingface_hub.ModelCard``): the exported files, the run it came from, a table of
    the verification figures of ``report``, what the merge's tolerance was calibrated on, and a failed
    conversion's error."""
    from huggingface_hub import ModelCard, ModelCardData

    files = "\n".join(f"- `{name}`" for name in report["files"])
    rows = "\n".join(_row(c) for c in report["verification"])
    merge, source = report["merge"], report["source"]
    status = "verified" if report["passed"] else "**NOT verified: this export is incomplete (EXPORT_INCOMPLETE)**"
    how = "a LoRA adapter merged with peft's merge_and_unload" if source["lora"] else "full fine-tuning"
    quantized = report.get("quantized_base")
    if quantized:
        how = (f"a QLoRA adapter merged with peft's merge_and_unload into its {quantized['quantization']} base "
               f"de-quantized to float32; judged against the run on its quantized base: {quantized['tolerance_from']}")
    tags = ["finetune", "export"] + (["gguf"] if report.get("gguf") else [])
    mib = 2 ** 20
    bound = "within" if merge["within_bound"] else "above"
    content = "\n".join([
        "---", ModelCardData(library_name="transformers", tags=tags).to_yaml(), "---", "",
        f"# {source['name']}, exported", "",
        f"Exported by `finetune export` from `{source['model_dir']}` ({how}); {status}.", "", files, "",
        "## Verification", "",
        f"On {report['verify_samples']} validation prompts of the run ({report['positions']} token positions): logits "
        "compared in fp32, KL is the mean per-token KL(reference || export) in nats, greedy continuations compared as "
        "strings.", "",
        "| comparison | positions | largest logit difference | top-1 agreement | mean KL | greedy identical | verdict |",
        "|---|---|---|---|---|---|---|", rows, "", _calibration(report), "",
        *([f"GGUF conversion failed: {report['gguf']['error']}", ""] if (report.get("gguf") or {}).get("error") else []),
        f"Merge: {merge['seconds']:.1f} s; peak allocated (anonymous) memory above the process's before the merge "
        f"{merge['peak_anon_increase_bytes'] / mib:.0f} MiB (whole resident set, with the mapped files' page cache: "
        f"{merge['peak_rss_increase_bytes'] / mib:.0f} MiB), for {merge['weights_bytes'] / mib:.0f} MiB of weights and "
        f"{merge['layer_bytes'] / mib:.1f} MiB in the largest layer ({bound} weights + one layer). Export wall time "
        f"{report['seconds']:.1f} s on {report['machine']}.", ""])
    path = folder / "README.md"
    ModelCard(content).save(path)
    return path
