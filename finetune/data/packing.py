"""Padding-free micro-batches and window-local packing for causal LM and SFT (issue 27; docs/packing.md).

A **padding-free** micro-batch is one row: its samples' tokens concatenated, ``position_ids`` restarting at 0 at
every sample, no padding and no 2-D ``attention_mask``, and the first label of every sample ``IGNORE_INDEX``
so that no sample is trained to continue the one before it. transformers recognises such a row from the
``position_ids`` alone and builds a block-diagonal causal mask for SDPA and eager attention
(transformers 5.24 ``masking_utils.py`` lines 862-870: only when ``attention_mask is None`` and there is no
cache; ``find_packed_sequence_indices``, lines 735-764, starts a new sequence wherever consecutive positions do
not differ by 1); ``DataCollatorWithFlattening`` (``data/data_collator.py`` lines 1348-1354) and TRL's
``DataCollatorForLanguageModeling(padding_free=True)`` build the same row.

**Window-local packing** (``--packing``, ``--packing_strategy window_bfd``) takes the samples of one accumulation window, the same ones the
seeded order gives the padded run, and packs them best-fit-decreasing (TRL ``trl/data_utils.py``
``_pack_bfd``) into padding-free micro-batches of at most ``--max_tokens_per_micro_batch`` tokens each: it changes
how a step is split, never which samples form it or how many label tokens (items) it has, because the
causal-LM loss shifts labels inside each row (``tasks.CausalLM.count``: ``labels[:, 1:]``) and the first label
of every sample, which the shift would otherwise pair with the previous sample's last position, is masked.

``separation_error`` runs the per-sequence check on the user's own model: a model or attention implementation
that cannot keep packed sequences apart is refused by what it computes, not by its name.
"""

from __future__ import annotations

import contextlib

import torch

from finetune.data import packing_cost
from finetune.data.loading import IGNORE_INDEX
from finetune.errors import FinetuneError

STRATEGIES = ("window_bfd",)  # --packing_strategy values


# ------------------------------------------------------------------------------------------ samples and rows
def unpad(batch: dict) -> list[dict]:
    """The samples of a right-padded micro-batch (``tasks.CausalLMCollator``, ``sft.SFTCollator``): one dict per row
    with 1-D ``input_ids`` and ``labels`` of the row's real length (``attention_mask.sum()`` tokens). Rows whose
    labels are all ``IGNORE_INDEX`` (an epoch's repeated rows: ``window.mask_repeats``) are kept: every row is
    a forward pass in the padded run too."""
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    return [{"input_ids": batch["input_ids"][i, :n], "labels": batch["labels"][i, :n]}
            for i, n in enumerate(lengths)]


def flatten(samples: list[dict]) -> dict:
    """One padding-free row of ``samples`` (dicts of 1-D ``input_ids`` and ``labels``, n_i tokens each): tensors of
    shape (1, sum n_i): ``input_ids``, ``position_ids`` (0..n_i-1 per sample) and ``labels`` (the first of each
    sample ``IGNORE_INDEX``, as ``DataCollatorWithFlattening``'s ``separator_id``), and ``use_cache=False``. No
    ``attention_mask``, and no cache: with either, transformers would not separate the samples (module docstring;
    a model builds a ``DynamicCache`` whenever ``use_cache`` is on, in training too). Raises ``ValueError`` for no samples or an
    empty sample."""
    if not samples or any(len(s["input_ids"]) == 0 for s in samples):
        raise ValueError("flatten needs at least one sample, none of them empty")
    labels = [s["labels"].clone() for s in samples]
    for row in labels:
        row[0] = IGNORE_INDEX
    return {"input_ids": torch.cat([s["input_ids"] for s in samples]).unsqueeze(0),
            "position_ids": torch.cat([torch.arange(len(s["input_ids"]), device=s["input_ids"].device)
                                       for s in samples]).unsqueeze(0),
            "labels": torch.cat(labels).unsqueeze(0), "use_cache": False}


def best_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Bins of sample indices, each bin's summed ``lengths`` (tokens) at most ``budget`` (tokens), by best fit
    decreasing: longest first (ties in index order), each into the open bin it fills most tightly, else a new bin
    (TRL ``trl/data_utils.py`` ``_pack_bfd``, which uses a segment tree for the same choice). A sample longer
    than ``budget`` gets a bin of its own. Deterministic: bins in order of creation, indices sorted in each."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins, room = [], []
    for i in order:
        fits = [b for b in range(len(bins)) if room[b] >= lengths[i]]
        if fits:
            best = min(fits, key=lambda b: (room[b], b))
            bins[best].append(i)
            room[best] -= lengths[i]
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return [sorted(b) for b in bins]


