"""``finetune check-data``: the data as training will see it, before paying for a run.

    finetune check-data --recipe NAME [data flags] [--samples K] [--accept_problems]

Without loading the model's weights: the splits are loaded and tokenized as training does them
(``builders.raw_datasets``, the task's tokenizer), then printed: a few samples with the trained tokens marked
(colour on a terminal, ``[[...]]`` otherwise; both sides of a preference pair), token lengths (percentiles), the
share truncated and how much was cut, the padding at the run's micro-batch and sampling strategy, the label or
trained-token distribution (per side for pairs), and problems: rows repeated within a split and between training
and validation (exactly, and after whitespace/case normalisation), completions whose end-of-turn token (the ids
generation stops on) is not trained, samples with nothing trained, and the task's own findings with example rows
by file and line (``Task.data_findings``: SFT's empty completions; for preference pairs an implicit prompt that is
not a common prefix, an empty completion, a completion that does not fit, chosen equal to rejected, the prompt
repeated in a response, prompts cut). Exit 1 for a problem that makes the run
wrong (leakage between the splits, samples with nothing trained, an untrained end-of-turn token, a fatal finding)
unless ``--accept_problems``; 0 when clean or only warned; 2 for bad input.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

import torch
import transformers
from transformers import GenerationConfig

from finetune.argv import take_switch, take_values, wants_help
from finetune.config import parse_config
from finetune.data import packing_cost
from finetune.data.chat import require_chat_template
from finetune.data.loading import ROW_COLUMN
from finetune.data.mixture import row_source, source_name
from finetune.data.packing import budget as packing_budget
from finetune.data.packing import flag_of, packing_summary, row_length
from finetune.errors import FinetuneError
from finetune.lifecycle.window import EpochSeededLengthGroupedSampler
from finetune.models.loading import load_tokenizer
from finetune.recipes import load_recipe
from finetune.tasks import task_of
from finetune.tasks.builders import raw_datasets

# the problems check-data finds itself that make the run wrong (a task's own findings say whether they do)
FATAL = ("between the splits", "nothing trained", "end-of-turn token not trained")


def normalise(text: str) -> str:
    """Lower case, whitespace collapsed: what "the same text" means for near-duplicates."""
    return " ".join(str(text).lower().split())


def row_text(row: dict, columns) -> str:
    """A raw row's text: its text columns joined (prompt/completion/messages for SFT)."""
    present = [c for c in ("prompt", "completion", "messages", *columns) if c in row]
    return " || ".join(json.dumps(row[c]) if not isinstance(row[c], str) else row[c] for c in dict.fromkeys(present))


def duplicates(train: list[str], validation: list[str]) -> dict:
    """Counts of rows repeating an earlier row of their split, and of validation rows also in training, each
    exactly and after ``normalise`` (first examples kept, as indices)."""
    found = {}
    for how, key in (("exact", lambda t: t), ("normalised", normalise)):
        for split, texts in (("train", train), ("validation", validation)):
            seen, repeats = set(), []
            for i, text in enumerate(texts):
                k = key(text)
                if k in seen:
                    repeats.append(i)
                seen.add(k)
            found[f"within {split} ({how})"] = repeats
        train_keys = {key(t) for t in train}
        found[f"between the splits ({how})"] = [i for i, t in enumerate(validation) if key(t) in train_keys]
    return found


def render(tokenizer, ids: list[int], trained: list[bool] | None, colour: bool) -> str:
    """The sample's text, trained spans marked: green on a terminal, else ``[[...]]``."""
    if trained is None:
        return tokenizer.decode(ids)
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or trained[i] != trained[start]:
            text = tokenizer.decode(ids[start:i])
            out.append((f"\033[32m{text}\033[0m" if colour else f"[[{text}]]") if trained[start] else text)
            start = i
    return "".join(out)


def percentiles(values: list[int]) -> str:
    """"min, p50, p90, p99, max" of ``values`` (nearest rank), or "-" for none."""
    if not values:
        return "-"
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return f"min {ordered[0]}, p50 {pick(0.5)}, p90 {pick(0.9)}, p99 {pick(0.99)}, max {ordered[-1]}"


def training_order(lengths: list[int], strategy: str, global_batch: int, seed: int) -> list[int]:
    """Sample indices in the first epoch's training order (the seeded random order, or ``group_by_length``)."""
    if strategy == "group_by_length":
        return list(iter(EpochSeededLengthGroupedSampler(global_batch, lengths, seed)))
    return torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()


