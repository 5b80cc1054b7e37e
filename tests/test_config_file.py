"""``--config FILE``: a YAML or JSON file of training flags under the command line's flags; a run's own
``run_config.json`` replays it to identical weights; an unknown key names the nearest flag; an Accelerate config
file is pointed to ``--config_file``."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import load_params, run_in_process

from finetune.config import parse_config
from finetune.distributed import reset_state
from finetune.errors import FinetuneError
from finetune.recipes import load_recipe
from finetune.run import main


def test_a_config_file_under_the_command_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("recipe: bbc-news\nlearning_rate: 3e-4\nper_device_train_batch_size: 4\nmax_train_samples: 64\n"
                    "eval_strategy: 'no'\n")
    config = parse_config(["--config", str(path), "--per_device_train_batch_size", "2"])
    assert config.learning_rate == 3e-4 and config.max_train_samples == 64 and config.eval_strategy == "no"
    assert config.per_device_train_batch_size == 2  # the flag wins over the file
    # the recipe's default, where neither sets it
    assert config.gradient_accumulation_steps == load_recipe("bbc-news").DEFAULTS["gradient_accumulation_steps"]
    path.with_suffix(".json").write_text(json.dumps({"recipe": "bbc-news", "seed": 7}))
    assert parse_config([f"--config={path.with_suffix('.json')}"]).seed == 7


def test_run_config_json_replays_the_run_bit_exact(tmp_path, tiny_bert, capsys):
    first, out = run_in_process(tmp_path, "first", model_name_or_path=tiny_bert, max_train_samples=24,
                                max_eval_samples=8, max_length=32, per_device_train_batch_size=2,
                                gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-3, seed=3)
    replay = tmp_path / "replay"
    reset_state()  # a clean Accelerate state, as run_in_process gives its run
    assert main(["--config", str(out / "run_config.json"), "--output_dir", str(replay)]) == 0
    again = json.loads((replay / "run_config.json").read_text())
    where = {"output_dir", "precision_source"}  # where it writes; and the precision now comes from the file
    assert {k: v for k, v in again.items() if k not in where} == \
        {k: v for k, v in json.loads((out / "run_config.json").read_text()).items() if k not in where}
    a, b = load_params(out), load_params(replay)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_unknown_key_names_the_nearest_flag(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("recipe: bbc-news\nlearnig_rate: 1e-4\n")
    with pytest.raises(FinetuneError, match=r"unknown key 'learnig_rate' \(did you mean learning_rate\?\)"):
        parse_config(["--config", str(path)])


def test_an_accelerate_config_file_is_pointed_to_config_file(tmp_path, capsys):
    path = tmp_path / "accelerate.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\n")
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is an Accelerate config file" in err[0] and f"--config_file {path}" in err[0]


def test_a_replay_on_another_process_count_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "run_config.json"
    path.write_text(json.dumps({"recipe": "bbc-news", "total_batch_size": 8, "precision_source": "flag",
                                "batch_plan": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
                                               "num_processes": 2, "total_batch_size": 8, "lever": None}}))
    with pytest.raises(FinetuneError, match="planned for 2 process"):
        parse_config(["--config", str(path)])
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = parse_config(["--config", str(path)])
    assert config.auto_find_batch_size is False and config.batch_plan["num_processes"] == 2
