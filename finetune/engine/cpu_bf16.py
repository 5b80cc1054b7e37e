"""Whether a CPU run that asks for fp16 trains in bf16 instead: decided from measurements, per recipe and CPU kind.

A CPU does not run fp16 (Accelerate trains in fp32 there), and bf16 autocast is faster than fp32 only where the CPU
multiplies in bf16 (AVX512-BF16, AMX); emulated, it is about 3x slower. So the choice is measured, not guessed:
``bench/bench_bf16_recipes.py`` runs each recipe at its defaults in both precisions over seeds and appends one record
a run to ``recipes/bf16_measured.json`` (shipped with the package; the table: docs/bf16-recipes.md), or to the
``--records`` a user names; ``<FINETUNE_CACHE or ~/.cache/finetune>/bf16_measured.json`` holds a machine's own.

Requested fp16 on a CPU runs bf16 when, for the run's recipe at its default model on this CPU kind
(``machine.cpu_kind``), at least ``MIN_SEEDS`` seeds ran in both precisions, bf16's median per-seed samples/s ratio
is at least ``WIN_RATIO``, and the recipe's metric in bf16 is no worse than in fp32 by more than fp32's own spread
over the seeds (one standard deviation). Otherwise the run stays in fp32, and the banner says what was measured.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from importlib.resources import files
from pathlib import Path

from finetune.errors import FinetuneError
from finetune.machine import cpu_kind
from finetune.models.fetch import default_cache_dir

# the shipped records: one per run of bench/bench_bf16_recipes.py (CPU kind, recipe, seed, precision, samples/s, metric)
RECORDS = Path(str(files("finetune.recipes") / "bf16_measured.json"))
# each recipe's headline metric (the records' "metric"); perplexity and losses: lower is better
METRIC = {"bbc-news": "eval_accuracy", "bbc-headlines": "eval_rougeL", "bbc-news-clm": "eval_perplexity"}
LOWER_IS_BETTER = ("eval_perplexity", "eval_loss")
MIN_SEEDS = 3
# what a record must hold (bench/bench_bf16_recipes.py's record_run writes more)
_KEYS = frozenset({"cpu_kind", "recipe", "seed", "precision_requested", "train_samples_per_second", "metric_value"})
# bf16 must beat fp32 by 5%: on the project's VM, runs of one configuration differ by 2-6% (docs/results.md)
WIN_RATIO = 1.05


def user_records_path() -> Path:
    """This machine's own records: ``bf16_measured.json`` in the cache folder (``fetch.default_cache_dir``:
    ``FINETUNE_CACHE``, default ``~/.cache/finetune``), written by ``bench/bench_bf16_recipes.py --records``."""
    return default_cache_dir() / "bf16_measured.json"


def load_records(*paths: Path) -> list[dict]:
    """The records of ``paths`` (JSON lists; default: the shipped ones, then this machine's own), in order; a file
    that does not exist adds none. Raises ``FinetuneError`` for a file that is not a JSON list of records."""
    records = []
    for path in paths or (RECORDS, user_records_path()):
        if Path(path).is_file():
            try:
                found = json.loads(Path(path).read_text())
                if not isinstance(found, list) or not all(isinstance(r, dict) and _KEYS <= set(r) for r in found):
                    raise ValueError(f"not a list of records with {', '.join(sorted(_KEYS))}")
            except ValueError as err:
                raise FinetuneError(f"the bf16 measurements in {path} cannot be read ({err}): delete the file, or "
                                    "write it again with bench/bench_bf16_recipes.py --records.") from None
            records += found
    return records


def summarize(records: list[dict]) -> dict:
    """``{cpu_kind: {recipe: row}}`` over ``records``: per row the seeds measured in both precisions
    (``seeds_both``), per precision ("fp32", "bf16") its seeds, the median samples/s, the metric's values, mean and
    sample standard deviation over seeds, and ``ratio_bf16_fp32``: the median of the per-seed ratios of samples/s
    (``ratios``). A later record of the same (kind, recipe, precision, seed) replaces an earlier one."""
    out: dict = {}
    for r in records:
        out.setdefault(r["cpu_kind"], {}).setdefault(r["recipe"], {}).setdefault(r["precision_requested"], {})[r["seed"]] = r
    table = {}
    for kind, recipes in out.items():
        for recipe, by_precision in recipes.items():
            fp32, bf16 = by_precision.get("no", {}), by_precision.get("bf16", {})
            both = sorted(set(fp32) & set(bf16))
            row = {"seeds_both": both, "metric": METRIC.get(recipe, "eval_accuracy")}
            for label, runs in (("fp32", fp32), ("bf16", bf16)):
                values = [runs[s]["metric_value"] for s in sorted(runs) if runs[s]["metric_value"] is not None]
                row[label] = {"seeds": sorted(runs), "precision_ran": sorted({str(runs[s].get("precision_ran")) for s in runs}),
                              "samples_per_second": statistics.median([runs[s]["train_samples_per_second"] for s in runs])
                              if runs else None,
                              "hfu_of_measured_peak": [runs[s].get("hfu_of_measured_peak") for s in sorted(runs)],
                              "metric_values": values,
                              "metric_mean": statistics.fmean(values) if values else None,
                              "metric_stdev": statistics.stdev(values) if len(values) > 1 else None}
            ratios = [bf16[s]["train_samples_per_second"] / fp32[s]["train_samples_per_second"] for s in both]
            row["ratio_bf16_fp32"] = statistics.median(ratios) if ratios else None
            row["ratios"] = ratios
            table.setdefault(kind, {})[recipe] = row
    return table


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the records say of bf16 against fp32 for ``recipe`` on ``cpu_kind``: ``seeds`` measured in both,
    ``ratio`` (bf16 / fp32 samples/s, median per seed), the ``metric``'s means (``fp32_mean``, ``bf16_mean``) and
    fp32's standard deviation over the seeds (``fp32_stdev``)."""

    recipe: str
    cpu_kind: str
    seeds: int
    ratio: float
    metric: str
    fp32_mean: float
    bf16_mean: float
    fp32_stdev: float

    @property
    def faster(self) -> bool:
        """bf16 is at least ``WIN_RATIO`` times fp32's samples/s."""
        return self.ratio >= WIN_RATIO

    @property
    def metric_holds(self) -> bool:
        """bf16's mean metric is no worse than fp32's by more than fp32's standard deviation over the seeds."""
        worse = self.bf16_mean - self.fp32_mean if self.metric in LOWER_IS_BETTER else self.fp32_mean - self.bf16_mean
        return worse <= self.fp32_stdev

    @property
    def runs_bf16(self) -> bool:
        """Requested fp16 runs bf16 on this CPU kind: faster, and the metric holds."""
        return self.faster and self.metric_holds

    @property
    def reason(self) -> str:
        """Why, in two words: "metric held" (bf16 runs), "slower" or "metric worse" (fp32 runs)."""
        return "metric held" if self.runs_bf16 else "slower" if not self.faster else "metric worse"

    def describe(self) -> str:
        """One clause: the measured figures and what they decide, for the banner."""
        figures = (f"{self.recipe} at its default model on this CPU kind, {self.seeds} seeds: bf16 {self.ratio:.2f}x "
                   f"fp32's samples/s, {self.metric} {self.bf16_mean:.4g} against {self.fp32_mean:.4g} "
                   f"(fp32's spread {self.fp32_stdev:.2g}; docs/bf16-recipes.md)")
        if self.runs_bf16:
            return f"bf16 chosen, measured for {figures}; --mixed_precision no for fp32"
        why = "slower" if not self.faster else f"its {self.metric} worse by more than the seeds' spread"
        return f"bf16 not chosen, {why}: measured for {figures}"


def verdict(recipe: str, kind: str | None = None, records: list[dict] | None = None) -> Verdict | None:
    """The ``Verdict`` for ``recipe`` on CPU kind ``kind`` (this machine's by default) from ``records`` (default
    ``load_records()``), counting the runs at the recipe's defaults only (no extra flags); None where fewer than
    ``MIN_SEEDS`` seeds ran in both precisions with a metric."""
    kind = cpu_kind() if kind is None else kind
    records = load_records() if records is None else records
    row = summarize([r for r in records if not r.get("extra_args") and r["cpu_kind"] == kind]).get(kind, {}).get(recipe)
    if row is None or len(row["seeds_both"]) < MIN_SEEDS:
        return None
    fp32, bf16 = row["fp32"], row["bf16"]
    if len(fp32["metric_values"]) < MIN_SEEDS or len(bf16["metric_values"]) < MIN_SEEDS:
        return None
    return Verdict(recipe=recipe, cpu_kind=kind, seeds=len(row["seeds_both"]), ratio=row["ratio_bf16_fp32"],
                   metric=row["metric"], fp32_mean=fp32["metric_mean"], bf16_mean=bf16["metric_mean"],
                   fp32_stdev=fp32["metric_stdev"] or 0.0)


def choose(config, recipe, device_type: str, records: list[dict] | None = None):
    """``config`` as it will run on a ``device_type`` device: where fp16 is requested on a CPU for a registered
    recipe at its default model and a ``Verdict`` exists, a copy (validated) that records it in
    ``precision_choice`` and, where ``Verdict.runs_bf16``, trains in bf16 (``mixed_precision="bf16"``,
    ``mixed_precision_requested="fp16"``); else ``config`` itself. Raises ``FinetuneError`` as
    ``TrainConfig.validate``."""
    if device_type != "cpu" or config.mixed_precision != "fp16" or config.precision_choice is not None:
        return config
    if config.model_name_or_path != getattr(recipe, "DEFAULTS", {}).get("model_name_or_path"):
        return config  # measured at the recipe's default model only
    found = verdict(getattr(recipe, "NAME", config.recipe), records=records)
    if found is None:
        return config
    changes = {"precision_choice": found.describe()}
    if found.runs_bf16:
        changes.update(mixed_precision="bf16", mixed_precision_requested="fp16")
    chosen = dataclasses.replace(config, **changes)
    chosen.validate()
    return chosen


def summary(kind: str | None = None, records: list[dict] | None = None) -> str:
    """One line for ``finetune env``: what an fp16 request trains in on CPU kind ``kind`` (this machine's by
    default), per recipe with a ``Verdict`` (e.g. "bbc-news fp32 (bf16 0.31x, slower)"), or that none is measured."""
    kind = cpu_kind() if kind is None else kind
    records = load_records() if records is None else records
    recipes = sorted({r["recipe"] for r in records if r["cpu_kind"] == kind and not r.get("extra_args")})
    verdicts = [v for v in (verdict(recipe, kind, records) for recipe in recipes) if v is not None]
    if not verdicts:
        return ("no recipe measured on this CPU kind (bench/bench_bf16_recipes.py): an fp16 request runs fp32 "
                "(docs/precision.md)")
    parts = [f"{v.recipe} {'bf16' if v.runs_bf16 else 'fp32'} (bf16 {v.ratio:.2f}x, {v.reason})" for v in verdicts]
    return f"{'; '.join(parts)}; other recipes fp32, not measured here (docs/precision.md)"


def agreed(requested, chosen, max_over_processes):
    """``chosen`` (``choose``'s result for ``requested``) where every process chose alike, else ``requested``: bf16
    only where every process's CPU kind chose it (machines of different kinds can disagree), so that every process
    trains in one precision; the banner then says why bf16 was not taken. ``max_over_processes``:
    ``distributed.all_reduce_max`` of the run's state (one call: collective, every process calls it once)."""
    keeps_fp32 = max_over_processes(0.0 if chosen.mixed_precision_requested is not None else 1.0)
    if chosen.mixed_precision_requested is None or keeps_fp32 == 0.0:
        return chosen
    kept = dataclasses.replace(requested, precision_choice=f"{chosen.precision_choice}; not taken: the CPU of another "
                                                           "process keeps fp32, and every process trains in one precision")
    kept.validate()
    return kept