def balanced_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of sample indices for packed rows: as few as ``best_fit_decreasing`` makes under ``capacity`` tokens,
    each then as short as it can be: bisection for the least capacity (tokens) at which best fit decreasing still
    needs no more bins. Rows are right-padded to the longest in their micro-batch, so rows of nearly equal
    length pad least (docs/packing.md). ``lengths``: tokens per sample; ``capacity``: tokens per row."""
    bins = best_fit_decreasing(lengths, capacity)
    low, high = max(max(lengths, default=0), -(-sum(lengths) // max(len(bins), 1))), capacity
    while low < high:
        middle = (low + high) // 2
        trial = best_fit_decreasing(lengths, middle)
        if len(trial) <= len(bins):
            bins, high = trial, middle
        else:
            low = middle + 1
    return bins


class Rows(dict):
    """A packed micro-batch (``pack_rows``): the model's inputs and ``labels``, plus ``padding``, the positions
    that hold no token (an attribute, so it never reaches the model's forward)."""

    padding = 0


def pack_rows(rows: list[list[dict]], pad_token_id: int, device=None) -> Rows:
    """One micro-batch of ``rows`` (each a list of samples: dicts of 1-D ``input_ids`` and ``labels``): each row
    ``flatten``-ed, then right-padded to the longest, shape (len(rows), longest row's tokens). A row's padding
    continues its last sample's ``position_ids`` (so it starts no sequence: no token before it can see it, causal
    attention) with ``pad_token_id`` inputs and ``IGNORE_INDEX`` labels, as right padding is in a padded
    micro-batch. No ``attention_mask`` (transformers separates each row's samples from its ``position_ids``, row
    by row: ``find_packed_sequence_indices``). ``rows == []`` gives an empty micro-batch: one padding position,
    no item, on ``device`` (``Packer(exact=True)`` runs it where a window has fewer rows than micro-batches)."""
    if not rows:
        batch = Rows(input_ids=torch.full((1, 1), pad_token_id, device=device),
                     position_ids=torch.zeros((1, 1), dtype=torch.long, device=device),
                     labels=torch.full((1, 1), IGNORE_INDEX, device=device), use_cache=False)
        batch.padding = 1
        return batch
    flat = [flatten(row) for row in rows]
    width = max(f["input_ids"].shape[1] for f in flat)
    parts, padding = {"input_ids": [], "position_ids": [], "labels": []}, 0
    for f in flat:
        extra = width - f["input_ids"].shape[1]
        padding += extra
        ids, positions, labels = f["input_ids"][0], f["position_ids"][0], f["labels"][0]
        parts["input_ids"].append(torch.cat([ids, ids.new_full((extra,), pad_token_id)]))
        parts["position_ids"].append(torch.cat([positions, positions[-1] + 1 + torch.arange(
            extra, dtype=positions.dtype, device=positions.device)]))
        parts["labels"].append(torch.cat([labels, labels.new_full((extra,), IGNORE_INDEX)]))
    batch = Rows({key: torch.stack(value) for key, value in parts.items()}, use_cache=False)
    batch.padding = padding
    return batch


def group_rows(lengths: list[int], budget: int, count: int | None = None) -> list[list[int]]:
    """Row indices grouped into micro-batches, longest rows first (so rows padded together have similar lengths).
    ``count`` None: as few micro-batches as fit ``budget`` positions each (a micro-batch's rows x its longest
    row's tokens; a row alone may exceed it). ``count`` N: exactly N micro-batches, the rows shared out evenly
    (sizes differ by at most one; an empty group where there are fewer rows than N)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if count is not None:
        size, extra = divmod(len(order), count)
        bounds = [0]
        for k in range(count):
            bounds.append(bounds[-1] + size + (k < extra))
        return [order[a:b] for a, b in zip(bounds, bounds[1:])]
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def choose_layout(cost, micro_batch_tokens: list[int], padded_shapes: list[tuple[int, int]], lengths: list[int],
                  groups: list[list[int]]) -> tuple[str, dict[str, int]]:
    """(the layout of ``LAYOUT_NAMES`` that ``cost``, a ``packing_cost.LayoutCost``, predicts fastest for a window,
    each layout's positions). ``micro_batch_tokens``: the tokens of the window's padded micro-batches;
    ``padded_shapes``: their (rows, width) shapes; ``lengths``: the packed rows' tokens; ``groups``: those rows per
    micro-batch (``group_rows``). The packed rows are not taken with more positions than the padded window; ties go
    to the fewer positions, then to the order of ``LAYOUT_NAMES``."""
    padded_positions = sum(rows * width for rows, width in padded_shapes)
    positions = {"rows": sum(len(g) * max((lengths[i] for i in g), default=1) for g in groups),
                 "one_row": sum(micro_batch_tokens), "padding_free": sum(micro_batch_tokens),
                 "padded": padded_positions}
    seconds = {"rows": sum(cost.seconds([lengths[i] for i in g]) for g in groups),
               "one_row": sum(cost.seconds([sum(lengths[i] for i in g)] if g else []) for g in groups),
               "padding_free": sum(cost.seconds([n]) for n in micro_batch_tokens),
               "padded": sum(cost.seconds([width] * rows) for rows, width in padded_shapes)}
    allowed = [name for name in LAYOUT_NAMES if name != "rows" or positions["rows"] <= padded_positions]
    return min(allowed, key=lambda name: (seconds[name], positions[name], LAYOUT_NAMES.index(name))), positions


# the layouts a packed window can run in (``Packer.choose``): the packed rows, padded per micro-batch; the same
# micro-batches each as one row; the window's own micro-batches each as one row (``--padding_free``); the window's
# padded micro-batches as they are
LAYOUT_NAMES = ("rows", "one_row", "padding_free", "padded")


class Packer:
    """Turns an accumulation window (this process's list of padded micro-batches) into the micro-batches it runs.

    - ``strategy`` None (``--padding_free``): each micro-batch flattened into one row (``flatten``), the same split.
    - ``"window_bfd"`` (``--packing``): the window's samples packed best-fit-decreasing (``balanced_rows``)
      into rows of at most ``row_length`` tokens (``--max_length``: attention per token never exceeds the padded
      run's), the rows then grouped into micro-batches of at most ``budget`` positions (``group_rows``; each
      ``pack_rows``). ``exact``: exactly as many micro-batches as the window has (Trainer counts its micro-batches
      to find the optimizer step); otherwise as few as fit, a count that may differ between processes.

    ``one_row``: each micro-batch's rows concatenated into one row instead (``flatten``; the same grouping), for an
    attention implementation that separates packed sequences only in a batch of one row (``flash_attention_2``:
    ``packer_for`` picks it from the per-sequence check).

    ``cost`` (a measured ``packing_cost.LayoutCost``): per window, the layout it predicts fastest of four, all
    the window's samples: the packed rows (above); the packed rows grouped the same way, each micro-batch's as one
    row; the window's own micro-batches each flattened into one row (``--padding_free``'s layout: no more
    positions than the padding-free run); or the window's padded micro-batches as they are. The packed rows are
    never taken with more positions than the padded window. ``layouts`` counts the windows run in each
    (``LAYOUT_NAMES``).

    Returns a list of padding-free batches (``flatten`` rows or ``Rows``)."""

    def __init__(self, strategy: str | None, budget: int | None = None, row_length: int | None = None,
                 pad_token_id: int = 0, exact: bool = False, one_row: bool = False, cost=None):
        self.strategy, self.budget, self.pad_token_id, self.exact = strategy, budget, pad_token_id, exact
        self.row_length = min(row_length, budget) if row_length and budget else (row_length or budget)
        self.one_row = one_row or strategy is None
        self.cost = cost if strategy and not one_row else None
        self.layouts = dict.fromkeys(LAYOUT_NAMES, 0)
        # what the banner adds (the flags' own line is reporting.packing_banner): said when the layout is not the asked one
        self.note = ("Packing: each micro-batch's rows run as one row: this attention implementation keeps packed "
                     "sequences apart only in a one-row batch (per-sequence check)") if one_row and strategy else None

    def __call__(self, window: list[dict]) -> list[dict]:
        if self.strategy is None:
            return [flatten(unpad(batch)) for batch in window]
        samples = [s for batch in window for s in unpad(batch)]
        rows = [[samples[i] for i in b]
                for b in balanced_rows([len(s["input_ids"]) for s in samples], self.row_length)]
        lengths = [sum(len(s["input_ids"]) for s in row) for row in rows]
        groups = group_rows(lengths, self.budget, len(window) if self.exact else None)
        layout = "one_row" if self.one_row else self.choose(window, lengths, groups)
        self.layouts[layout] += 1
        device = window[0]["input_ids"].device  # an empty micro-batch has no sample to take it from
        if layout == "padding_free":
            return [flatten(unpad(batch)) for batch in window]
        if layout == "padded":
            return window
        if layout == "one_row":
            return [flatten([s for i in group for s in rows[i]]) if group else pack_rows([], self.pad_token_id, device)
                    for group in groups]
        return [pack_rows([rows[i] for i in group], self.pad_token_id, device) for group in groups]

    def choose(self, window: list[dict], lengths: list[int], groups: list[list[int]]) -> str:
        """``choose_layout`` for this window (``lengths``: its packed rows' tokens, ``groups``: those rows per
        micro-batch): "rows" without a cost."""
        if self.cost is None:
            return "rows"
        return choose_layout(self.cost, [int(batch["attention_mask"].sum()) for batch in window],
                             [tuple(batch["input_ids"].shape) for batch in window], lengths, groups)[0]

    def keep(self, output_dir) -> None:
        """Write the measured cost (if any) to ``output_dir/packing_cost.json``, for a resume to choose alike. Called
        by the main process once the output directory is prepared (``--overwrite_output_dir`` clears it)."""
        if self.cost is not None:
            packing_cost.save(output_dir, self.cost)

    @property
    def eval_row_length(self) -> int | None:
        """The row length ``eval_outputs`` packs evaluation batches into: None (one row) under ``one_row``."""
        return None if self.one_row else self.row_length


def eval_outputs(forward, batch: dict, labels: torch.Tensor, task, row_length: int | None = None) -> tuple[torch.Tensor, ...]:
    """``task.eval_from_logits`` (a packing task's per-sample outputs from logits) for a padded evaluation batch
    (``labels`` popped) computed padding-free: its samples in
    one row (``row_length`` None), or packed best-fit-decreasing into rows of at most ``row_length`` tokens, one
    micro-batch (``pack_rows``). Each sample's logits are cut back out and scored as a batch of one; the
    per-sample tensors are concatenated in the batch's row order, as the padded path gives them. ``forward``: the
    model's forward; no gradients."""
    samples = unpad({**batch, "labels": labels})
    if row_length is None:
        rows = [list(range(len(samples)))]
        packed = flatten(samples)
    else:
        rows = balanced_rows([len(s["input_ids"]) for s in samples], row_length)
        packed = pack_rows([[samples[i] for i in row] for row in rows], pad_token_id=0)
    with torch.no_grad():
        logits = forward(**{key: value for key, value in packed.items() if key != "labels"}).logits
    parts = {}
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            n = len(samples[i]["input_ids"])
            parts[i] = task.eval_from_logits(logits[r, start:start + n].unsqueeze(0),
                                             samples[i]["labels"].unsqueeze(0))
            start += n
    return tuple(torch.cat(columns) for columns in zip(*(parts[i] for i in range(len(samples))), strict=True))


def packing_summary(lengths_per_step: list[list[int]], micro_batch: int, budget: int | None,
                    strategy: str | None, row_length: int | None = None, exact: bool = False, cost=None) -> dict:
    """What packing does to a run's steps, for ``check-data`` and the banner, computed as ``Packer`` packs.
    ``lengths_per_step``: per optimizer step (of one process), the token lengths of its samples in order;
    ``micro_batch``: samples per padded micro-batch; ``budget``, ``row_length``, ``exact`` and ``cost`` as
    ``Packer``'s. Returns micro-batches per step (mean, max), input tokens per micro-batch (mean, max), the padding
    fraction (computed positions that hold no token) before (padded micro-batches) and after, the positions each
    layout would compute (``positions``: padded, rows, padding_free) and the steps run in each layout
    (``layouts``)."""
    padded = real = after = 0
    after_batches, after_tokens = [], []
    layouts = dict.fromkeys(LAYOUT_NAMES, 0)
    totals = {"rows": 0, "padding_free": 0}
    for lengths in lengths_per_step:
        chunks = [lengths[i:i + micro_batch] for i in range(0, len(lengths), micro_batch)]
        step_padded = sum(max(c) * len(c) for c in chunks)
        padded += step_padded
        real += sum(lengths)
        if strategy is None:
            sizes, positions = [sum(c) for c in chunks], sum(lengths)
        else:
            rows = [sum(lengths[i] for i in b) for b in balanced_rows(lengths, min(row_length or budget, budget))]
            groups = group_rows(rows, budget, len(chunks) if exact else None)
            layout, each = (choose_layout(cost, [sum(c) for c in chunks], [(len(c), max(c)) for c in chunks], rows,
                                          groups) if cost is not None else
                            ("rows", {"rows": sum(len(g) * max((rows[i] for i in g), default=1) for g in groups)}))
            layouts[layout] += 1
            totals["rows"] += each["rows"]
            if layout == "padding_free":
                sizes, positions = [sum(c) for c in chunks], sum(lengths)
            elif layout == "padded":
                sizes, positions = [sum(c) for c in chunks], step_padded
            elif layout == "one_row":
                sizes = [sum(rows[i] for i in g) for g in groups]
                positions = sum(lengths)
            else:
                sizes = [sum(rows[i] for i in g) for g in groups]
                positions = each["rows"]
        totals["padding_free"] += sum(lengths)
        after_batches.append(len(sizes))
        after_tokens.extend(sizes)
        after += positions
    steps = max(len(lengths_per_step), 1)
    return {"micro_batches_per_step": sum(after_batches) / steps, "max_micro_batches_per_step": max(after_batches, default=0),
            "tokens_per_micro_batch": sum(after_tokens) / max(len(after_tokens), 1),
            "max_tokens_per_micro_batch": max(after_tokens, default=0),
            "padding_fraction_before": 1 - real / padded if padded else 0.0,
            "padding_fraction_after": 1 - real / after if after else 0.0,
            "positions": {"padded": padded, **totals}, "layouts": layouts}


# ------------------------------------------------------------------------------------------ the per-sequence check
LAYOUTS = ("one_row", "rows")  # the packed layouts: one padding-free row; a micro-batch of right-padded rows


def layout_differences(model, samples: list[torch.Tensor], row_transform=None) -> dict[str, float]:
    """Per layout packing uses, the largest difference between each sample's logits computed alone and at its
    positions packed, relative to the largest absolute logit (0 when the model keeps the samples apart exactly):
    ``"one_row"``, all ``samples`` in one padding-free row (``flatten``); ``"rows"``, a micro-batch of two padded
    rows, the last sample alone in the second (``pack_rows``). ``samples``: at least two 1-D token-id tensors;
    ``model``: a transformers causal LM (its mode is restored; no gradients). ``row_transform(inputs) -> inputs``:
    a change to the packed inputs before the forward (the tests' negative controls: positions not reset, a 2-D
    mask)."""
    device = next(model.parameters()).device
    as_samples = [{"input_ids": s.to(device), "labels": s.to(device)} for s in samples]
    layouts = {"one_row": [as_samples], "rows": [as_samples[:-1], as_samples[-1:]]}  # rows of samples
    was_training = model.training
    model.eval()
    differences = {}
    try:
        with torch.no_grad():
            alone = [model(input_ids=s.unsqueeze(0).to(device), use_cache=False).logits[0].float() for s in samples]
            for layout, rows in layouts.items():
                worst = 0.0
                batch = flatten(rows[0]) if len(rows) == 1 else pack_rows(rows, pad_token_id=0)
                inputs = {key: value for key, value in batch.items() if key != "labels"}
                if row_transform is not None:
                    inputs = row_transform(inputs)
                packed = model(**inputs).logits.float()
                found = iter(alone)
                for r, row in enumerate(rows):
                    start = 0
                    for _ in row:
                        a = next(found)
                        worst = max(worst, float((packed[r, start:start + len(a)] - a).abs().max()))
                        start += len(a)
                differences[layout] = worst
    finally:
        model.train(was_training)
    scale = max(float(a.abs().max()) for a in alone) or 1.0
    return {layout: worst / scale for layout, worst in differences.items()}


def per_sequence_difference(model, samples: list[torch.Tensor], row_transform=None) -> float:
    """The largest of ``layout_differences`` (same arguments): how far the model is from keeping packed samples
    apart in every layout packing uses."""
    return max(layout_differences(model, samples, row_transform).values())


def check_samples(vocab_size: int, lengths=(7, 5, 9), seed: int = 0) -> list[torch.Tensor]:
    """Random token ids for ``separation_error``: one 1-D tensor per length (tokens), ids in [1, vocab_size)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, max(vocab_size, 2), (n,), generator=generator) for n in lengths]


def _tolerance(model, tolerance: float | None) -> float:
    """The check's tolerance, relative to the largest logit: ``tolerance``, else 1e-4 for fp32 weights, 2e-2 for
    16-bit ones."""
    if tolerance is not None:
        return tolerance
    return 1e-4 if next(model.parameters()).dtype == torch.float32 else 2e-2


def separated_layouts(model, tolerance: float | None = None) -> tuple[tuple[str, ...], dict[str, float], str | None]:
    """The per-sequence check (``layout_differences`` on three short random samples) on the user's model as it
    will train: (the ``LAYOUTS`` whose packed samples match their unpacked logits within ``tolerance``, relative
    to the largest logit: 1e-4 for fp32 weights, 2e-2 for 16-bit ones; the differences per layout; the exception's
    ``"Type: message"`` if the model's forward rejects a packed row, else None)."""
    tolerance = _tolerance(model, tolerance)
    config = getattr(model, "config", None)
    try:
        differences = layout_differences(model, check_samples(int(getattr(config, "vocab_size", 2))))
    except Exception as err:  # a model whose forward rejects position_ids or a packed row
        return (), {}, f"{type(err).__name__}: {err}"
    return tuple(k for k in LAYOUTS if differences[k] <= tolerance), differences, None


def separation_error(model, flag: str, tolerance: float | None = None, layouts=LAYOUTS, check=None) -> str | None:
    """None if the model keeps packed samples apart in every one of ``layouts`` (``separated_layouts``; ``check``:
    its result, if already computed with this ``tolerance``), else the one-line reason ``FinetuneError`` gives,
    naming ``flag`` and the attention implementation."""
    tolerance = _tolerance(model, tolerance)
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None) or "default"
    passed, differences, failure = check or separated_layouts(model, tolerance)
    if failure:
        return (f"{flag}: {type(model).__name__} cannot run a padding-free row ({failure}). "
                "Train without packing.")
    if not set(layouts) <= set(passed):
        difference = max(differences[k] for k in layouts)
        return (f"{flag}: {type(model).__name__} with attn_implementation={attention!r} does not keep packed "
                f"sequences apart (packed vs alone logits differ by {difference:.2e} of the largest logit, more than "
                f"{tolerance:.0e}). Use --attn_implementation sdpa or eager, or train without packing.")
    return None


def row_length(config) -> int:
    """Tokens per packed row: ``max_length`` (or ``block_size``), the longest padded row. SDPA and eager attention
    (every CPU run) compute a row's scores over the whole row, its length squared per head, the block-diagonal
    mask only zeroing them, so rows no longer than the padded run's never cost more attention per token."""
    return max(config.max_length, config.block_size or 0)


def budget(config) -> int:
    """Positions per packed micro-batch per process (rows x the longest row's tokens): ``--max_tokens_per_micro_batch``,
    else micro-batch m x ``row_length``, the most positions a padded micro-batch can have, so the memory that
    ``finetune plan`` probes for m samples of ``max_length`` tokens bounds it. Fewer, larger micro-batches matter
    on a CPU: each backward writes every weight's gradient and adds it to the last (docs/packing.md)."""
    return config.max_tokens_per_micro_batch or config.per_device_train_batch_size * row_length(config)


def flag_of(config) -> str:
    """How the run's packing flags read on a command line (for messages)."""
    return f"--packing --packing_strategy {config.packing_strategy}" if config.packing else "--padding_free"


def layout_cost(config, model, loss_sum, precision: str = "no"):
    """The ``packing_cost.LayoutCost`` a ``--packing`` run chooses its layouts by: for a resumed run
    (``--resume_from_checkpoint``), the one the run kept in ``config.output_dir`` (``Packer.keep``) for this model,
    row length, budget and precision, when every process finds it there; else measured now
    (``packing_cost.measure``, on every process, its probes in lockstep). Each coefficient is the largest over the
    processes, so all choose alike. Collective: every process must call it."""
    from finetune import distributed

    key = packing_cost.cost_key(model, row_length(config), budget(config), precision)
    reduce = distributed.all_reduce_max(distributed.distributed_state())
    cost = packing_cost.load(config.output_dir, key) if getattr(config, "resume_from_checkpoint", None) else None
    if reduce(0.0 if cost is not None else 1.0) > 0:  # a process has none: every process measures
        cost = packing_cost.measure(model, loss_sum, row_length(config), budget(config), precision)
    return packing_cost.LayoutCost(*(reduce(value) for value in (cost.per_micro_batch, cost.per_position,
                                                                 cost.per_score)), probes=cost.probes, key=key)


def packer_for(config, task, model, engine=None, exact: bool = False, precision: str = "no",
               loss_sum=None) -> Packer | None:
    """The ``Packer`` ``--padding_free`` / ``--packing`` ask for (None when neither), after the per-sequence check on
    ``model`` (the unwrapped model, before training). ``engine``: the run's engine (``finetune.engine``, an instance
    or its class; None: plain). ``exact``: a packed window keeps its number of micro-batches: asked by the Trainer
    backend (it counts micro-batches to find the optimizer step), and always under an engine whose processes run
    windows in lockstep (``lockstep_windows``: FSDP gathers and reduce-scatters on every micro-batch, so every
    process must run as many; DeepSpeed counts its own micro-batches). ``precision``: the mixed precision that really runs ("no", "fp16", "bf16"): the check runs
    under that autocast, within that precision's tolerance (``separated_layouts``). Raises ``FinetuneError`` (one line, before anything is written) for a task other than causal
    LM/SFT, ``--max_tokens_per_micro_batch`` under such an engine (unused there), or a model that fails the
    check in the layout it would run (``--padding_free``: one row; ``--packing``: several rows per micro-batch, or
    one row, ``Packer(one_row=True)``, where only that layout keeps the samples apart). ``loss_sum(model, batch)``:
    the run's micro-batch loss; given, ``--packing`` chooses each window's layout by the cost measured with it
    (``layout_cost``; collective), else it runs the packed rows."""
    if not (config.padding_free or config.packing):
        return None
    flag = flag_of(config)
    if not task.packs:
        raise FinetuneError(f"{flag} is for causal LM and SFT recipes; a {task.name} recipe keeps padded "
                            f"micro-batches ({task.no_packing_reason}). Drop the flag.")
    sharded = engine is not None and engine.lockstep_windows
    if sharded and config.max_tokens_per_micro_batch is not None:
        raise FinetuneError(f"--max_tokens_per_micro_batch is not used under {engine.name}: a packed window "
                            "keeps its N micro-batches there (every process must run as many), of at most m rows of "
                            "--max_length tokens. Drop the flag.")
    exact = exact or sharded
    half = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    device_type = next(model.parameters()).device.type
    tolerance = _tolerance(model, 2e-2 if half else None)
    with torch.autocast(device_type, dtype=half) if half else contextlib.nullcontext():  # as the run computes
        check = separated_layouts(model, tolerance)
    # --padding_free runs one row per micro-batch. --packing runs several rows per micro-batch where the attention
    # keeps them apart, else each micro-batch's rows as one row (flash_attention_2 finds packed sequences only in a
    # one-row batch: transformers 5.24 modeling_flash_attention_utils.py line 574, _is_packed_sequence).
    one_row = not config.packing or ("rows" not in check[0] and "one_row" in check[0])
    error = separation_error(model, flag, tolerance, layouts=("one_row",) if one_row else LAYOUTS, check=check)
    if error:
        raise FinetuneError(error)
    if not config.packing:
        return Packer(None)
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    cost = layout_cost(config, model, loss_sum, precision) if loss_sum is not None and not one_row else None
    packer = Packer(config.packing_strategy, budget(config), row_length(config),
                    pad_token_id=pad if isinstance(pad, int) else 0, exact=exact, one_row=one_row, cost=cost)
    if cost is not None:
        packer.note = ("Packing: per window, the layout the measured cost predicts fastest (packed rows, their "
                       "micro-batches as one row each, or the window's micro-batches as one row each); measured: "
                       f"{cost.describe()}")
    return packer
