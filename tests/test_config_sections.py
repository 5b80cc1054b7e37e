"""Flags live in sections (issue 37 item 5): ``finetune train --help`` lists them under one heading per section, in
``SECTIONS`` order, each flag exactly once; ``TrainConfig`` is the sections composed, its fields in section order
(the step-meaning order a resume refusal lists differences in kept as it was); no file of the config package is
over 300 lines."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest
from helpers import REPO

from finetune.config import DERIVED_FIELDS, SECTIONS, TrainConfig, fields_with

HEADINGS = ["run", "model", "data", "batch", "optimization", "evaluation, checkpoints and logging",
            "Hugging Face Hub", "speed and memory", "causal LM and SFT", "LoRA adapters (peft)", "preference tuning (DPO)",
            "online RL (GRPO)", "reproducibility"]
# fields_with(step=True) as config.py defined it before the split, the preference and GRPO flags added: a resume refusal names several differences in it
STEP_MEANING_ORDER = ("recipe", "model_name_or_path", "train_file", "dataset_name", "dataset_mixture",
                      "dataset_config", "dataset_train_split", "max_length", "block_size", "max_train_samples",
                      "train_sampling_strategy", "add_eos", "assistant_only_loss", "completion_only_loss", "use_peft",
                      "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "use_dora", "use_rslora", "lora_modules_to_save", "init_lora_weights",
                      "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "use_bnb_nested_quant",
                      "bnb_4bit_compute_dtype", "beta", "loss_type", "label_smoothing", "precompute_ref_log_probs",
                      "num_generations", "max_completion_length", "temperature", "top_p", "epsilon", "epsilon_high",
                      "scale_rewards", "num_iterations", "mask_truncated_completions", "reward_funcs",
                      "reward_weights", "replay_completions", "use_vllm", "seed")


# an option's line in argparse's help: two spaces, the option, then its metavar, another spelling or its help
OPTION = re.compile(r"^  (-\w|--[\w-]+)(?:$|,| [A-Z\[{]|  )")


def help_sections(text: str) -> dict[str, list[str]]:
    """{heading: the flags listed under it, each by its first option} of argparse's ``--help`` text (after the usage
    block): a heading is an unindented line ending in ``:``; a section's description (``--seed and ...``) is no
    option line."""
    sections, heading = {}, None
    for line in text.split("\n\n", 1)[1].splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            heading = line[:-1]
            sections[heading] = []
        elif OPTION.match(line):
            sections[heading].append(OPTION.match(line)[1])
    return sections


def expected_sections() -> dict[str, list[str]]:
    """{heading: the section's flags} from ``SECTIONS``; HfArgumentParser adds ``--no_NAME`` to a flag whose default
    is True."""
    expected = {"options": ["-h"]}
    for heading, section in SECTIONS.items():
        expected[heading] = []
        for f in dataclasses.fields(section):
            expected[heading] += [f"--{f.name}"] + ([f"--no_{f.name}"] if f.default is True else [])
    return expected


def test_train_help_lists_every_flag_once_under_its_section(capsys):
    from finetune.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["train", "--help"])
    assert stop.value.code == 0
    sections = help_sections(capsys.readouterr().out)
    assert list(sections) == ["options", *HEADINGS]
    assert sections == expected_sections()
    listed = [flag for flags in sections.values() for flag in flags]
    assert len(listed) == len(set(listed))
    assert {f"--{name}" for name in TrainConfig.__dataclass_fields__} - set(listed) == {
        f"--{name}" for name in DERIVED_FIELDS}  # the derived values have no flag


def test_the_script_s_help_is_the_same():
    """``python finetune/run.py --help`` (the script path ``accelerate launch`` takes) lists the same sections."""
    result = subprocess.run([sys.executable, "finetune/run.py", "--help"], capture_output=True, text=True, cwd=REPO,
                            timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert help_sections(result.stdout) == expected_sections()


def test_train_config_is_the_sections_composed():
    assert list(SECTIONS) == HEADINGS
    # a dataclass lists its bases' fields from the last base to the first: the sections are named in reverse
    assert TrainConfig.__bases__ == tuple(reversed(SECTIONS.values()))
    in_sections = [f.name for section in SECTIONS.values() for f in dataclasses.fields(section)]
    assert [f.name for f in dataclasses.fields(TrainConfig)] == [*in_sections, *DERIVED_FIELDS]
    assert fields_with(step=True) == STEP_MEANING_ORDER


def test_no_file_of_the_config_package_is_over_300_lines():
    sizes = {path.name: len(path.read_text().splitlines()) for path in (REPO / "finetune" / "config").glob("*.py")}
    assert sizes and max(sizes.values()) <= 300, sizes
