"""Side-by-side comparison of the two backends: ``finetune compare --recipe NAME`` (``main``), each in a fresh
subprocess, one after the other. Writes ``accelerate/``, ``trainer/``, ``comparison.json``/``.md`` and
``loss_curves.png`` into ``--output_dir``. See docs/backends.md#finetune-compare."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from finetune import distributed
from finetune.config import config_argv, fields_with, parse_config, reproduce_command
from finetune.errors import FinetuneError, reports_errors
from finetune.lifecycle.resolve import resolve
from finetune.lifecycle.run_log import read_log
from finetune.recipes import load_recipe

BACKENDS = ("accelerate", "trainer")
# the batch plan is resolved once here, so both backends get the same explicit micro-batch and accumulation:
# the fields declared ``compare_passes=False`` (finetune/config/) are not passed
_NOT_PASSED = frozenset(fields_with(compare_passes=False))


def child_argv(config, recipe, backend: str, output_dir: Path) -> list[str]:
    """Flags that make ``run.py`` resolve exactly ``config`` for one ``backend`` (``config_argv``: the
    recipe plus every setting that differs from its defaults), into ``output_dir``."""
    return config_argv(config, recipe, exclude=_NOT_PASSED) + [
        "--backend", backend, "--output_dir", str(output_dir), "--overwrite_output_dir", "True"]


def summarize(runs: dict[str, dict]) -> dict:
    """The comparison of ``runs`` (backend -> {"metrics", "steps": log records, "wall_time": seconds}): per-backend
    figures, the per-step loss differences over the steps both ran (max and mean of |accelerate - trainer|), and
    the samples/s ratio accelerate / trainer."""
    a, t = (runs[b]["steps"] for b in BACKENDS)
    n = min(len(a), len(t))
    diffs = [abs(x["loss"] - y["loss"]) for x, y in zip(a[:n], t[:n])]
    per_backend = {}
    for backend in BACKENDS:
        m = runs[backend]["metrics"]
        per_backend[backend] = {
            **{k: v for k, v in m.items() if k.startswith("eval_")},
            "final_train_loss": m["final_train_loss"],
            "train_loss": m["train_loss"],
            "optimizer_steps": m["optimizer_steps"],
            "train_samples_per_second": m["train_samples_per_second"],
            "train_runtime": m["train_runtime"],
            "wall_time": runs[backend]["wall_time"],
            "peak_memory_bytes": m["peak_memory_bytes"],
            "peak_memory_kind": m["peak_memory_kind"],
            "mixed_precision": m["mixed_precision"],
        }
    trainer_speed = per_backend["trainer"]["train_samples_per_second"]
    return {
        "backends": per_backend,
        "steps_compared": n,
        "max_abs_step_loss_diff": max(diffs) if diffs else None,
        "mean_abs_step_loss_diff": sum(diffs) / n if n else None,
        "samples_per_second_ratio_accelerate_over_trainer":
            per_backend["accelerate"]["train_samples_per_second"] / trainer_speed if trainer_speed else None,
        "loss_curves": {b: [r["loss"] for r in runs[b]["steps"]] for b in BACKENDS},
        "learning_rate": {b: [r["learning_rate"] for r in runs[b]["steps"]] for b in BACKENDS},
    }


def render_markdown(summary: dict, config, command: str) -> str:
    """``comparison.md``: one table, the loss agreement and speed ratio, and the command."""
    rows = [("eval_accuracy", "{:.4f}"), ("eval_f1", "{:.4f}"), ("eval_loss", "{:.4f}"), ("final_train_loss", "{:.4f}"),
            ("train_loss", "{:.4f}"), ("optimizer_steps", "{}"), ("train_samples_per_second", "{:.2f}"),
            ("train_runtime", "{:.1f} s"), ("wall_time", "{:.1f} s"), ("peak_memory_bytes", "{}"),
            ("mixed_precision", "{}")]
    b = summary["backends"]
    lines = [f"# accelerate vs Trainer: {config.recipe}", "",
             f"Micro-batch {config.per_device_train_batch_size} x accumulation {config.gradient_accumulation_steps}, "
             f"lr {config.learning_rate}, {config.num_train_epochs} epoch(s), seed {config.seed}, "
             f"precision requested {config.mixed_precision}.", "",
             "| metric | accelerate | trainer |", "| --- | --- | --- |"]
    for key, fmt in rows:
        if key not in b["accelerate"] and key not in b["trainer"]:
            continue
        cells = []
        for backend in BACKENDS:
            value = b[backend].get(key)
            if key == "peak_memory_bytes" and value is not None:
                cells.append(f"{value / 2**20:.0f} MiB ({b[backend]['peak_memory_kind']})")
            else:
                cells.append("n/a" if value is None else fmt.format(value))
        lines.append(f"| {key} | {cells[0]} | {cells[1]} |")
    ratio = summary["samples_per_second_ratio_accelerate_over_trainer"]
    lines += ["", f"- Per-step loss difference over {summary['steps_compared']} optimizer steps: "
              f"max {summary['max_abs_step_loss_diff']:.2e}, mean {summary['mean_abs_step_loss_diff']:.2e} "
              "(mean loss per sample in both; Trainer's own log would show the window sum, see docs/backends.md).",
              f"- Speed ratio (train samples/s, accelerate / trainer, this run): {ratio:.3f}" if ratio else "",
              "", "![loss curves](loss_curves.png)", "", "Reproduce:", "", f"    {command}", ""]
    return "\n".join(lines)


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, imported here (an optional extra, ``pip install
    -e ".[compare]"``, needed by ``compare`` alone, and 0.4 s to import). Raises ``FinetuneError`` naming the
    install command when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise FinetuneError("--compare draws loss_curves.png with matplotlib, which is not installed: "
                            'pip install -e ".[compare]" in the clone, or pip install matplotlib.') from None
    return plt


def plot_loss_curves(summary: dict, path: Path) -> None:
    """``loss_curves.png``: both backends' loss per optimizer step, learning rate on a second axis. Raises
    ``FinetuneError`` without matplotlib (``pyplot``)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    styles = {"accelerate": dict(color="tab:blue", lw=2.0), "trainer": dict(color="tab:orange", lw=1.2, ls="--")}
    for backend in BACKENDS:
        losses = summary["loss_curves"][backend]
        ax.plot(range(1, len(losses) + 1), losses, label=f"{backend} loss", **styles[backend])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss (mean per sample)")
    lr_axis = ax.twinx()
    lrs = summary["learning_rate"]["accelerate"]
    lr_axis.plot(range(1, len(lrs) + 1), lrs, color="tab:gray", lw=1, alpha=0.7, label="learning rate")
    lr_axis.set_ylabel("learning rate")
    handles = ax.get_legend_handles_labels()[0] + lr_axis.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper right")
    ax.set_title("accelerate vs Trainer: loss per optimizer step")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def compare(config) -> dict:
    """Run both backends with ``config``, write the comparison into ``config.output_dir`` and return the summary
    (``comparison.json``). Raises ``FinetuneError`` under several processes, or when a backend's run fails."""
    if distributed.world_size() > 1:
        raise FinetuneError("finetune compare launches each backend itself in a single process; run it with "
                            "`finetune compare ...` or a 1-process `accelerate launch -m finetune.commands.compare`.")
    pyplot()  # without matplotlib, refused before any work
    recipe = load_recipe(config.recipe)
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "run_config.json").write_text(config.to_json() + "\n")
    runs = {}
    for backend in BACKENDS:
        print(f"\n=== {backend} backend ===", flush=True)
        start = time.time()
        result = subprocess.run([sys.executable, "-m", "finetune.run", *child_argv(config, recipe, backend, out / backend)])
        if result.returncode != 0:
            raise FinetuneError(f"the {backend} backend failed (exit {result.returncode}); its output is above.")
        steps = read_log(out / backend, "step")
        runs[backend] = {"metrics": json.loads((out / backend / "metrics.json").read_text()), "steps": steps,
                         "wall_time": round(time.time() - start, 3)}
    summary = summarize(runs)
    summary["settings"] = config.to_dict()
    command = reproduce_command(config_argv(config, recipe, exclude={"compare"})).replace(
        "finetune train", "finetune compare", 1)
    (out / "comparison.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "comparison.md").write_text(render_markdown(summary, config, command))
    plot_loss_curves(summary, out / "loss_curves.png")
    print("\n" + (out / "comparison.md").read_text())
    return summary


@reports_errors
def main(argv: list[str] | None = None) -> int:
    """``finetune compare``'s entry (in this process; each backend then runs in a subprocess of its own): the
    training flags, resolved as a training run's (``resolve.resolve``), compared. The exit code: 0, or 2 with one
    ``error:`` line for bad input or a failed backend."""
    argv = list(sys.argv[1:] if argv is None else argv)
    resolution = resolve(parse_config([*argv, "--compare", "True"]))
    if resolution.finished is None:
        compare(resolution.config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
