"""``--push_to_hub`` (finetune/outputs/hub.py) against huggingface_hub's behaviour without the Hub: ``tests/fake_hub.py``'s
``FakeHfApi`` (its docstring cites the library's source for each behaviour it keeps). What is checked: the refusals
before training (offline, no token, a refused or read-only token, a foreign namespace), the repository and the files
each ``--hub_strategy`` uploads after each checkpoint and at the end, in both backends, and that a failing upload
leaves the run finished and its folder intact."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import pytest
from fake_hub import FakeHfApi, http_error
from helpers import assert_user_error, run_in_process, run_script
from huggingface_hub import constants

from finetune.config import parse_config
from finetune.errors import FinetuneError
from finetune.outputs import hub


@pytest.fixture
def online(monkeypatch):
    """Offline mode off for this process's huggingface_hub (conftest sets HF_HUB_OFFLINE=1 at import, which
    ``constants.is_offline_mode`` reads from ``constants.HF_HUB_OFFLINE``); no token in the environment or on disk."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", "/nonexistent/finetune-test/token")


def config_for(tmp_path, *flags):
    config = parse_config(["--recipe", "bbc-news", "--output_dir", str(tmp_path / "my-run"), "--push_to_hub", *flags])
    config.validate()
    return config


# ------------------------------------------------------------------------------------------ refusals before training
def test_offline_is_refused_before_training_with_one_error_line(tmp_path, tiny_bert):
    """The real entry point in a fresh interpreter with HF_HUB_OFFLINE=1: exit 2, one error line, no banner (training
    never started), and the output directory never created."""
    out = tmp_path / "run"
    result = run_script(["--recipe", "bbc-news", "--model_name_or_path", tiny_bert, "--output_dir", str(out),
                         "--max_train_samples", "8", "--max_steps", "1", "--push_to_hub"], env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2
    assert_user_error(result, "--push_to_hub", "HF_HUB_OFFLINE", "drop --push_to_hub")
    assert len([line for line in result.stderr.splitlines() if line.startswith("error:")]) == 1
    assert "Effective batch size" not in result.stdout
    assert not out.exists()


def test_no_token_is_refused(tmp_path, online):
    with pytest.raises(FinetuneError, match="needs a Hugging Face token.*hf auth login.*HF_TOKEN"):
        hub.prepare(config_for(tmp_path), api=FakeHfApi(token=None))


def test_a_refused_token_is_refused(tmp_path, online):
    api = FakeHfApi(whoami_error=http_error(401, "Invalid user token."))
    with pytest.raises(FinetuneError, match="refused the token \\(Invalid user token.\\)"):
        hub.prepare(config_for(tmp_path), api=api)
    assert [m for m, _ in api.calls] == ["whoami"]  # nothing created


def test_an_unreachable_hub_is_refused_fast(tmp_path, online):
    api = FakeHfApi(whoami_error=ConnectionError("[Errno 111] Connection refused"))
    with pytest.raises(FinetuneError, match="cannot be reached.*ConnectionError"):
        hub.prepare(config_for(tmp_path), api=api)


def test_a_silent_hub_times_out(tmp_path, online):
    gate = threading.Event()

    class Silent(FakeHfApi):
        def whoami(self, token=None, *, cache=False):
            gate.wait(5)
            return super().whoami(token)

    with pytest.raises(FinetuneError, match="cannot be reached.*TimeoutError: no answer within 0 s"):
        hub.prepare(config_for(tmp_path), api=Silent(), timeout_s=0.2)
    gate.set()


def test_a_read_only_token_and_a_foreign_namespace_are_refused(tmp_path, online):
    with pytest.raises(FinetuneError, match="token of 'tester' is read-only"):
        hub.prepare(config_for(tmp_path), api=FakeHfApi(role="read"))
    with pytest.raises(FinetuneError, match="'tester' cannot create repositories in 'someone-else'.*tester, my-org"):
        hub.prepare(config_for(tmp_path, "--hub_model_id", "someone-else/model"), api=FakeHfApi(orgs=["my-org"]))
    push = hub.prepare(config_for(tmp_path, "--hub_model_id", "my-org/model"), api=FakeHfApi(orgs=["my-org"]))
    assert push.repo_id == "my-org/model"


def test_repository_names_as_trainer_gives_them(tmp_path, online):
    """Trainer's init_hf_repo: hub_model_id, else the output_dir folder's name, in the token user's namespace."""
    api = FakeHfApi()
    assert hub.prepare(config_for(tmp_path), api=api).repo_id == "tester/my-run"
    assert hub.prepare(config_for(tmp_path, "--hub_model_id", "bbc"), api=api).repo_id == "tester/bbc"
    assert [m for m, _ in api.calls] == ["whoami", "whoami"]  # prepare creates nothing
    assert hub.prepare(parse_config(["--recipe", "bbc-news", "--output_dir", str(tmp_path)]), api=api) is None


def test_bad_flags_are_refused_by_validate(tmp_path):
    config = parse_config(["--recipe", "bbc-news", "--output_dir", str(tmp_path), "--hub_model_id", "me/x"])
    with pytest.raises(FinetuneError, match="--hub_model_id is used only with --push_to_hub"):
        config.validate()
    config = parse_config(["--recipe", "bbc-news", "--output_dir", str(tmp_path), "--push_to_hub", "--hub_model_id",
                           "a/b/c"])
    with pytest.raises(FinetuneError, match="'a/b/c' is not a Hub repository id"):
        config.validate()
    config = parse_config(["--recipe", "bbc-news", "--output_dir", str(tmp_path), "--push_to_hub", "--compare"])
    with pytest.raises(FinetuneError, match="--push_to_hub with --compare: a comparison writes two runs"):
        config.validate()


# ------------------------------------------------------------------------------------------ HubPush on its own
def _checkpoint(root: Path, name: str) -> Path:
    path = root / "checkpoints" / name
    path.mkdir(parents=True)
    for file in ("model.safetensors", "config.json", "tokenizer.json", "optimizer.bin", "random_states_0.pkl",
                 "trainer_state.json", "manifest.json", "COMPLETE"):
        (path / file).write_text(file)
    return path


def test_end_strategy_uploads_only_at_the_end(tmp_path, online):
    api = FakeHfApi()
    push = hub.prepare(config_for(tmp_path, "--hub_strategy", "end"), api=api)
    push.after_save(_checkpoint(tmp_path / "my-run", "step_00000001"), 1)
    assert api.uploads() == []
    push.at_end(tmp_path / "my-run")
    assert [u["commit_message"] for u in api.uploads()] == ["End of training"]
    assert [m for m, _ in api.calls] == ["whoami", "create_repo", "upload_folder"]


def test_a_save_during_a_running_push_is_queued_not_skipped(tmp_path, online, capsys):
    """Unlike Trainer (which skips it), a save during a running push is queued: ``all_checkpoints`` keeps every
    checkpoint's own folder; only the root's model files of a save whose upload had not started are superseded."""
    gate = threading.Event()
    api = FakeHfApi(gate=gate)
    push = hub.prepare(config_for(tmp_path, "--hub_strategy", "all_checkpoints"), api=api)
    out = tmp_path / "my-run"
    push.after_save(_checkpoint(out, "step_00000001"), 1)
    while not push.pending[1].future.running():  # step 1's root upload has started (and waits at the gate)
        time.sleep(0.01)
    push.after_save(_checkpoint(out, "step_00000002"), 2)
    push.after_save(_checkpoint(out, "step_00000003"), 3)  # step 2's root upload had not started: superseded
    printed = capsys.readouterr().out
    assert "not pushing" not in printed and "step 2's upload to tester/my-run had not started" in printed
    assert push.held() == {(out / "checkpoints" / f"step_0000000{n}").resolve() for n in (1, 2, 3)}
    gate.set()
    push.at_end(out)
    uploads = api.uploads()
    assert [(u["path_in_repo"], u["commit_message"]) for u in uploads] == [
        ("", "Training in progress, step 1"), ("step_00000001", "Training in progress, step 1, checkpoint"),
        ("step_00000002", "Training in progress, step 2, checkpoint"),
        ("", "Training in progress, step 3"), ("step_00000003", "Training in progress, step 3, checkpoint"),
        ("", "End of training")]
    assert all(u["thread"] != threading.current_thread().name for u in uploads[:5])  # in the background
    assert uploads[5]["thread"] == threading.current_thread().name  # the end waits: Trainer's blocking push
    assert uploads[1]["files"][0].startswith("step_00000001/")
    assert push.failures == [] and push.held() == set()


# ------------------------------------------------------------------------------------------ real runs
@pytest.fixture
def fake_api(monkeypatch, online):
    """Every ``HfApi()`` finetune.outputs.hub builds is one ``FakeHfApi`` (returned); a token is set."""
    monkeypatch.setenv("HF_TOKEN", "hf_fake")
    api = FakeHfApi()
    monkeypatch.setattr(hub, "HfApi", lambda: api)
    return api


def _files(out: Path, under: str = "") -> set[str]:
    root = out / under
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def test_checkpoint_strategy_uploads_after_each_save_and_at_the_end(tmp_path, tiny_bert, fake_api):
    """Accelerate backend, --save_steps 1, 3 steps: checkpoints after steps 1 and 2 (not after the last: the final
    model is the end's), each followed by its model files at the root and the whole folder in last-checkpoint/."""
    metrics, out = run_in_process(tmp_path, "pushed", model_name_or_path=tiny_bert, max_train_samples=24,
                                  max_eval_samples=8, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                  max_steps=3, max_length=32, save_steps=1, push_to_hub=True,
                                  hub_strategy="checkpoint", hub_private_repo=True)
    assert metrics["optimizer_steps"] == 3
    creates = [args for m, args in fake_api.calls if m == "create_repo"]
    assert [(c["repo_id"], c["private"], c["exist_ok"]) for c in creates] == [("tester/pushed", True, True)]
    uploads = fake_api.uploads()
    assert [(u["path_in_repo"], u["commit_message"]) for u in uploads] == [
        ("", "Training in progress, step 1"), ("last-checkpoint", "Training in progress, step 1, checkpoint"),
        ("", "Training in progress, step 2"), ("last-checkpoint", "Training in progress, step 2, checkpoint"),
        ("", "End of training")]
    assert uploads[0]["repo_existed"]  # create_repo ran first, on the same background queue
    step2 = out / "checkpoints" / "step_00000002"
    model_files = set(uploads[2]["files"])
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= model_files
    assert model_files <= _files(step2)
    assert not model_files & {"optimizer.bin", "trainer_state.json", "manifest.json", "COMPLETE"}
    assert set(uploads[3]["files"]) == {f"last-checkpoint/{name}" for name in _files(step2)}  # resumable: all of it
    assert uploads[2]["sha256"]["model.safetensors"] == uploads[3]["sha256"]["last-checkpoint/model.safetensors"]
    end = set(uploads[4]["files"])
    assert end == {name for name in _files(out) if not name.startswith("checkpoints/step_")}
    assert {"README.md", "metrics.json", "log.jsonl", "run_config.json", "model.safetensors"} <= end
    assert json.loads((out / "run_config.json").read_text())["hub_strategy"] == "checkpoint"
    # the card pushed is the one that loads from the repository (as Trainer's names hub_model_id)
    card = (out / "README.md").read_text()
    assert uploads[4]["sha256"]["README.md"] == hashlib.sha256(card.encode()).hexdigest()
    assert "On the Hugging Face Hub: [tester/pushed](https://huggingface.co/tester/pushed)." in card
    assert 'pipeline("text-classification", model="tester/pushed")' in card
    assert "hf download tester/pushed --local-dir pushed\nfinetune predict --model pushed" in card
    assert "| `eval_accuracy` |" in card and "--push_to_hub" in card  # the rest as the run wrote it


def test_an_upload_error_leaves_the_run_finished_and_its_folder_intact(tmp_path, tiny_bert, fake_api, capsys):
    fake_api.upload_error = http_error(500, "Internal Server Error", "/api/models/tester/failing/commit/main")
    metrics, out = run_in_process(tmp_path, "failing", model_name_or_path=tiny_bert, max_train_samples=24,
                                  max_eval_samples=8, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                  max_steps=3, max_length=32, save_steps=1, push_to_hub=True)
    assert metrics["optimizer_steps"] == 3  # the run finished
    assert len(fake_api.uploads()) == 3  # every_save: steps 1 and 2, then the end; each one failed
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 3 and all("failed (HfHubHTTPError: Internal Server Error)" in w for w in warnings)
    assert "training goes on" in warnings[0] and "the run is finished" in warnings[2]
    assert f"`hf upload tester/failing {out}`" in warnings[-1]
    assert {"model.safetensors", "metrics.json", "README.md", "log.jsonl", "run_config.json"} <= _files(out)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    assert json.loads((out / "metrics.json").read_text())["optimizer_steps"] == 3


def test_trainer_backend_every_save_uploads_after_each_checkpoint(tmp_path, tiny_bert, fake_api):
    """Trainer backend: its checkpoint-N folders (on_save, after Trainer wrote them), then the end."""
    metrics, out = run_in_process(tmp_path, "trainer-push", model_name_or_path=tiny_bert, backend="trainer",
                                  max_train_samples=24, max_eval_samples=8, per_device_train_batch_size=4,
                                  gradient_accumulation_steps=2, max_steps=2, max_length=32, save_steps=1,
                                  push_to_hub=True, hub_model_id="bbc-trainer")
    assert metrics["optimizer_steps"] == 2
    uploads = fake_api.uploads()
    assert [(Path(u["folder_path"]).name, u["commit_message"]) for u in uploads] == [
        ("checkpoint-1", "Training in progress, step 1"), ("checkpoint-2", "Training in progress, step 2"),
        ("trainer-push", "End of training")]
    assert {u["repo_id"] for u in uploads} == {"tester/bbc-trainer"}
    assert "model.safetensors" in uploads[0]["files"] and "optimizer.pt" not in uploads[0]["files"]
    assert not any(name.startswith("checkpoints/checkpoint-") for name in uploads[2]["files"])


def test_other_ranks_check_offline_and_token_alike_and_ask_the_hub_nothing(tmp_path, online, monkeypatch):
    """Rank 1 of a launch: the local checks give every process the same error (so ``distributed.agree`` reports it
    once, as it is); only rank 0 asks the Hub and pushes."""
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(FinetuneError, match="needs a Hugging Face token"):
        hub.prepare(config_for(tmp_path), api=FakeHfApi(token=None))
    api = FakeHfApi()
    assert hub.prepare(config_for(tmp_path), api=api) is None and api.calls == []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FinetuneError, match="offline mode is on"):
        hub.prepare(config_for(tmp_path), api=api)


