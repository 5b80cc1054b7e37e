"""ROUGE-L and exact match of generated texts; a local evaluate module (no hub). As the hub's `rouge` and
`exact_match`: ``compute(predictions=[str], references=[str]) -> {"rougeL": float, "exact_match": float}``.
ROUGE-L (Lin, 2004) per pair by Google's `rouge_score` (its tokenizer, Porter stemming), then a plain mean where
the hub reports a bootstrap median. Exact match: equal after ``strip()`` and ``lower()``."""

import datasets
import evaluate
from rouge_score import rouge_scorer

_DESCRIPTION = ("ROUGE-L F-measure (longest common word subsequence, Porter-stemmed) and exact match (after strip "
                "and lowercase), each averaged over prediction/reference pairs, in [0, 1].")
_KWARGS = """
Args:
    predictions (list of str): generated texts, one per sample.
    references (list of str): reference texts, one per sample.
    use_stemmer (bool): Porter-stem words before matching (default True).
Returns:
    rougeL (float): mean ROUGE-L F-measure over pairs (NaN if there are none).
    exact_match (float): fraction of pairs equal after strip() and lower() (NaN if there are none).
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class Rouge(evaluate.Metric):
    """Mean ROUGE-L F-measure (`rouge_score`, stemmed) and exact match over text pairs."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="Lin, C.-Y. (2004). ROUGE: A Package for Automatic Evaluation of Summaries. ACL Workshop.",
            inputs_description=_KWARGS,
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}),
            reference_urls=["https://github.com/google-research/google-research/tree/master/rouge"],
        )

    def _compute(self, predictions, references, use_stemmer=True):
        if not predictions:
            return {"rougeL": float("nan"), "exact_match": float("nan")}
        scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=use_stemmer)
        rouge_l = [scorer.score(ref, pred)["rougeL"].fmeasure for pred, ref in zip(predictions, references)]
        exact = [pred.strip().lower() == ref.strip().lower() for pred, ref in zip(predictions, references)]
        return {"rougeL": sum(rouge_l) / len(rouge_l), "exact_match": sum(exact) / len(exact)}
