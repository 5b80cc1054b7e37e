"""F1, the harmonic mean of precision and recall (macro-averaged by default); a local evaluate module (no hub).
As the hub's `f1`: ``compute(predictions=[...], references=[...], average="macro") -> {"f1": float}``."""

import datasets
import evaluate
from sklearn.metrics import f1_score

_DESCRIPTION = "F1 = 2 * precision * recall / (precision + recall), per class, then averaged."
_KWARGS = """
Args:
    predictions (list of int): predicted class ids, shape (n_samples,).
    references (list of int): true class ids, shape (n_samples,).
    average (str): "macro" (unweighted mean over classes, the default here), "micro", "weighted" or
        "binary" (then `pos_label` is the positive class).
    pos_label (int): positive class for average="binary".
Returns:
    f1 (float): in [0, 1].
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class F1(evaluate.Metric):
    """F1 over class ids (scikit-learn's `f1_score`)."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS,
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
            reference_urls=["https://scikit-learn.org/stable/modules/generated/sklearn.metrics.f1_score.html"],
        )

    def _compute(self, predictions, references, average="macro", pos_label=1):
        return {"f1": float(f1_score(references, predictions, average=average, pos_label=pos_label))}