@pytest.mark.parametrize("backend", ["accelerate", "trainer"])
def test_a_slow_upload_under_save_total_limit_loses_nothing(tmp_path, tiny_bert, fake_api, monkeypatch, capsys,
                                                           backend):
    """``--save_total_limit 1``, a checkpoint after each of 5 steps, and a Hub that uploads nothing until the
    training is over (every upload waits at a gate opened by ``at_end``): the checkpoint under a running upload is
    not pruned (it was: "... is not a directory", and every later push skipped), each later save is queued (an
    older one not started is superseded), no upload fails, ``last-checkpoint/`` holds the newest checkpoint, and
    once the uploads are done the limit holds again: one checkpoint left."""
    gate = threading.Event()
    fake_api.gate = gate
    at_end = hub.HubPush.at_end
    monkeypatch.setattr(hub.HubPush, "at_end", lambda self, output_dir: gate.set() or at_end(self, output_dir))
    metrics, out = run_in_process(tmp_path, f"slow-{backend}", model_name_or_path=tiny_bert, backend=backend,
                                  max_train_samples=40, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                  max_steps=5, max_length=32, eval_strategy="no", save_steps=1, save_total_limit=1,
                                  push_to_hub=True, hub_strategy="checkpoint")
    assert metrics["optimizer_steps"] == 5
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")] == []
    kept = sorted(p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith("."))
    newest = "step_00000004" if backend == "accelerate" else "checkpoint-5"  # the accelerate loop's last is the end's
    assert kept == [newest]
    uploads = fake_api.uploads()  # each one recorded is one that found its folder
    assert Path(uploads[0]["folder_path"]).name != newest  # an older one's, running while later ones were saved
    assert [u["commit_message"] for u in uploads[-3:]] == [f"Training in progress, step {newest[-1]}",
                                                          f"Training in progress, step {newest[-1]}, checkpoint",
                                                          "End of training"]
    last = uploads[-2]
    assert last["path_in_repo"] == "last-checkpoint" and Path(last["folder_path"]).name == newest
    assert set(last["files"]) == {f"last-checkpoint/{name}" for name in _files(out / "checkpoints" / newest)}