def packing_line(config, lengths: list[int], global_batch: int) -> str:
    """What ``--padding_free``/``--packing`` do to the first epoch's steps on one process (``global_batch`` samples
    per step): micro-batches per step, tokens per micro-batch, the padding fraction before and after
    (``packing.packing_summary``)."""
    order = [lengths[i] for i in training_order(lengths, config.train_sampling_strategy, global_batch, config.seed)]
    budget = packing_budget(config)
    output_dir = getattr(config, "output_dir", None)
    cost = packing_cost.load(output_dir, None) if config.packing and output_dir else None
    summary = packing_summary([order[i:i + global_batch] for i in range(0, len(order), global_batch)],
                              config.per_device_train_batch_size, budget if config.packing else None,
                              config.packing_strategy if config.packing else None, row_length(config),
                              exact=config.backend == "trainer", cost=cost)
    line = (f"Packing ({flag_of(config)}" + (f", rows of at most {row_length(config)} tokens, at most {budget} "
                                             "positions per micro-batch" if config.packing else "")
            + f"): {summary['micro_batches_per_step']:.1f} micro-batches per step (max "
            f"{summary['max_micro_batches_per_step']}), {summary['tokens_per_micro_batch']:.0f} tokens per micro-batch "
            f"(max {summary['max_tokens_per_micro_batch']}); padding {summary['padding_fraction_before']:.1%} of "
            f"positions before, {summary['padding_fraction_after']:.1%} after")
    if not config.packing:
        return line
    positions = summary["positions"]
    line += (f"\nPacking layouts, positions over the epoch: padded {positions['padded']:,}, packed rows "
             f"{positions['rows']:,}, one padding-free row per micro-batch {positions['padding_free']:,}; ")
    if cost is None:
        return line + ("each step's layout is chosen at the start of training by the cost it measures on the model "
                       "(the banner says it; then check-data reads it from --output_dir)")
    layouts = ", ".join(f"{name.replace('_', ' ')} {count}" for name, count in summary["layouts"].items())
    return line + (f"steps per layout by the cost kept in {Path(output_dir) / packing_cost.FILE} "
                   f"({cost.describe()}): {layouts}")


def padding_fraction(lengths: list[int] | list[tuple[int, ...]], micro_batch: int, strategy: str, global_batch: int,
                     seed: int) -> float:
    """Padding positions / all positions when samples of ``lengths`` (tokens; a tuple per sample for a task whose
    sample is several sequences, a pair's two sides, all padded together) are batched as training orders them (the
    seeded random order, or ``group_by_length`` by each sample's longest sequence) in micro-batches padded to their
    longest sequence."""
    rows = [length if isinstance(length, tuple) else (length,) for length in lengths]
    order = training_order([max(r) for r in rows], strategy, global_batch, seed)
    real = padded = 0
    for i in range(0, len(order), micro_batch):
        batch = [rows[j] for j in order[i:i + micro_batch]]
        real += sum(sum(r) for r in batch)
        padded += sum(len(r) for r in batch) * max(max(r) for r in batch)
    return 1 - real / padded if padded else 0.0


def stop_ids(tokenizer, model_path: str) -> list[int]:
    """The ids generation stops on: the model's ``generation_config.eos_token_id``, else the tokenizer's."""
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except (OSError, ValueError):
        eos = None
    eos = eos if eos is not None else tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def example_rows(rows: list[str], limit: int = 5) -> str:
    """Up to ``limit`` of ``rows`` (row names: "--train_file 'a.jsonl' line 3 (rejected)", "train row 7"), one
    file's rows together ("--train_file 'a.jsonl' lines 3 (rejected), 9"), then how many more."""
    groups: dict[tuple[str, str], list[str]] = {}
    for row in rows[:limit]:
        match = re.fullmatch(r"(?:(.*) )?(line|record|row) (\d+(?: \(.*\))?)", row)
        head, unit, rest = match.groups(default="") if match else (row, "", "")
        groups.setdefault((head, unit), []).append(rest)
    shown = "; ".join(" ".join(filter(None, (head, unit + "s" * (len(items) > 1), ", ".join(filter(None, items)))))
                      for (head, unit), items in groups.items())
    return shown + (f" (and {len(rows) - limit} more)" if len(rows) > limit else "")


def by_sequence(values: dict[str, list], show) -> str:
    """``show(values)`` of a one-sequence task's samples, else "<name> <show(values)>" per sequence ("chosen ...;
    rejected ...")."""
    return "; ".join(f"{name} {show(v)}" if name else show(v) for name, v in values.items())


