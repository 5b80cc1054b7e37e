"""Accuracy: the fraction of predictions equal to their reference label; a local evaluate module (no hub).
As the hub's `accuracy`: ``compute(predictions=[...], references=[...]) -> {"accuracy": float}``."""

import datasets
import evaluate
from sklearn.metrics import accuracy_score

_DESCRIPTION = "Accuracy = (number of correct predictions) / (number of predictions), in [0, 1]."
_KWARGS = """
Args:
    predictions (list of int): predicted class ids, shape (n_samples,).
    references (list of int): true class ids, shape (n_samples,).
    normalize (bool): if False, return the count of correct predictions instead of the fraction.
Returns:
    accuracy (float): fraction correct (or count if normalize=False).
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class Accuracy(evaluate.Metric):
    """Accuracy over class ids (scikit-learn's `accuracy_score`)."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS,
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
            reference_urls=["https://scikit-learn.org/stable/modules/generated/sklearn.metrics.accuracy_score.html"],
        )

    def _compute(self, predictions, references, normalize=True):
        return {"accuracy": float(accuracy_score(references, predictions, normalize=normalize))}
