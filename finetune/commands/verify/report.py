"""verify's report: ``verify.json`` (the judgement's dict as it is) and ``verify.md`` (the table, the premises,
the tolerances and the verdict), written to the output directory and printed."""

from __future__ import annotations

import json
from pathlib import Path

from finetune.commands.verify.judgement import CONTROL_FACTOR, DETERMINISM_TOLERANCE, _fmt, _percent
from finetune.commands.verify.measurement import FLOOR_FACTOR, MIN_TOLERANCE


def render(report: dict) -> str:
    """``verify.md``: the table, the premises, the tolerances and the verdict."""
    last = report.get("last_window_samples")
    partial = (f"the last window holds {last} of {report['effective_batch']} samples" if last is not None
               and last < report["effective_batch"] else "no partial window (the data ended on a full one)")
    lines = [f"# finetune verify: {report['recipe']}", "",
             f"Effective batch {report['effective_batch']} samples = micro-batch x accumulation x "
             f"{report['processes']} process(es); {report['verify_steps']} optimizer steps, {partial}; precision "
             f"{report['precision']}; engine {report['engine']}; "
             + (f"base {report['quantized_base']}, sha256 {report['quantized_base_sha256'][:12]}..., the same in "
                "every way and unchanged by its run; " if report.get("quantized_base") else "")
             + f"dropout off. Reference: {report['reference']}.", "",
             "| way | engine | gradients Δ (step 1 / worst step) | worst tensor | loss Δ (max) | final weights Δ / "
             "distance trained | worst tensor | items per step | fp16 skips | s | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["rows"]:
        steps = r.get("gradient_steps") or {}
        gradients = (f"{_fmt(r.get('gradient_difference'))} / {_fmt(max(steps.values()))}" if steps else "")
        lines.append(f"| {r['way']} | {r['engine']} | {gradients} | "
                     f"{r.get('gradient_worst_tensor') or ''} | {_fmt(r.get('loss_difference'))} | "
                     f"{_fmt(r.get('weight_difference'))} | {r.get('weight_worst_tensor') or ''} | "
                     f"{','.join(f'{v:g}' for v in r.get('items') or [])} | "
                     f"{','.join(map(str, r['skipped_steps'])) or '-'} | {r['seconds']} | "
                     f"{r.get('verdict') or r.get('error') or ''} |")
    t, f = report["tolerance"], report["noise_floor"]
    determinism = report.get("determinism") or {}
    if determinism.get("difference") is not None:
        lines += ["", f"Determinism: one micro-batch's gradients computed twice differ by "
                      f"{determinism['difference']:.2e} (allowed {DETERMINISM_TOLERANCE:.0e})."]
    lines += ["", f"Noise floor (the reference with its samples reordered, and computed in chunks): gradients "
              f"{f['gradients']:.2e} at step 1, up to {max(f['gradient_steps'].values(), default=0.0):.2e}; losses "
              f"{f['losses']:.2e}; the loss after the last update {f.get('after', 0.0):.2e}; weights {f['weights']:.2e}. Tolerance ({FLOOR_FACTOR} x the floor, at least "
              f"{MIN_TOLERANCE:.1e}): gradients {t['gradients']:.2e} at step 1, losses {t['losses']:.2e}, the loss after "
              f"{t.get('after', 0.0):.2e}, weights "
              f"{t['weights']:.2e}."]
    if report["control_margin"] is not None:
        kind = ("wrong normalisation: the mean of micro-batch means" if any(
            r["role"] == "control" and r["way"].endswith("mean of micro-batch means") for r in report["rows"])
            else "wrong normalisation")
        lines.append(f"Positive control ({kind}): {report['control_margin']:.3g} x the "
                     f"{'gradient' if report['gradients_compared'] else 'weight'} tolerance (needs >= "
                     f"{CONTROL_FACTOR}).")
    if not report["gradients_compared"]:
        lines.append("Gradients not compared: the engine steps its optimizer inside its own backward "
                     f"({report['engine']}); losses and the fp32 master weights are, and the control is measured on "
                     "the weights.")
    for d in report.get("detects") or []:
        lines.append(f"Small control ({d['target']} mis-weighted): " + ", ".join(
            f"{_percent(t['size'])} {'caught' if t['caught'] else 'not caught'}"
            + (f" ({t['margin']:.3g} x the tolerance and its twin's noise)" if t.get("margin") is not None else "")
            for t in d["tried"]) + ".")
    lines += report.get("notes") or []
    line = report.get("detects_line")
    lines += ["", f"**Verdict: {report['verdict']}" + (f": {line}" if line and report["verdict"] == "exact" else "")
              + "**"]
    lines += [f"- cause: {c}" for c in report["causes"]]
    return "\n".join(lines) + "\n"


def write(report: dict, root: Path) -> int:
    """Write ``verify.json`` and ``verify.md`` into ``root`` and print the latter; returns the exit code (0
    exact, 1 not exact or inconclusive)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "verify.json").write_text(json.dumps(report, indent=2) + "\n")
    (root / "verify.md").write_text(text := render(report))
    print(text)
    return 0 if report["verdict"] == "exact" else 1
