"""The package's layers, checked: every import of ``finetune/`` runs down the floors that docs/contributing.md's module
map gives (entry points > commands > backends > lifecycle > outputs > planner > tasks > engine > models > data > config >
foundations),
never up, and within a floor never in a cycle; the map itself names every module. Imports are every ``import``
statement of the source, at module level or inside a function (a lazy import is a dependency too)."""

from __future__ import annotations

import ast
import re

from helpers import REPO

PACKAGE = REPO / "finetune"
MAP = REPO / "docs" / "contributing.md"
# the floors, lowest first: a module may import its own floor's and lower floors' modules only
FLOORS = ["foundations", "config", "data", "models", "engine", "tasks", "planner", "outputs", "lifecycle", "backends",
          "commands", "entry points"]


def floors_from_map() -> dict[str, str]:
    """module path (relative to finetune/, e.g. ``data/loading.py`` or ``metrics/``) -> its floor, read from the
    module map's table in docs/contributing.md (a row's first cell names the floor, or is empty: the row above's)."""
    floor, found = None, {}
    for line in MAP.read_text().split("## Where each concern lives", 1)[1].split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[1].startswith("`"):
            continue
        floor = cells[0] or floor
        for name in re.findall(r"`([\w/]+(?:\.py|/))`", cells[1]):
            found[name] = floor
    return found


def module_of(path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    name = ".".join(rel.parts)
    return name.removesuffix(".__init__")


def floor_of(module: str, floors: dict[str, str]) -> str | None:
    """The floor of ``finetune.a.b``: the map's row for ``a/b.py``, else for its folder ``a/``."""
    parts = module.split(".")[1:]
    if not parts:
        return "entry points"
    for key in ("/".join(parts) + ".py", parts[0] + "/", parts[0] + ".py"):
        if key in floors:
            return floors[key]
    return None


def imports(path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports (``from P import name``: ``P.name`` where that is a module, else P)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("finetune"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("finetune"))
    return {m for m in found if m in modules and m != "finetune"}


def test_every_import_runs_down_the_floors_of_the_module_map():
    floors = floors_from_map()
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_of(p) for p in paths}
    unmapped = sorted(m for m in modules if floor_of(m, floors) is None and not m.startswith("finetune.metrics."))
    assert not unmapped, f"modules missing from the module map in docs/contributing.md: {unmapped}"
    assert set(floors.values()) <= set(FLOORS), set(floors.values()) - set(FLOORS)
    upward = []
    for path in paths:
        module = module_of(path)
        if module.startswith("finetune.metrics."):
            continue
        here = FLOORS.index(floor_of(module, floors))
        for target in imports(path, modules):
            there = FLOORS.index(floor_of(target, floors))
            if there > here:
                upward.append(f"{module} ({FLOORS[here]}) imports {target} ({FLOORS[there]})")
    assert not upward, "imports that run up a floor:\n" + "\n".join(upward)


def test_the_folders_hold_no_import_cycle():
    """Folder to folder: a folder that imports another is never imported back by it (a cycle between floors'
    folders would let a layer's change ripple both ways)."""
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_of(p) for p in paths}

    def folder(m: str) -> str:
        parts = m.split(".")
        return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else "(top)"

    edges = {(folder(module_of(p)), folder(t)) for p in paths for t in imports(p, modules)}
    cycles = sorted((a, b) for a, b in edges if a < b and (b, a) in edges and "(top)" not in (a, b))
    assert not cycles, cycles


def test_the_rooms_are_named_for_what_they_hold():
    """Model loading lives on a ``models/`` floor below the tasks, what a run reports in ``outputs/`` below the
    lifecycle, which keeps the run's state and moments in at most 12 modules."""
    floors = floors_from_map()
    assert floors["models/"] == "models" and floors["outputs/"] == "outputs"
    assert FLOORS.index("data") < FLOORS.index("models") < FLOORS.index("tasks")
    assert FLOORS.index("planner") < FLOORS.index("outputs") < FLOORS.index("lifecycle")
    lifecycle = [p for p in (PACKAGE / "lifecycle").glob("*.py") if p.name != "__init__.py"]
    assert len(lifecycle) <= 12, sorted(p.name for p in lifecycle)


def test_one_concern_per_room_keeps_modules_small():
    """No module of finetune/ over 760 lines, none of commands/verify/ over 350, and at most 7 functions over the
    complexity budget (``# noqa: C901``)."""
    sizes = {p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert max(sizes.values()) <= 760, max(sizes.items(), key=lambda kv: kv[1])
    assert all(n <= 350 for name, n in sizes.items() if name.startswith("commands/verify/")), sizes
    markers = sum(p.read_text().count("noqa: C901") for p in PACKAGE.rglob("*.py"))
    assert markers <= 7, markers


def test_verify_is_a_list_of_phases():
    import inspect

    from finetune.commands import verify

    assert len(inspect.getsource(verify.verify).splitlines()) <= 40
