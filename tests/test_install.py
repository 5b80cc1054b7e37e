"""The package installs like the tools users know: a non-editable ``pip install .`` into a fresh virtual
environment gives a ``finetune`` command that trains, lists recipes and predicts from any directory; an
editable install and a bare source checkout find the top-level ``recipes/`` as ``finetune.recipes`` (and
nothing installs a top-level ``recipes``); and the package's modules import one way (no cycles)."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from helpers import REPO

pytestmark = pytest.mark.integration

# what .gitignore keeps out of the repository, and .git: a copy holds what a fresh clone does
_IGNORED_ANYWHERE = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                           ".cache", ".gpu_carry", ".benchmarks", "site")


def _NOT_COPIED(folder, names):  # noqa: N802 - shutil's ignore callable
    """What .gitignore keeps out: those names anywhere, and the runs' ``outputs/`` at the top only (``/outputs/``:
    ``finetune/outputs/`` is a package)."""
    ignored = set(_IGNORED_ANYWHERE(folder, names))
    return ignored | ({"outputs"} & set(names) if Path(folder) == REPO else set())
CHECKOUT_ONLY = "checkout-only"  # a recipe the `checkout` copy's registry names and no installed copy has


def _copy_repo(dst: Path) -> Path:
    """A copy of the repository at ``dst``: pip builds in the tree it installs (build/, *.egg-info), and a
    stale build/lib there would ship files the sources no longer have; the real checkout stays untouched."""
    shutil.copytree(REPO, dst, ignore=_NOT_COPIED)
    return dst


def running_site_dirs() -> list[str]:
    """The site-packages directories of the RUNNING environment, as its ``site`` module set them up: a venv's own
    (and its base's, with ``include-system-site-packages``), a conda environment's, the system interpreter's, and
    the user site where it is enabled. ``venv --system-site-packages`` would give the *base* interpreter's
    instead, which inside a venv or conda environment lacks what was installed there."""
    import site

    dirs = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    dirs += [sysconfig.get_paths()[key] for key in ("purelib", "platlib")]
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def _venv_with(path: Path, *pip_args: str) -> Path:
    """A fresh virtual environment at ``path`` with ``pip install --no-deps PIP_ARGS``; its python. The heavy
    dependencies (and pip itself) come from the running environment's site-packages, which a ``.pth`` file adds
    after the venv's own (``site.addsitedir``, so their ``.pth`` files run too, as a site-packages' do): what
    the venv installs comes first, the rest is what this test suite runs on, wherever it runs."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    # "zz": site runs .pth files in name order; the venv's own (an editable install's finder) go first
    (Path(own) / "zz_running_environment.pth").write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in running_site_dirs()))
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", *_build_isolation(), *pip_args],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]
    return python


def _build_isolation() -> list[str]:
    """``--no-build-isolation`` where the running environment has the build backend pyproject.toml requires
    (setuptools >= 68, which the venv sees through its ``.pth``): pip then builds with it instead of installing
    setuptools into a throwaway build environment for every install (the slowest part of these tests); without
    it, pip's default isolated build, as a user's ``pip install .`` does."""
    try:
        import setuptools
    except ImportError:
        return []
    return ["--no-build-isolation"] if int(setuptools.__version__.split(".")[0]) >= 68 else []