def mixture_lines(config, raw_train, sequences: list[dict]) -> str:
    """Per source of a dataset mixture, over the training split: rows, tokens, trained tokens and its share of the
    trained tokens (``sequences``: each sample's ``task.sequences``, one per raw row; where tokenizing made more or
    fewer samples than rows, rows alone)."""
    mixture = json.loads(config.dataset_mixture)
    rows = raw_train[ROW_COLUMN] if ROW_COLUMN in raw_train.column_names else []
    per_row = len(rows) == len(sequences)
    stats = {source_name(i, s): [0, 0, 0] for i, s in enumerate(mixture["datasets"])}
    for k, row in enumerate(rows):
        entry = stats[row_source(row)]
        entry[0] += 1
        if per_row:
            entry[1] += sum(len(ids) for ids, _ in sequences[k].values())
            entry[2] += sum(sum(mask) for _, mask in sequences[k].values())
    trained = sum(e[2] for e in stats.values()) or 1
    lines = ["Mixture (training split): " + ("rows, tokens, trained tokens, share of trained tokens" if per_row
                                             else "rows")]
    for name, (n, tokens, kept) in stats.items():
        lines.append(f"  {name}: {n:,} rows" + (f", {tokens:,} tokens, {kept:,} trained ({kept / trained:.1%})"
                                                 if per_row else ""))
    return "\n".join(lines)


