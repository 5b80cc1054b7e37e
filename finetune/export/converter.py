"""llama.cpp's HF -> GGUF converter, without building llama.cpp: ``convert_hf_to_gguf.py``, its ``gguf-py/`` and
``conversion/`` taken from the ``llama-cpp-python`` source distribution on PyPI (fetched with pip, SHA-256 checked,
cached as ``finetune.models.fetch`` caches SmolLM2's GGUF), or from a llama.cpp checkout (``--llama_cpp_dir``). The
converter runs as a subprocess; types it cannot write (k-quants, q4_0, ...) need llama.cpp's compiled
``llama-quantize``, found in ``--llama_cpp_dir`` or on the PATH, and are refused with one ``error:`` line without it,
as is an architecture the converter does not register (``check_architecture``), both before any work."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import uuid
from pathlib import Path

from finetune.errors import FinetuneError
from finetune.models.fetch import default_cache_dir, sha256_file

LLAMA_CPP_PACKAGE = "llama-cpp-python"
LLAMA_CPP_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"  # 76,6 MB, PyPI
VENDOR = f"llama_cpp_python-{LLAMA_CPP_VERSION}/vendor/llama.cpp/"
CONVERTER = "convert_hf_to_gguf.py"
MEMBERS = (CONVERTER, "gguf-py/", "conversion/")  # what the converter imports (its sys.path and `conversion`)
READY = ".complete"  # written last into the cache folder: its content is SDIST_SHA256
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")  # written by convert_hf_to_gguf.py itself
QUANTIZE_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s",
                  "q5_k_m", "q6_k")  # need llama-quantize (C++), from an f32 GGUF
OUTTYPES = CONVERTER_TYPES + QUANTIZE_TYPES
QUANTIZE_BINARY = "llama-quantize"


def cache_folder(cache_dir=None) -> Path:
    """``cache_dir`` (default ``$FINETUNE_CACHE`` or ``~/.cache/finetune``) / ``llama.cpp-<version>``."""
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return base / f"llama.cpp-{LLAMA_CPP_VERSION}"


def require_sentencepiece() -> None:
    """Raise ``FinetuneError`` naming the fix if ``sentencepiece`` (the converter imports it) is missing."""
    if importlib.util.find_spec("sentencepiece") is None:
        raise FinetuneError("writing a GGUF file needs the `sentencepiece` package (llama.cpp's converter imports "
                            "it), which is not installed. Install it with `pip install sentencepiece` (or "
                            "`pip install -e \".[export]\"`), then run again.")


def _download_sdist(dest: Path) -> Path:
    """``pip download --no-deps --no-binary :all: llama-cpp-python==<version>`` into ``dest``; the file's path.
    ``FinetuneError`` with pip's last lines when pip fails."""
    spec = f"{LLAMA_CPP_PACKAGE}=={LLAMA_CPP_VERSION}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
           "--no-input", "-q", spec, "-d", str(dest)]
    print(f"downloading {spec}'s source distribution from PyPI (~77 MB) for llama.cpp's GGUF converter ...",
          file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = dest / SDIST_NAME
    if proc.returncode != 0 or not found.is_file():
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        detail = " ".join([ln for ln in lines if ln.startswith("ERROR:")] or lines[-2:]) or "no file saved"
        raise FinetuneError(f"could not download {spec} with pip: {detail}. Check that PyPI is reachable, or pass "
                            "--llama_cpp_dir DIR (a llama.cpp checkout holding convert_hf_to_gguf.py), or --sdist "
                            f"PATH (`pip download --no-deps --no-binary :all: {spec}` elsewhere).")
    return found


def _extract(sdist: Path, target: Path) -> None:
    """Check ``sdist``'s SHA-256, extract the converter's ``MEMBERS`` into ``target`` atomically (a sibling
    temporary folder renamed into place, ``READY`` written last)."""
    if sha256_file(sdist) != SDIST_SHA256:
        raise FinetuneError(f"{sdist} failed its SHA-256 check (not {LLAMA_CPP_PACKAGE} {LLAMA_CPP_VERSION}'s "
                            "source distribution, or a damaged download). Delete it and run the export again.")
    tmp = target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part"
    try:
        with tarfile.open(sdist, "r:gz") as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(VENDOR)
                       and any(m.name[len(VENDOR):].startswith(name) for name in MEMBERS) and (m.isfile() or m.isdir())]
            for member in members:
                member.name = member.name[len(VENDOR):]
            archive.extractall(tmp, members=members, filter="data")
        if not (tmp / CONVERTER).is_file():
            raise FinetuneError(f"{sdist} holds no {VENDOR}{CONVERTER}. Delete it and run the export again.")
        (tmp / READY).write_text(SDIST_SHA256 + "\n")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def converter_dir(llama_cpp_dir=None, cache_dir=None, sdist=None) -> Path:
    """The folder holding ``convert_hf_to_gguf.py`` and its ``gguf-py/``: ``llama_cpp_dir`` as given, else the cache
    (``cache_folder``), filled from ``sdist`` (a local copy of the source distribution) or PyPI the first time.
    Raises ``FinetuneError`` for a ``llama_cpp_dir`` without the converter, a failed download or checksum, or a cache
    folder that cannot be written."""
    if llama_cpp_dir is not None:
        folder = Path(llama_cpp_dir).expanduser()
        if not (folder / CONVERTER).is_file():
            raise FinetuneError(f"--llama_cpp_dir {str(llama_cpp_dir)!r} holds no {CONVERTER}. Pass the root of a "
                                "llama.cpp checkout, or leave the flag out to fetch the converter from PyPI.")
        return folder
    target = cache_folder(cache_dir)
    if (target / READY).is_file() and (target / READY).read_text().strip() == SDIST_SHA256:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise FinetuneError(f"cannot create the cache directory {target.parent} ({err}). Set FINETUNE_CACHE to a "
                            "writable directory.") from None
    if sdist is not None:
        if not Path(sdist).is_file():
            raise FinetuneError(f"--sdist {str(sdist)!r}: no such file. Pass the downloaded {SDIST_NAME}.")
        _extract(Path(sdist), target)
        return target
    with tempfile.TemporaryDirectory(prefix="finetune-llama-cpp-", dir=target.parent) as tmp:
        _extract(_download_sdist(Path(tmp)), target)
    return target


