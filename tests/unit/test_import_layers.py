"""The package never imports a peer; its layers import one way: engine <- algorithms, checkpoint <- frontend <- cli,
accelerate (the mirror of Accelerate's modules: front end and public names only),
and every layer may import the neutral torch-only modules (``fullshard.ranks``), which import no layer. No modules
import each other in a circle, inside a package or across src/ (function-level imports count); checkpoint/'s
modules import one way, up its levels (its ``__init__`` docstring). Outside engine/ (benchmarks/ and tests/
aside), engine names come from its surface, ``fullshard.engine`` and its ``__all__``, never from a submodule;
checkpoint names likewise from ``fullshard.checkpoint`` and its ``__all__``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "fullshard"
FORBIDDEN = ("torch.distributed.fsdp", "torch.distributed._composable", "accelerate", "deepspeed", "fairscale")
# Torch-only modules every layer may import; they import nothing of fullshard.
NEUTRAL = {"ranks"}
TOP_LEVEL = "top-level"  # the modules directly in fullshard/ (NEUTRAL aside), as one layer
# Which top-level subpackages each layer may import from (besides itself and NEUTRAL).
ALLOWED = {
    "engine": set(),
    "algorithms": {"engine"},
    "checkpoint": set(),  # torch only, as the engine (docs/design.md)
    "frontend": {"engine", "algorithms", "checkpoint"},
    "cli": {"frontend", "checkpoint", "algorithms", "engine"},
    "utils": {"frontend", "checkpoint", "cli"},  # fullshard.utils: re-exports
    TOP_LEVEL: {"engine", "algorithms", "frontend"},  # fullshard/*.py but ranks.py: re-exports
    # Accelerate's module layout (served as `accelerate`): re-exports of the public surfaces and the front end.
    "accelerate": {
        "frontend",
        "checkpoint",
        "utils",
        "logging",
        "tracking",
        *ast.literal_eval(
            next(
                n.value
                for n in ast.parse((SRC / "__init__.py").read_text()).body
                if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "__all__"
            )
        ),
    },
}


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _module(path: Path, root: Path = SRC) -> str:
    """``fullshard.checkpoint.folder`` for ``SRC/checkpoint/folder.py`` (a package's ``__init__``: the package)."""
    parts = ("fullshard", *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_graph(folder: Path, root: Path = SRC) -> dict[str, set[str]]:
    """Module -> the modules of the same package (``folder``, not its subpackages) it imports, anywhere in it."""
    paths = {_module(p, root): p for p in sorted(folder.glob("*.py")) if p.name != "__init__.py"}
    return {name: {n for n in _imports(path) if n in paths and n != name} for name, path in paths.items()}


def _circle(graph: dict[str, set[str]]) -> list[str]:
    """A circle of imports in ``graph`` (``[a, b, a]``), or ``[]`` when there is none."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str]:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return []
        for dep in sorted(graph[name]):
            if found := visit(dep, [*path, name]):
                return found
        done.add(name)
        return []

    return next((found for name in sorted(graph) if (found := visit(name, []))), [])


def _packages() -> list[Path]:
    return sorted(p.parent for p in SRC.rglob("__init__.py"))


def _source_graph(root: Path = SRC) -> dict[str, set[str]]:
    """Module -> the modules under ``root`` it imports, anywhere in it. ``from fullshard.engine import state`` is
    an edge to the submodule ``fullshard.engine.state``; ``from fullshard.engine import fully_shard`` (a name of
    the package's surface) one to the package, whose ``__init__`` runs."""
    paths = {_module(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in paths)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in paths:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    deps.add(sub if sub in paths and not _binds(paths[node.module], alias.name) else node.module)
        graph[name] = deps - {name}
    return graph


def _binds(init: Path, name: str) -> bool:
    """``init`` (a package's ``__init__``) binds ``name`` itself, so ``from package import name`` takes that."""
    tree = ast.parse(init.read_text())
    return any(
        (a.asname or a.name) == name for n in tree.body if isinstance(n, ast.ImportFrom | ast.Import) for a in n.names
    )


# checkpoint/: the level of each module (docs/design.md, checkpoint/__init__.py); a module imports only modules
# of its level or a lower one: names/errors -> manifest/checksum -> folder -> reader/writer -> transaction ->
# verify/merge/export. A new module gets a level here.
CHECKPOINT_LEVELS = {
    "names": 0, "errors": 0, "files": 0, "boundary": 0, "direct_read": 0,
    "manifest": 1, "checksum": 1, "safe_load": 1, "agreement": 1, "background": 1,
    "folder": 2,
    "reader": 3, "writer": 3,
    "transaction": 4, "rotation": 4,
    "dcp": 5, "verify": 5, "merge": 5, "export": 5, "load_check": 5,
}  # fmt: skip


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_sources_found() -> None:
    assert len(_sources()) > 5


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(SRC)))
def test_no_peer_imports(path: Path) -> None:
    bad = [n for n in _imports(path) if any(n == f or n.startswith(f + ".") for f in FORBIDDEN)]
    assert not bad, f"{path} imports a peer: {bad}"


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(SRC)))
def test_layers_import_one_way(path: Path) -> None:
    parts = path.relative_to(SRC).parts
    layer = TOP_LEVEL if len(parts) == 1 else parts[0]
    if layer not in ALLOWED or (len(parts) == 1 and path.stem in NEUTRAL):
        return
    used = {n.split(".")[1] for n in _imports(path) if n.startswith("fullshard.") and len(n.split(".")) > 1}
    wrong = used - ALLOWED[layer] - {layer} - NEUTRAL
    assert not wrong, f"{path} (layer {layer!r}) imports from {sorted(wrong)}"


