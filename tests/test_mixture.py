"""Several datasets in one run, as TRL 1.16's ``datasets:`` section: the rows its ``fraction`` rule keeps (equal to
``trl.get_dataset``'s, per source), the section read from a TRL YAML, its errors, the per-source line, and a resume
refused by name when the mixture changed."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import train_steps

from finetune.config import parse_config
from finetune.errors import FinetuneError


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def sources(tmp_path):
    a = [{"messages": [{"role": "user", "content": f"a question {i}"}, {"role": "assistant", "content": f"a {i}"}]}
         for i in range(30)]
    b = [{"conversations": [{"from": "user", "value": f"b question {i}"}, {"from": "assistant", "value": f"b {i}"}]}
         for i in range(50)]
    return _write(tmp_path / "a.jsonl", a), _write(tmp_path / "b.jsonl", b)


@pytest.mark.parametrize("fractions", [(0.3, 0.7), (1, 1), (0.9, 0.1), (None, None)])
def test_the_mixture_keeps_the_rows_trls_keeps_per_source(sources, fractions):
    trl = pytest.importorskip("trl")
    from trl.scripts.utils import DatasetConfig

    from finetune.config.data import canonical_mixture
    from finetune.data.formats import to_chatml
    from finetune.data.loading import ROW_COLUMN
    from finetune.data.mixture import load_mixture, mixture_counts

    entries = [{"path": "json", "data_files": f, **({"fraction": x} if x is not None else {})}
               for f, x in zip(sources, fractions)]
    theirs = trl.get_dataset(trl.DatasetMixtureConfig(datasets=[DatasetConfig(**e) for e in entries]))["train"]
    mixture = json.loads(canonical_mixture({"datasets": entries}))
    ours, kept = load_mixture(mixture)
    counts = mixture_counts(mixture, ours["train"][ROW_COLUMN])
    assert list(counts.values()) == [n for _, n, _ in kept]
    # the same rows in the same order; TRL leaves ShareGPT rows for its trainer to convert (to_chatml: as it does)
    theirs = [to_chatml({k: v for k, v in row.items() if v is not None}) for row in theirs]
    assert [{"messages": m} for m in ours["train"]["messages"]] == theirs
    n_a = counts[next(iter(counts))]
    assert all(r["messages"][0]["content"].startswith("a ") for r in theirs[:n_a])
    assert all(r["messages"][0]["content"].startswith("b ") for r in theirs[n_a:])


def test_a_trl_yaml_datasets_section_trains_without_a_recipe(tmp_path, sources, capsys):
    from test_your_data import _run_without_recipe
    from tiny_models import build_tiny_chat_llama

    model = str(build_tiny_chat_llama(tmp_path / "model"))
    config = tmp_path / "sft.yaml"
    config.write_text(f"model_name_or_path: {model}\nlearning_rate: 1.0e-3\nbf16: false\n"
                      f"datasets:\n  - path: json\n    data_files: {sources[0]}\n    fraction: 0.3\n"
                      f"  - path: json\n    data_files: {sources[1]}\n    fraction: 0.7\ntest_split_size: 0.1\n")
    out = tmp_path / "run"
    base = ["--config", str(config), "--output_dir", str(out), "--per_device_train_batch_size", "4", "--max_length",
            "64", "--eval_strategy", "no", "--save_steps", "1"]
    _run_without_recipe([*base, "--max_steps", "2"])
    printed = capsys.readouterr().out
    assert f"Data: a mixture of datasets[0] ({sources[0]}) 21 of 30 rows (29.6%); datasets[1] ({sources[1]}) 50 of " \
           "50 rows (70.4%)" in printed, printed[-3000:]
    assert "Recipe: sft, chosen from the column(s) messages of the dataset mixture's first source" in printed
    assert len(train_steps(out)) == 2
    # the mixture changed (another fraction) before a resume: refused by name, nothing written
    config.write_text(config.read_text().replace("fraction: 0.7", "fraction: 0.6"))
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    with pytest.raises(FinetuneError, match="dataset_mixture"):
        _run_without_recipe([*base, "--max_steps", "3", "--resume_from_checkpoint", "latest"])
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


@pytest.mark.parametrize("section, fragment", [
    ("datasets:\n  - path: json\n    weight: 2\n", r"datasets\[0\] \(json\) has unknown key\(s\) weight"),
    ("datasets:\n  - path: json\n    fraction: 0.5\n  - path: csv\n", "must be set for every source or none"),
    ("datasets:\n  - path: json\nstreaming: true\n", "streaming is not supported"),
    ("datasets:\n  - name: x\n", r"datasets\[0\] needs a `path`"),
    ("datasets:\n  - path: json\ndataset_name: d\n", "both name the training data"),
])
def test_a_bad_mixture_is_one_error(tmp_path, section, fragment):
    path = tmp_path / "c.yaml"
    path.write_text("recipe: sft\nmodel_name_or_path: m\n" + section)
    with pytest.raises(FinetuneError, match=fragment):
        parse_config(["--config", str(path)]).validate()


def test_unknown_trl_keys_are_each_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("recipe: bbc-news\nuse_liger_kernel: true\nlearnig_rate: 1\nneftune_noise_alpha: 5\n")
    with pytest.raises(FinetuneError, match=r"unknown keys 'use_liger_kernel', 'learnig_rate' \(did you mean "
                                            r"learning_rate\?\), 'neftune_noise_alpha'"):
        parse_config(["--config", str(path)])


def test_check_data_shows_each_sources_rows_tokens_and_share(tmp_path, sources, capsys):
    from tiny_models import build_tiny_chat_llama

    from finetune.commands.check_data import main

    model = str(build_tiny_chat_llama(tmp_path / "model"))
    config = tmp_path / "c.yaml"
    config.write_text(f"model_name_or_path: {model}\ndatasets:\n  - path: json\n    data_files: {sources[0]}\n"
                      f"  - path: json\n    data_files: {sources[1]}\n")
    assert main(["--config", str(config), "--samples", "0", "--max_length", "64"]) == 0
    printed = capsys.readouterr().out
    found = re.findall(r"datasets\[(\d)\] \(.*?\): (\d+) rows, ([\d,]+) tokens, ([\d,]+) trained \(([\d.]+)%\)", printed)
    assert [f[0] for f in found] == ["0", "1"], printed
    rows = [int(f[1]) for f in found]
    assert sum(rows) == 64 and 0 < rows[0] < 30 and 0 < rows[1] < 50  # 80 rows, 20% held out, both sources in it
    trained = [int(f[3].replace(",", "")) for f in found]
    assert [float(f[4]) for f in found] == pytest.approx([100 * t / sum(trained) for t in trained], abs=0.05)


def test_a_mixture_stopped_by_sigterm_mid_epoch_resumes_bit_identical(tmp_path, sources, monkeypatch):
    """Two sources at fractions 0.3/0.7, 3 epochs of 7 steps; SIGTERM as window 9 starts (epoch 1, mid-epoch):
    resumed from 'latest', every step's loss and the final weights equal the uninterrupted run's, bit for bit."""
    import signal

    from helpers import load_params, stop_during_window
    from test_your_data import _run_without_recipe
    from tiny_models import build_tiny_chat_llama

    import finetune.backends.accelerate as engine
    from finetune.errors import TrainingStopped

    model = str(build_tiny_chat_llama(tmp_path / "model"))
    config = tmp_path / "mix.yaml"
    config.write_text(f"model_name_or_path: {model}\nlearning_rate: 1.0e-3\nmixed_precision: 'no'\n"
                      f"datasets:\n  - path: json\n    data_files: {sources[0]}\n    fraction: 0.3\n"
                      f"  - path: json\n    data_files: {sources[1]}\n    fraction: 0.7\n")

    def argv(name, *extra):
        return ["--config", str(config), "--output_dir", str(tmp_path / name), "--per_device_train_batch_size", "4",
                "--gradient_accumulation_steps", "2", "--num_train_epochs", "3", "--max_length", "64",
                "--eval_strategy", "no", "--seed", "7", *extra]

    _run_without_recipe(argv("full"))
    original = stop_during_window(monkeypatch, index=9)
    with pytest.raises(TrainingStopped) as stopped:
        _run_without_recipe(argv("stopped"))
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    monkeypatch.setattr(engine, "iter_windows", original)
    _run_without_recipe(argv("stopped", "--resume_from_checkpoint", "latest"))
    full, resumed = train_steps(tmp_path / "full"), train_steps(tmp_path / "stopped")
    assert len(full) == 21 and [r["loss"] for r in resumed] == [r["loss"] for r in full]
    a, b = load_params(tmp_path / "full"), load_params(tmp_path / "stopped")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