def find_quantize(llama_cpp_dir=None) -> Path | None:
    """``llama-quantize``: in ``llama_cpp_dir`` (its root, ``build/bin/`` or ``bin/``), else on the PATH; None."""
    if llama_cpp_dir is not None:
        root = Path(llama_cpp_dir).expanduser()
        for candidate in (root / QUANTIZE_BINARY, root / "build" / "bin" / QUANTIZE_BINARY, root / "bin" / QUANTIZE_BINARY):
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
    found = shutil.which(QUANTIZE_BINARY)
    return Path(found) if found else None


def check_outtype(outtype: str, llama_cpp_dir=None) -> Path | None:
    """Before any work: ``outtype`` is one ``OUTTYPES`` names and can be written here. Returns ``llama-quantize``'s
    path for a ``QUANTIZE_TYPES`` type, None for a converter type. Raises ``FinetuneError`` (one line: what and the
    fix) for an unknown type, or a quantization without ``llama-quantize``."""
    if outtype not in OUTTYPES:
        raise FinetuneError(f"--gguf_outtype {outtype!r} is not a GGUF type this export writes; use one of "
                            f"{', '.join(OUTTYPES)}.")
    if outtype in CONVERTER_TYPES:
        return None
    quantize = find_quantize(llama_cpp_dir)
    if quantize is None:
        raise FinetuneError(f"--gguf_outtype {outtype} needs llama.cpp's compiled {QUANTIZE_BINARY}, which is neither "
                            "on the PATH nor in --llama_cpp_dir. Build llama.cpp (cmake -B build && cmake --build build "
                            f"--target {QUANTIZE_BINARY}) and pass --llama_cpp_dir, or use --gguf_outtype "
                            f"{'|'.join(CONVERTER_TYPES)}, which need no compiled tool.")
    return quantize