@pytest.mark.parametrize("name", sorted(NEUTRAL))
def test_neutral_modules_import_no_layer(name: str) -> None:
    used = [n for n in _imports(SRC / f"{name}.py") if n.startswith("fullshard")]
    assert not used, f"fullshard/{name}.py must import torch only, but imports {used}"


def test_checker_catches_a_peer_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from torch.distributed.fsdp import FullyShardedDataParallel\nimport accelerate\n")
    names = _imports(bad)
    assert any(n.startswith("torch.distributed.fsdp") for n in names)
    assert "accelerate" in names


@pytest.mark.parametrize("folder", _packages(), ids=lambda p: str(p.relative_to(SRC)) or "fullshard")
def test_no_import_circle_inside_a_package(folder: Path) -> None:
    circle = _circle(_package_graph(folder))
    assert not circle, f"{folder}: its modules import each other in a circle: {' -> '.join(circle)}"


def test_no_import_circle_in_src() -> None:
    """Across packages too: the surfaces (``__init__`` re-exports) and the top-level modules included."""
    circle = _circle(_source_graph())
    assert not circle, f"modules of src/ import each other in a circle: {' -> '.join(circle)}"


def test_checker_finds_a_circle_through_a_package_surface(tmp_path: Path) -> None:
    # - Set up: pkg's surface re-exports a.x; a imports the surface's name y, which is b's, and b imports pkg.a
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from fullshard.pkg.a import x\nfrom fullshard.pkg.b import y\n")
    (package / "a.py").write_text("from fullshard.pkg import y\nx = 1\n")
    (package / "b.py").write_text("y = 2\n")
    # - Run / Check: a -> the surface -> a; taking b as a submodule instead has no circle
    assert _circle(_source_graph(tmp_path)) == ["fullshard.pkg", "fullshard.pkg.a", "fullshard.pkg"]
    (package / "a.py").write_text("from fullshard.pkg import b\nx = 1\n")
    assert _circle(_source_graph(tmp_path)) == []


def test_checkpoint_modules_import_up_their_levels() -> None:
    graph = _package_graph(SRC / "checkpoint")
    level = {f"fullshard.checkpoint.{name}": n for name, n in CHECKPOINT_LEVELS.items()}
    assert set(graph) == set(level), f"give each checkpoint module a level: {sorted(set(graph) ^ set(level))}"
    wrong = [f"{m} -> {d}" for m, deps in sorted(graph.items()) for d in sorted(deps) if level[d] > level[m]]
    assert not wrong, f"checkpoint/ modules import a higher level: {wrong}"


def test_checker_finds_a_circle_through_a_function_level_import(tmp_path: Path) -> None:
    # - Set up: a package whose b imports a inside a function, and a imports b at the top
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from fullshard.pkg.b import x\n")
    (package / "b.py").write_text("def f():\n    from fullshard.pkg.a import y\n")
    (package / "c.py").write_text("import fullshard.pkg.a\n")
    # - Run / Check: the circle is found; without the function-level import there is none
    assert _circle(_package_graph(package, tmp_path)) == ["fullshard.pkg.a", "fullshard.pkg.b", "fullshard.pkg.a"]
    (package / "b.py").write_text("def f():\n    pass\n")
    assert _circle(_package_graph(package, tmp_path)) == []