def _env(**extra: str) -> dict:
    """This environment without PYTHONPATH (which would decide where ``finetune`` comes from), hub offline."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "HF_HUB_OFFLINE": "1", **extra}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The python of a fresh venv holding a non-editable ``pip install .`` of a pristine copy."""
    root = tmp_path_factory.mktemp("installed")
    return _venv_with(root / "venv", str(_copy_repo(root / "src")))


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A source checkout (a copy) whose registry also names ``CHECKOUT_ONLY``, so a listing that shows it
    came from this checkout's recipes/, not from an installed copy or another checkout on sys.meta_path; with
    the ``__pycache__`` a checkout that ran the old finetune/recipes/ keeps after pulling the move."""
    src = _copy_repo(tmp_path_factory.mktemp("checkout") / "src")
    # what git leaves of the old finetune/recipes/ in a checkout that ran it (a namespace package if imported)
    (src / "finetune" / "recipes" / "__pycache__").mkdir(parents=True)
    with open(src / "recipes" / "__init__.py", "a") as registry:
        registry.write(f'\nRECIPES["{CHECKOUT_ONLY}"] = "finetune.recipes.bbc_news"  # tests/test_install.py\n')
    return src


def test_non_editable_install_runs_from_another_directory(tmp_path, tiny_bert, installed):
    venv = installed.parents[1]
    python, finetune = installed, venv / "bin" / "finetune"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([str(python), "-c", "import sys, sysconfig, finetune, finetune.recipes, importlib.util; "
                            "print(sysconfig.get_paths()['purelib'], finetune.__file__, finetune.recipes.__file__, "
                            "'recipes' in sys.modules, importlib.util.find_spec('recipes'))"],
                           capture_output=True, text=True, cwd=elsewhere, env=_env(), check=True).stdout.split()
    site = Path(where[0])
    assert str(venv) in where[1]  # the installed copy, not the repository
    # finetune.recipes (recipes/ in the repository) installs inside the package; no top-level `recipes`
    assert where[2:] == [str(site / "finetune" / "recipes" / "__init__.py"), "False", "None"]
    assert not (site / "recipes").exists() and not (site / "recipes.py").exists()
    dist_info = site / "finetune_accelerate-0.1.0.dist-info"  # the distribution name, free on PyPI
    assert (dist_info / "top_level.txt").read_text().split() == ["finetune"]
    record = [line.split(",")[0] for line in (dist_info / "RECORD").read_text().splitlines()]
    assert {path.split("/")[0] for path in record} == {"finetune", dist_info.name, ".."}  # .. is bin/finetune

    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "1",
           "HOME": str(tmp_path)}
    recipes = subprocess.run([str(finetune), "recipes"], capture_output=True, text=True, cwd=elsewhere, env=env)
    assert recipes.returncode == 0 and "offline" in recipes.stdout, recipes.stderr[-3000:]
    for name in ("bbc-news", "bbc-news-clm", "bbc-headlines", "glue-mrpc", "wikitext-clm"):
        assert name in recipes.stdout
    # the Accelerate configs ship inside the package, for --config_file NAME from any directory
    assert (site / "finetune" / "accelerate_configs" / "multi_gpu.yaml").is_file()
    assert "\nfsdp2 " in recipes.stdout and "\nmulti_cpu_2proc " in recipes.stdout
    # the bf16 measurements that decide an fp16 request on a CPU ship beside the recipes (finetune.engine.cpu_bf16)
    assert (site / "finetune" / "recipes" / "bf16_measured.json").is_file()

    out = elsewhere / "run"
    train = subprocess.run([str(finetune), "train", "--recipe", "bbc-news", "--model_name_or_path", tiny_bert,
                            "--output_dir", str(out), "--max_train_samples", "16", "--max_eval_samples", "8",
                            "--per_device_train_batch_size", "4", "--max_steps", "2", "--max_length", "32"],
                           capture_output=True, text=True, cwd=elsewhere, env=env, timeout=600)
    assert train.returncode == 0, train.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["optimizer_steps"] == 2 and 0 <= metrics["eval_accuracy"] <= 1
    card = (out / "README.md").read_text()
    assert "finetune train --recipe bbc-news" in card  # the reproduce command works outside the repository

    predict = subprocess.run([str(finetune), "predict", "--model", str(out), "The striker scored twice"],
                             capture_output=True, text=True, cwd=elsewhere, env=env, timeout=300)
    assert predict.returncode == 0, predict.stderr[-3000:]
    labels = json.loads((out / "config.json").read_text())["id2label"].values()
    assert any(label in predict.stdout for label in labels)

    bad = subprocess.run([str(finetune), "train", "--recipe", "bbc-news", "--learnig_rate", "1e-4"],
                         capture_output=True, text=True, cwd=elsewhere, env=env, timeout=300)
    assert bad.returncode == 2 and "Did you mean --learning_rate?" in bad.stderr
    assert "Traceback" not in bad.stderr and "CalledProcessError" not in bad.stderr


def test_editable_install_maps_the_top_level_recipes(tmp_path, checkout):
    python = _venv_with(tmp_path / "venv", "-e", str(checkout))
    # the install's own finder maps finetune.recipes to recipes/ (asked before finetune/__init__.py runs)
    where = subprocess.run([str(python), "-c", "import sys; spec = [s for f in sys.meta_path if hasattr(f, "
                            "'find_spec') and (s := f.find_spec('finetune.recipes', None))]; import finetune.recipes; "
                            "print(spec[0].origin, finetune.recipes.__file__, 'recipes' in sys.modules)"],
                           capture_output=True, text=True, cwd=tmp_path, env=_env())
    assert where.returncode == 0, where.stderr[-3000:]
    init = str(checkout / "recipes" / "__init__.py")
    assert where.stdout.split() == [init, init, "False"]
    recipes = subprocess.run([str(tmp_path / "venv" / "bin" / "finetune"), "recipes"], capture_output=True, text=True,
                             cwd=tmp_path, env=_env())
    assert recipes.returncode == 0, recipes.stderr[-3000:]
    assert "bbc-news" in recipes.stdout and CHECKOUT_ONLY in recipes.stdout  # the checkout's registry, live


def test_a_source_checkout_finds_its_recipes_without_an_install(tmp_path, checkout, installed):
    """``python -m finetune.run`` from the checkout and ``python finetune/run.py`` (what ``accelerate launch
    finetune/run.py`` runs) load the checkout's recipes/ as finetune.recipes, also with a venv's python that
    has a non-editable copy installed (run.py puts the checkout first on sys.path)."""
    where = subprocess.run([sys.executable, "-c", "import sys, finetune.recipes; "
                            "print(finetune.recipes.__file__, 'recipes' in sys.modules)"],
                           capture_output=True, text=True, cwd=checkout, env=_env())
    assert where.stdout.split() == [str(checkout / "recipes" / "__init__.py"), "False"], where.stderr[-3000:]
    run_py = str(checkout / "finetune" / "run.py")
    for command, cwd in [([sys.executable, "-m", "finetune.run"], checkout), ([sys.executable, run_py], tmp_path),
                         ([str(installed), run_py], tmp_path)]:
        listing = subprocess.run([*command, "--list_recipes", "True"], capture_output=True, text=True, cwd=cwd,
                                 env=_env(), timeout=300)
        assert listing.returncode == 0, (command, listing.stderr[-3000:])
        assert "bbc-news" in listing.stdout and CHECKOUT_ONLY in listing.stdout, (command, listing.stdout)
    # and the installed copy keeps its own recipes
    installed_listing = subprocess.run([str(installed.parent / "finetune"), "recipes"], capture_output=True,
                                       text=True, cwd=tmp_path, env=_env())
    assert "bbc-news" in installed_listing.stdout and CHECKOUT_ONLY not in installed_listing.stdout


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_no_import_cycles_among_the_packages_modules():
    modules = {}
    for package, root in (("finetune", REPO / "finetune"), ("finetune.recipes", REPO / "recipes")):  # package-dir
        for path in root.rglob("*.py"):
            name = ".".join((package, *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
            modules[name] = path
    graph = {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}

    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return trail + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, trail + [nxt]))
        return None

    cycles = [c for c in map(cycle_from, graph) if c]
    assert not cycles, cycles