def check(config, samples: int, colour: bool) -> tuple[str, list[tuple[str, int, bool]]]:  # noqa: C901 - over the budget; to split
    """The report (text) and the problems it looked for, (name, count, fatal: makes the run wrong). Raises
    ``FinetuneError`` for data that cannot be read (a malformed row: its file and line)."""
    recipe = load_recipe(config.recipe)
    task = task_of(recipe)
    tokenizer = load_tokenizer(config.model_name_or_path)
    if task.chat:
        require_chat_template(tokenizer)
    loaded = raw_datasets(recipe, config, task, check=False)
    try:  # rows training would stop on are found and set aside by the task: the rest is still worth a look
        raw, findings = task.data_findings(loaded, tokenizer, config)
        tokenized = task.tokenize(raw, tokenizer, config, recipe.TEXT_COLUMNS)
    except FinetuneError as err:
        if "end-of-turn" not in str(err):
            raise
        # the template closes no assistant turn with a special token: nothing could teach the model to stop
        report = f"check-data: {recipe.NAME}: {err}\n\nProblems:\n  FAIL  end-of-turn token not trained: {len(loaded['train'])}"
        return report, [("end-of-turn token not trained", len(loaded["train"]), True)]
    train = tokenized["train"]
    sequences = [task.sequences(row) for row in train]
    names = list(sequences[0]) if sequences else []
    lines = [f"check-data: {recipe.NAME}: {len(loaded['train'])} training and {len(loaded['validation'])} validation "
             f"rows ({len(train)} training samples after tokenizing), tokenizer {config.model_name_or_path}"]
    lines.append("\nSamples (trained tokens " + ("in green" if colour else "in [[...]]") + "):")
    for i in range(min(samples, len(train))):
        label = f"  label: {raw['train'].features['label'].names[train[i]['labels']]}" if task.class_labels and \
            hasattr(raw["train"].features.get("label"), "names") else ""
        for name, (ids, trained) in sequences[i].items():
            text = render(tokenizer, ids, trained, colour)
            lines.append(f"--- sample {i}{' ' + name if name else ''}{label}\n"
                         f"{text if len(text) <= 600 else text[:300] + ' ... ' + text[-300:]}")
    lengths = {name: [len(s[name][0]) for s in sequences] for name in names}
    limit = config.block_size or config.max_length
    lines.append(f"\nLengths (tokens): {by_sequence(lengths, percentiles) if names else percentiles([])}")
    if not task.chat and not config.block_size:
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # "longer than the maximum sequence length": what is measured
        full = [len(ids) for ids in tokenizer(*[list(raw["train"][c]) for c in recipe.TEXT_COLUMNS])["input_ids"]]
        transformers.logging.set_verbosity(verbosity)
        cut = [f - limit for f in full if f > limit]
        lines.append(f"Truncated at --max_length {limit}: {len(cut)} of {len(full)} ({len(cut) / max(len(full), 1):.1%})"
                     + (f", {sum(cut) / len(cut):.0f} tokens cut on average (up to {max(cut)})" if cut else ""))
    else:
        at_limit = lambda values: (f"{sum(v >= limit for v in values)} of {len(values)} "  # noqa: E731
                                   f"({sum(v >= limit for v in values) / max(len(values), 1):.1%})")
        lines.append(f"At the limit of {limit} tokens: {by_sequence(lengths, at_limit) if names else at_limit([])}"
                     + (" (a longer prompt is refused; completions are generated)" if task.generates
                        else " (prompts are cut to fit; completions never)" if task.chat else ""))
    global_batch = config.per_device_train_batch_size * config.gradient_accumulation_steps
    sample_lengths = [tuple(len(ids) for ids, _ in s.values()) for s in sequences]
    lines.append(f"Padding at micro-batch {config.per_device_train_batch_size} ({config.train_sampling_strategy}): "
                 f"{padding_fraction(sample_lengths, config.per_device_train_batch_size, config.train_sampling_strategy, global_batch, config.seed):.1%} of positions")
    if config.padding_free or config.packing:
        lines.append(packing_line(config, [sum(length) for length in sample_lengths], global_batch))
    if config.dataset_mixture:
        lines.append(mixture_lines(config, raw["train"], sequences))
    problems = []
    if task.class_labels:
        labels = getattr(raw["train"].features.get("label"), "names", None)
        for split in ("train", "validation"):
            counts = Counter(raw[split]["label"])
            shown = ", ".join(f"{labels[k] if labels else k} {v}" for k, v in sorted(counts.items()))
            lines.append(f"Labels ({split}): {shown}")
    elif task.generates:
        lines.append(f"Trained tokens: generated at each step (at most --max_completion_length "
                     f"{config.max_completion_length} per completion, {config.num_generations} per prompt)")
    else:
        trained = {name: [sum(s[name][1]) for s in sequences] for name in names}
        lines.append(f"Trained tokens per {'side' if names != [''] else 'sample'}: "
                     f"{by_sequence(trained, percentiles) if names else percentiles([])}")
        problems.append(("nothing trained", sum(any(sum(mask) == 0 for _, mask in s.values()) for s in sequences)))
    if task.chat and not task.generates:
        stops = stop_ids(tokenizer, config.model_name_or_path)
        untrained = sum(any(not any(t in stops for t, m in zip(ids, mask) if m) for ids, mask in s.values())
                        for s in sequences)
        problems.append(("end-of-turn token not trained", untrained))
    problems = [(name, count, any(name.startswith(f) for f in FATAL)) for name, count in problems]
    details = {}
    for finding in findings:
        problems.append((finding.name, len(finding.rows), finding.fatal))
        if finding.rows:
            details[finding.name] = [finding.note, "rows: " + example_rows(finding.rows)]
    texts = {s: [row_text(r, recipe.TEXT_COLUMNS) for r in raw[s]] for s in ("train", "validation")}
    for name, rows in duplicates(texts["train"], texts["validation"]).items():
        problems.append((name, len(rows), any(name.startswith(f) for f in FATAL)))
    lines.append("\nProblems:")
    for name, count, fatal in problems:
        lines.append(f"  {'FAIL' if count and fatal else 'warn' if count else 'ok  '}  {name}: {count}")
        lines += [f"        {detail}" for detail in details.get(name, []) if detail]
    if not any(count for _, count, _ in problems):
        lines.append("  none: the data is clean")
    return "\n".join(lines), [(n, c, f) for n, c, f in problems if c]


def main(argv: list[str] | None = None) -> int:
    """``finetune check-data``: prints the report; 1 for a problem that makes the run wrong (unless
    ``--accept_problems``), 0 when clean or only warned, 2 with one ``error:`` line for bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(__doc__)
        return 0
    accept, rest = take_switch(argv, "--accept_problems")
    values, rest = take_values(rest, "--samples", joined=False)
    samples = 3
    for value in values:
        samples = int(value) if value is not None and value.isdigit() else -1
    try:
        if samples < 0:
            raise FinetuneError("--samples must be a number of samples to show (0 or more).")
        report, found = check(parse_config(rest), samples, sys.stdout.isatty())
    except FinetuneError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    print(report)
    fatal = [(n, c) for n, c, f in found if f]
    if fatal and not accept:
        print(f"check-data: {len(fatal)} problem(s) that make the run wrong: "
              + "; ".join(f"{n} ({c})" for n, c in fatal) + ". Fix the data, or pass --accept_problems.")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