# --- the engine's surface -------------------------------------------------------------------------------------

ENGINE = SRC / "engine"
# (module outside engine/, engine submodule) -> why it reaches past the surface. Keep this short.
INSIDE_ENGINE = {
    ("fullshard.testing.bench", "fullshard.engine.p2p"): (
        "ring_reduce_scatter is the ring that benchmarks/collectives.py measures against p2p's pairwise "
        "reduce-scatter: it returns p2p's work type and sends on p2p's tag"
    ),
}


def _engine_surface() -> set[str]:
    """``fullshard.engine.__all__``, read without importing it."""
    tree = ast.parse((ENGINE / "__init__.py").read_text())
    found = [n.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "__all__"]
    return set(ast.literal_eval(found[0]))


def _engine_submodules() -> set[str]:
    return {p.stem for p in ENGINE.glob("*.py") if p.name != "__init__.py"}


def _reaches_inside_engine(path: Path, surface: set[str], submodules: set[str]) -> list[str]:
    """The engine submodules ``path`` imports, and the names it imports from ``fullshard.engine`` that are not on
    its surface (``from fullshard.engine import state`` is a submodule too)."""
    bad: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            bad.extend(a.name for a in node.names if a.name.startswith("fullshard.engine."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("fullshard.engine."):
                bad.append(node.module)
            elif node.module == "fullshard.engine":
                for alias in node.names:
                    if alias.name in submodules and alias.name not in surface:
                        bad.append(f"fullshard.engine.{alias.name}")
                    elif alias.name not in surface:
                        bad.append(f"fullshard.engine.{alias.name} (not in fullshard.engine.__all__)")
    return bad


def _outside_engine() -> list[Path]:
    return [p for p in _sources() if ENGINE not in p.parents]


@pytest.mark.parametrize("path", _outside_engine(), ids=lambda p: str(p.relative_to(SRC)))
def test_other_packages_use_the_engine_surface(path: Path) -> None:
    module = _module(path)
    bad = [
        n
        for n in _reaches_inside_engine(path, _engine_surface(), _engine_submodules())
        if (module, n) not in INSIDE_ENGINE
    ]
    assert not bad, (
        f"{path} imports from inside the engine: {bad}; import the name from fullshard.engine (add it to "
        "engine/__init__.py's __all__ if it is missing)"
    )


def test_engine_exemptions_are_still_used() -> None:
    for module, target in INSIDE_ENGINE:
        path = SRC.joinpath(*module.split(".")[1:]).with_suffix(".py")
        assert target in _reaches_inside_engine(path, _engine_surface(), _engine_submodules()), (
            f"{module} no longer imports {target}: drop it from INSIDE_ENGINE"
        )


def test_engine_surface_is_re_exports_only() -> None:
    # - Set up: what engine/__init__.py binds, and what it lists
    tree = ast.parse((ENGINE / "__init__.py").read_text())
    bound = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    others = [n for n in tree.body if not isinstance(n, ast.ImportFrom | ast.Assign | ast.Expr)]
    # - Check: every imported name is listed and every listed name imported, from a submodule; no logic
    assert bound == _engine_surface(), (
        f"imported but not in __all__, or listed but not imported: {bound ^ _engine_surface()}"
    )
    assert not others, "engine/__init__.py holds re-exports only"
    sources = {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert all(m and m.startswith("fullshard.engine.") for m in sources), sources


def test_engine_modules_never_import_the_surface() -> None:
    """The surface imports every engine module; an engine module that took a name from it would see it half built
    when imported first. ``from fullshard.engine import state_dict`` (a submodule) is fine."""
    submodules = _engine_submodules()
    bad = [
        f"{path.name}: {alias.name}"
        for path in sorted(ENGINE.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module == "fullshard.engine"
        for alias in node.names
        if alias.name not in submodules
    ]
    assert not bad, f"engine modules import from the engine's surface: {bad}"


def test_checker_catches_a_reach_inside_the_engine(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from fullshard.engine import ShardingStrategy, group\n"
        "from fullshard.engine.state import unit_state\n"
        "import fullshard.engine.param\n"
        "def f():\n    from fullshard.engine import not_public\n"
    )
    found = _reaches_inside_engine(bad, {"ShardingStrategy"}, {"group", "state", "param"})
    assert sorted(found) == [
        "fullshard.engine.group",
        "fullshard.engine.not_public (not in fullshard.engine.__all__)",
        "fullshard.engine.param",
        "fullshard.engine.state",
    ]


# --- checkpoint/'s surface ------------------------------------------------------------------------------------

CHECKPOINT = SRC / "checkpoint"


def _surface(package: Path) -> set[str]:
    """``__all__`` of ``package``'s ``__init__``, read without importing it."""
    tree = ast.parse((package / "__init__.py").read_text())
    found = [n.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "__all__"]
    return set(ast.literal_eval(found[0]))


def _reaches_inside(path: Path, package: str, surface: set[str]) -> list[str]:
    """The submodules of ``fullshard.<package>`` that ``path`` imports, and the names it imports from the package
    that are not on its surface (a submodule on the surface, such as ``background``, is a name of it)."""
    prefix = f"fullshard.{package}"
    bad: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            bad.extend(a.name for a in node.names if a.name.startswith(prefix + "."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith(prefix + "."):
                bad.append(node.module)
            elif node.module == prefix:
                bad.extend(f"{prefix}.{a.name} (not in __all__)" for a in node.names if a.name not in surface)
    return bad


@pytest.mark.parametrize(
    "path", [p for p in _sources() if CHECKPOINT not in p.parents], ids=lambda p: str(p.relative_to(SRC))
)
def test_other_packages_use_the_checkpoint_surface(path: Path) -> None:
    bad = _reaches_inside(path, "checkpoint", _surface(CHECKPOINT))
    assert not bad, (
        f"{path} imports from inside checkpoint/: {bad}; import the name from fullshard.checkpoint (add it to "
        "checkpoint/__init__.py's __all__ if other packages need it)"
    )


def test_checkpoint_surface_is_re_exports_only() -> None:
    tree = ast.parse((CHECKPOINT / "__init__.py").read_text())
    bound = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    others = [n for n in tree.body if not isinstance(n, ast.ImportFrom | ast.Assign | ast.Expr)]
    assert bound == _surface(CHECKPOINT), (
        f"imported but not listed, or listed but not imported: {bound ^ _surface(CHECKPOINT)}"
    )
    assert not others, "checkpoint/__init__.py holds re-exports only"


def test_checkpoint_modules_never_import_the_surface() -> None:
    """The surface imports every module it re-exports; a checkpoint module taking a name from it would see it
    half built when imported first."""
    bad = [
        f"{path.name}: {alias.name}"
        for path in sorted(CHECKPOINT.glob("*.py"))
        if path.name != "__init__.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module == "fullshard.checkpoint"
        for alias in node.names
    ]
    assert not bad, f"checkpoint modules import from checkpoint's surface: {bad}"


def test_checker_catches_a_reach_inside_checkpoint(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from fullshard.checkpoint import SaveTransaction, folder\n"
        "from fullshard.checkpoint.names import staging_folder\n"
        "def f():\n    import fullshard.checkpoint.verify\n"
    )
    assert sorted(_reaches_inside(bad, "checkpoint", {"SaveTransaction"})) == [
        "fullshard.checkpoint.folder (not in __all__)",
        "fullshard.checkpoint.names",
        "fullshard.checkpoint.verify",
    ]


# --- ".incomplete" and ".previous": the suffixes of checkpoint/names.py only ----------------------------------


def _string_constants(path: Path) -> list[str]:
    """Every string constant of ``path`` but the docstrings (f-string pieces included)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    ]


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(SRC)))
def test_staging_suffixes_are_spelled_in_names_only(path: Path) -> None:
    if path == CHECKPOINT / "names.py":
        return
    found = [c for c in _string_constants(path) if ".incomplete" in c or ".previous" in c]
    assert not found, f"{path} spells a staging suffix itself: {found}; use checkpoint.names (staging_folder, ...)"


def test_checker_finds_a_spelled_suffix(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('"""Staged in ``dir.incomplete``."""\n\ndef f(p):\n    return p.with_name(f"{p.name}.incomplete")\n')
    found = [c for c in _string_constants(bad) if ".incomplete" in c]
    assert found == [".incomplete"]  # the f-string's piece; the docstring is prose
