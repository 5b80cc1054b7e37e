"""Structure figures of a package (issue 18): modules, lines, docstring share, function-local imports, the 10 longest
functions, modules naming DeepSpeed/FSDP.

    python bench/code_figures.py REPO [PACKAGE ...]
    python bench/code_figures.py REPO --trace [--verbose]

``--trace`` (issue 26, "following argv from the entry point"): runs a real tiny training run of REPO's code in this
process, ``finetune.run.main(argv)`` (bbc-news, a 2-layer 32-wide BERT from tests/tiny_models.py, 16 training and 8
evaluation samples, ``--total_batch_size 8`` so the batch planner runs, one epoch with its evaluation), under
``sys.setprofile``, and counts on the calls it makes between the package's modules:

- a *call* is a profile ``call`` event whose function is defined in a module of the package (``finetune.*``, the
  checkout's ``recipes/`` included as ``finetune.recipes.*``; a function's module is its ``__name__`` global, so a
  lambda or nested function belongs to the module that wrote it). Its caller is the innermost frame below it that
  is also the package's (library frames in between are skipped: a callback the library calls counts as a call
  from the package module that handed it over). A package module's import is not traced: its module and class
  bodies, and what they call, are no calls (a function-local import runs them inside the traced run, where an
  import at the top ran them before it).
- *stays*: the distinct modules a call enters, the entry's module included.
- *climbs back up*: the distinct (caller module A, callee module B) pairs, A != B, where B imports A directly or
  transitively. Imports are every ``import`` statement of the package's source, at module level or inside a
  function (a lazy import is a dependency too); ``from P import name`` imports module ``P.name`` where that is a
  module, else ``P``. A package's ``__init__`` running before its submodule is not counted as the submodule
  importing it, and the root package ``finetune`` (it imports none of its modules) is left out. A climb is a call
  up the import graph: a callback, or a reach-back into a module that depends on the caller.
- *climbing functions*: the same, counted as distinct (caller function, callee function) pairs.

Only the main thread is traced. ``--verbose`` lists every climb with its first caller and callee functions.
"""
import ast
import inspect
import os
import pathlib
import subprocess
import sys
import tempfile

PACKAGE = "finetune"


def structure(root: pathlib.Path, pkgs: list[str]) -> None:
    """The issue-18 figures, printed."""
    files = [p for pkg in pkgs for p in sorted((root / pkg).rglob("*.py"))]
    total = doc = 0
    funcs, local = [], []
    for p in files:
        text = p.read_text()
        total += len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.body and isinstance(node.body[0], ast.Expr) and isinstance(
                        getattr(node.body[0], "value", None), ast.Constant) and isinstance(node.body[0].value.value, str):
                    d = node.body[0]
                    doc += d.end_lineno - d.lineno + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append((node.end_lineno - node.lineno + 1, f"{p.relative_to(root)}:{node.lineno} {node.name}"))
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.Import, ast.ImportFrom)):
                        local.append(f"{p.relative_to(root)}:{sub.lineno}")
    print(f"modules: {len(files)}, lines: {total}, docstring lines: {doc} ({100 * doc / total:.1f}%)")
    print(f"function-local imports: {len(local)}", sorted({entry.split(':')[0] for entry in local}))
    print("10 longest functions:")
    for n, where in sorted(funcs, reverse=True)[:10]:
        print(f"  {n:4d} {where}")
    out = subprocess.run(["git", "grep", "-liE", "deepspeed|fsdp|ds_numel|ds_shape", "--", *pkgs], cwd=root,
                         capture_output=True, text=True).stdout.split()
    print(f"modules naming DeepSpeed/FSDP: {len(out)}", out)


def package_modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Module name -> source file: ``finetune/`` and the checkout's ``recipes/`` (loaded as ``finetune.recipes``)."""
    modules = {}
    for folder, prefix in ((root / PACKAGE, PACKAGE), (root / "recipes", f"{PACKAGE}.recipes")):
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([prefix, *parts])] = path
    return modules


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports directly (every import statement, and its parent packages)."""
    modules = package_modules(root)
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets.add(base)
                targets |= {f"{base}.{alias.name}" for alias in node.names}
        deps = set()
        for target in targets:
            if target in modules and target != PACKAGE:
                deps.add(target)
        graph[name] = deps - {name}
    return graph


def closure(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Module -> every module it imports, directly or transitively."""
    reach = {}
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph.get(m, ()))
        reach[start] = seen
    return reach


def importing(frame) -> bool:
    """Whether ``frame`` is, or runs under, a module or class body of the package: part of an import."""
    while frame is not None:
        if not frame.f_code.co_flags & inspect.CO_NEWLOCALS and frame.f_globals.get("__name__", "").startswith(PACKAGE):
            return True
        frame = frame.f_back
    return False


def traced_run(root: pathlib.Path) -> tuple[dict, str]:
    """Run the tiny training run of REPO under ``sys.setprofile``: ((caller module, callee module) -> the set of
    (caller function, callee function) pairs seen, the entry's module)."""
    sys.path[:0] = [str(root), str(root / "tests")]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tiny_models import build_tiny_bert

    import finetune.run as entry

    work = pathlib.Path(tempfile.mkdtemp(prefix="code-figures-"))
    model = build_tiny_bert(work / "tiny-bert")
    argv = ["--recipe", "bbc-news", "--model_name_or_path", str(model), "--output_dir", str(work / "run"),
            "--max_train_samples", "16", "--max_eval_samples", "8", "--total_batch_size", "8",
            "--per_device_train_batch_size", "4", "--num_train_epochs", "1", "--max_length", "32"]
    edges: dict[tuple[str, str], set[tuple[str, str]]] = {}

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        if not callee.startswith(PACKAGE) or importing(frame):
            return
        caller = frame.f_back
        while caller is not None and not caller.f_globals.get("__name__", "").startswith(PACKAGE):
            caller = caller.f_back
        if caller is None:
            return
        key = (caller.f_globals["__name__"], callee)
        edges.setdefault(key, set()).add((caller.f_code.co_qualname, frame.f_code.co_qualname))

    sys.setprofile(profile)
    try:
        code = entry.main(argv)
    finally:
        sys.setprofile(None)
    if code != 0:
        raise SystemExit(f"the traced run failed: exit {code}")
    return edges, entry.__name__


def trace(root: pathlib.Path, verbose: bool) -> None:
    """Print the stays and climbs of the traced run (see the module docstring)."""
    edges, entry = traced_run(root)
    reach = closure(import_graph(root))
    visited = {entry} | {m for pair in edges for m in pair}
    climbs = sorted((a, b) for a, b in edges if a != b and a in reach.get(b, ()))
    print(f"stays: {len(visited)} modules; calls between modules: {len([1 for a, b in edges if a != b])} distinct "
          f"(caller, callee) module pairs; climbs back up: {len(climbs)} module pairs, "
          f"{sum(len(edges[c]) for c in climbs)} function pairs")
    if verbose:
        for a, b in climbs:
            for caller, callee in sorted(edges[(a, b)]):
                print(f"  {a}.{caller} -> {b}.{callee}")


def main(argv: list[str]) -> None:
    root = pathlib.Path(argv[0]).resolve()
    rest = argv[1:]
    if "--trace" in rest:
        trace(root, "--verbose" in rest)
    else:
        structure(root, rest or [PACKAGE])


if __name__ == "__main__":
    main(sys.argv[1:])