# Run in a subprocess with the converter's folder and its gguf-py first on sys.path: the names of the text model
# classes registered with `ModelBase.register(...)` (llama.cpp keeps them in `conversion/` since 2026 and imports them
# on demand: `load_all_models()` imports every one; earlier converters register them when the script is imported).
_REGISTRY_PROBE = """
import json, logging, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/gguf-py"]
logging.disable(logging.WARNING)
import convert_hf_to_gguf as c
try:
    from conversion import load_all_models
except ImportError:
    pass
else:
    load_all_models()
base = getattr(c, "ModelBase", None) or c.Model
model_type = getattr(c, "ModelType", None)
classes = base._model_classes[model_type.TEXT] if model_type is not None else base._model_classes
print(json.dumps(sorted(classes)))
"""


def supported_architectures(converter: Path) -> list[str]:
    """The Hugging Face architectures (model class names, ``LlamaForCausalLM``) the converter in ``converter``
    converts to a text-model GGUF: the names its model classes register (``ModelBase.register``), read by importing
    it in a subprocess (a few seconds: it imports torch). Raises ``FinetuneError`` when the converter cannot be
    imported."""
    proc = subprocess.run([sys.executable, "-c", _REGISTRY_PROBE, str(converter)], capture_output=True, text=True,
                          env=_converter_env(converter))
    try:
        names = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    except (IndexError, ValueError):
        names = None
    if not isinstance(names, list):
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        raise FinetuneError(f"llama.cpp's {converter / CONVERTER} could not be imported to read the architectures it "
                            f"converts: {' | '.join(lines[-2:]) or 'no output'}. Pass --llama_cpp_dir with a complete "
                            "llama.cpp checkout, or leave it out to use the converter fetched from PyPI.")
    return names


def check_architecture(architecture: str, converter: Path) -> None:
    """Before any work: raise ``FinetuneError`` (one line: the architecture and the route that exports it) unless
    the converter in ``converter`` registers ``architecture`` (``supported_architectures``)."""
    names = supported_architectures(converter)
    if architecture not in names:
        raise FinetuneError(f"--to gguf: llama.cpp's converter ({converter / CONVERTER}) cannot convert "
                            f"{architecture}: it is not among the {len(names)} text-model architectures the converter "
                            f"registers (`python {converter / CONVERTER} --print-supported-models` lists them). Export "
                            f"it with --to merged (a Hugging Face folder, for transformers or vLLM), or pass "
                            f"--llama_cpp_dir with a llama.cpp whose converter supports {architecture}.")


def _converter_env(converter: Path) -> dict:
    """The environment the converter runs in: its own ``gguf-py`` first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(converter / "gguf-py"), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("NO_LOCAL_GGUF", None)
    return env


def _run(cmd: list[str], what: str, env: dict | None = None) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        raise FinetuneError(f"{what} failed (exit {proc.returncode}): {' | '.join(lines[-3:]) or 'no output'}. "
                            f"The command was: {' '.join(cmd)}")


def convert(model_dir: Path, outfile: Path, outtype: str, converter: Path, quantize: Path | None = None) -> Path:
    """Write ``outfile``, the GGUF of the Hugging Face model folder ``model_dir`` in ``outtype``: llama.cpp's
    ``convert_hf_to_gguf.py`` (in ``converter``, with its ``gguf-py`` first on PYTHONPATH) for ``CONVERTER_TYPES``;
    for the others an f32 GGUF first, then ``quantize`` (``llama-quantize IN OUT TYPE``). Returns ``outfile``.
    Raises ``FinetuneError`` with the tool's last lines when a step fails."""
    require_sentencepiece()
    env = _converter_env(converter)
    first = outfile if quantize is None else outfile.with_name(outfile.stem + ".f32-unquantized.gguf")
    _run([sys.executable, str(converter / CONVERTER), str(model_dir), "--outfile", str(first), "--outtype",
          outtype if quantize is None else "f32"], "llama.cpp's convert_hf_to_gguf.py", env)
    if quantize is not None:
        try:
            _run([str(quantize), str(first), str(outfile), outtype.upper()], QUANTIZE_BINARY)
        finally:
            first.unlink(missing_ok=True)
    return outfile
