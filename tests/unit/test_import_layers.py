"""The package never imports a peer; its layers import one way: engine <- algorithms, checkpoint <- frontend <- cli,
accelerate (the mirror of Accelerate's modules: front end and public names only),
and every layer may import the neutral torch-only modules (``fullshard.ranks``), which import no layer. No modules
import each other in a circle, inside a package or across src/ (function-level imports count); checkpoint/'s
modules import one way, up its levels (its ``__init__`` docstring). Outside engine/ (benchmarks/ and tests/
aside), engine names come from its surface, ``fullshard.engine`` and its ``__all__``, never from a submodule;
checkpoint names likewise from ``fullshard.checkpoint`` and its ``__all__``. Above algorithms/, objects too: the
surface names imported there hand out no internal engine object, and no code there reads an attribute only the
engine's internal classes have. The front end follows its rule (``frontend/__init__.py``): a folder holds three
modules or more, a flat module has a topic (``FRONTEND_TOPICS``) with fewer than three flat modules and no folder,
and every module is the Accelerator's, its plugin's or one a public module imports (what only the CLI uses is
cli/'s). ``docs/design.md`` lists every module of src/, no more and no less."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "fullshard"
FORBIDDEN = ("torch.distributed.fsdp", "torch.distributed._composable", "accelerate", "deepspeed", "fairscale")
# Torch-only (or standard-library-only) modules every layer may import; they import nothing of fullshard.
NEUTRAL = {"ranks", "surface"}
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
    """Module -> the modules under ``root`` it imports, anywhere in it. ``from fullshard.engine import unit_state`` is
    an edge to the submodule ``fullshard.engine.unit_state``; ``from fullshard.engine import fully_shard`` (a name of
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
    """``init`` (a package's ``__init__``) binds ``name`` itself, so ``from package import name`` takes that (its
    re-exports, eager or in the ``if TYPE_CHECKING:`` table that ``fullshard.surface`` imports on first use)."""
    return any((a.asname or a.name) == name for n in _top_level(ast.parse(init.read_text())) for a in n.names)


def _top_level(tree: ast.Module) -> list[ast.ImportFrom | ast.Import]:
    """The imports of a module's body, those of its ``if TYPE_CHECKING:`` block included (a lazy surface's table)."""
    body = [*tree.body, *(s for n in tree.body if isinstance(n, ast.If) for s in n.body)]
    return [n for n in body if isinstance(n, ast.ImportFrom | ast.Import)]


_LAZY_SURFACE = "__getattr__, __dir__ = lazy_surface(__name__, __file__)"


def _re_exports(tree: ast.Module) -> tuple[list[ast.ImportFrom], list[ast.stmt]]:
    """A surface's re-exports (the ``if TYPE_CHECKING:`` table of ``fullshard.surface.lazy_surface``) and the
    statements of its body that are neither these, nor ``__all__``, a docstring, or the lazy surface's lines."""
    exports: list[ast.ImportFrom] = []
    others: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            exports += [n for n in node.body if isinstance(n, ast.ImportFrom)]
            others += [n for n in node.body if not isinstance(n, ast.ImportFrom)]
        elif isinstance(node, ast.ImportFrom) and node.module in ("typing", "fullshard.surface"):
            continue  # TYPE_CHECKING, lazy_surface
        elif isinstance(node, ast.Assign) and ast.unparse(node) == _LAZY_SURFACE:
            continue
        elif isinstance(node, ast.ImportFrom):
            exports.append(node)
        elif not isinstance(node, ast.Assign | ast.Expr):
            others.append(node)
    return exports, others


# checkpoint/: the level of each module (docs/design.md, checkpoint/__init__.py); a module imports only modules
# of its level or a lower one: names/errors -> manifest/checksum -> folder -> reader/writer -> transaction ->
# verify/merge/export. A new module gets a level here.
CHECKPOINT_LEVELS = {
    "names": 0, "errors": 0, "files": 0, "boundary": 0, "direct_read": 0,
    "manifest": 1, "checksum": 1, "safe_load": 1, "agreement": 1, "background": 1,
    "folder": 2,
    "reader": 3, "writer": 3,
    "transaction": 4, "rotation": 4,
    "dcp": 5, "verify": 5, "merge": 5, "export": 5, "load_check": 5, "training_save": 5,
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
    its surface (``from fullshard.engine import unit_state`` is a submodule too)."""
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
    exports, others = _re_exports(ast.parse((ENGINE / "__init__.py").read_text()))
    bound = {a.asname or a.name for n in exports for a in n.names}
    # - Check: every imported name is listed and every listed name imported, from a submodule; no logic
    assert bound == _engine_surface(), (
        f"imported but not in __all__, or listed but not imported: {bound ^ _engine_surface()}"
    )
    assert not others, "engine/__init__.py holds re-exports only"
    sources = {n.module for n in exports}
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
        "from fullshard.engine.unit_state import unit_state\n"
        "import fullshard.engine.param\n"
        "def f():\n    from fullshard.engine import not_public\n"
    )
    found = _reaches_inside_engine(bad, {"ShardingStrategy"}, {"group", "unit_state", "param"})
    assert sorted(found) == [
        "fullshard.engine.group",
        "fullshard.engine.not_public (not in fullshard.engine.__all__)",
        "fullshard.engine.param",
        "fullshard.engine.unit_state",
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
    exports, others = _re_exports(ast.parse((CHECKPOINT / "__init__.py").read_text()))
    bound = {a.asname or a.name for n in exports for a in n.names}
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


# --- engine objects: the layers above algorithms/ hold none that is not on the engine's surface ----------------
#
# Importing names from the surface only is not enough: a surface function that returned a unit's state would hand
# the front end every internal object behind it (``state.group.shard_group.data_parallel_size``). Two checks close
# that: the surface hands out no object of an engine class that is not on it (the return annotations of its
# functions and of its classes' public members), and the code above algorithms/ reads no attribute that only the
# engine's internal classes define (``sp.sharded_param``), nor a chain of them (``s.config.invariant_micro_batches``:
# ``invariant_micro_batches`` is also the plugin's field, so the chain tells). algorithms/ works on the engine's
# objects by design (docs/design.md), testing/ may use anything, and checkpoint/ imports no engine.

ABOVE_ALGORITHMS = ("frontend", "accelerate", "cli", "utils")  # and the top-level modules
# An attribute of the engine's internal classes that the layers above may read on their own objects -> why. It
# stays checked as a link of a chain (``state.config.invariant_micro_batches``). Keep this short.
ENGINE_ATTRIBUTE_EXEMPTIONS = {
    "config": "a transformers model's configuration (getattr(model, 'config', None)), not a unit's UnitConfig",
}


def _engine_classes() -> dict[str, ast.ClassDef]:
    return {
        node.name: node
        for path in sorted(ENGINE.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    }


def _members(cls: ast.ClassDef) -> tuple[set[str], set[str], set[str]]:
    """``cls``'s methods and properties; its data attributes (class-level names, ``self.x = ...`` anywhere in it);
    of the latter, those set at class level (an enum's members, a dataclass's fields). Dunders aside."""
    methods, data, class_level = set(), set(), set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            methods.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            class_level.add(node.target.id)
        elif isinstance(node, ast.Assign):
            class_level.update(t.id for t in node.targets if isinstance(t, ast.Name))
    data |= class_level
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        data.update(
            t.attr
            for t in targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
        )
    dunder = {n for n in methods | data if n.startswith("__") and n.endswith("__")}
    return methods - dunder, data - dunder - methods, class_level - dunder


def _common_attributes() -> set[str]:
    """What a module, a tensor or a DTensor answers to: a name the engine's classes share with those says nothing."""
    from torch import Tensor, nn
    from torch.distributed.tensor import DTensor

    return set(dir(nn.Module)) | set(vars(nn.Module())) | set(dir(Tensor)) | set(dir(DTensor))


@functools.cache
def _engine_attributes(sources: tuple[Path, ...]) -> tuple[set[str], set[str], set[str], set[str]]:
    """(methods, data attributes) that only the engine's internal classes (and the private state of its surface
    classes) define: no class in ``sources`` (the code outside engine/), no public member of a surface class, no
    module or tensor; the internal classes' data attributes that may start a chain; and every member of theirs,
    which may end one."""
    surface = _engine_surface()
    internal_methods, internal_data, public, private = set(), set(), set(), set()
    for name, cls in _engine_classes().items():
        methods, data, class_level = _members(cls)
        if name in surface:
            public |= {n for n in methods | data if not n.startswith("_")} | class_level
            private |= {n for n in methods | data if n.startswith("_")} - class_level
        else:
            internal_methods |= methods
            internal_data |= data
    outside = set()
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods, data, _ = _members(node)
                outside |= methods | data
    shared = outside | public | _common_attributes()
    private_methods = {n for n in private if any(n in _members(c)[0] for c in _engine_classes().values())}
    return (
        (internal_methods | private_methods) - shared,
        (internal_data | private - private_methods) - shared,
        internal_data - public - _common_attributes(),
        internal_methods | internal_data,
    )


def _outside_engine_sources() -> tuple[Path, ...]:
    return tuple(p for p in _sources() if ENGINE not in p.parents)


def _engine_attribute_reads(
    path: Path, methods: set[str], data: set[str], chain: set[str], members: set[str]
) -> list[str]:
    """``line: expression`` for each read in ``path`` of an attribute in ``methods`` or ``data`` (a data attribute
    that is called is some other object's method: ``match.group(0)``), or of any engine attribute on a ``chain``
    attribute (``state.config.x``), ``getattr(obj, "name")`` included; a name bound by ``import`` (a module, such
    as ``dist.group``) is no engine object."""
    tree = ast.parse(path.read_text(), filename=str(path))
    modules = {
        (a.asname or a.name).split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
        if isinstance(n, ast.Import) or not (n.module or "").startswith("fullshard")
    }
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            receiver, name = node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            receiver, name = node.args[0], node.args[1].value
        else:
            continue
        if isinstance(receiver, ast.Name) and receiver.id in modules:
            continue
        own = name in methods or (name in data and id(node) not in called)
        chained = isinstance(receiver, ast.Attribute) and receiver.attr in chain and name in members
        if own or chained:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def _checked_reads(path: Path) -> list[str]:
    """:func:`_engine_attribute_reads` of ``path`` as the layers above algorithms/ are checked (exemptions applied)."""
    methods, data, chain, members = _engine_attributes(_outside_engine_sources())
    exempt = set(ENGINE_ATTRIBUTE_EXEMPTIONS)
    return _engine_attribute_reads(path, methods - exempt, data - exempt, chain, members)


def _above_algorithms() -> list[Path]:
    return [
        p
        for p in _sources()
        if (len(p.relative_to(SRC).parts) == 1 and p.stem not in NEUTRAL)
        or p.relative_to(SRC).parts[0] in ABOVE_ALGORITHMS
    ]


def _surface_definitions() -> dict[str, ast.FunctionDef | ast.ClassDef]:
    """Each name of the engine's surface -> its definition (``from fullshard.engine.x import a as b``: ``a`` in x)."""
    found: dict[str, ast.FunctionDef | ast.ClassDef] = {}
    for node in _re_exports(ast.parse((ENGINE / "__init__.py").read_text()))[0]:
        if node.module:
            tree = ast.parse((ENGINE / f"{node.module.rsplit('.', 1)[1]}.py").read_text())
            defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
            found.update({a.asname or a.name: defs[a.name] for a in node.names if a.name in defs})
    return found


def _hands_out(returns: ast.expr | None, internal: set[str]) -> set[str]:
    """The internal engine classes named in a return annotation (``None``: not annotated)."""
    if returns is None:
        return {"<no return annotation>"}
    return {n.id for n in ast.walk(returns) if isinstance(n, ast.Name) and n.id in internal} | {
        n.attr for n in ast.walk(returns) if isinstance(n, ast.Attribute) and n.attr in internal
    }


def _engine_names_imported(paths: list[Path]) -> set[str]:
    return {
        alias.name
        for path in paths
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module == "fullshard.engine"
        for alias in node.names
    }


def test_engine_surface_hands_out_no_internal_object_above_algorithms() -> None:
    """algorithms/ works on the engine's objects (``model_params``, the comm hooks' work handles); what the layers
    above it import from the surface hands out plain values, or objects of classes on the surface."""
    # - Set up: the engine's classes that are not on its surface; the surface names the layers above import
    internal = set(_engine_classes()) - _engine_surface()
    used = _engine_names_imported(_above_algorithms())
    # - Check: those functions, and those classes' public methods and properties, return none of the internal ones
    bad = []
    for name, node in sorted(_surface_definitions().items()):
        if name not in used:
            continue
        if isinstance(node, ast.FunctionDef):
            bad.extend(f"{name}() -> {t}" for t in sorted(_hands_out(node.returns, internal)))
        else:
            for member in node.body:
                if isinstance(member, ast.FunctionDef) and not member.name.startswith("_") and member.returns:
                    bad.extend(f"{name}.{member.name} -> {t}" for t in sorted(_hands_out(member.returns, internal)))
    assert internal and not bad, (
        f"the engine's surface hands out engine objects that are not on it: {bad}; return plain values (a bool, a "
        "number, the parameters), or put the class on the surface"
    )


@pytest.mark.parametrize("path", _above_algorithms(), ids=lambda p: str(p.relative_to(SRC)))
def test_no_reads_of_engine_internals_above_algorithms(path: Path) -> None:
    bad = _checked_reads(path)
    assert not bad, (
        f"{path} reads attributes that only the engine's internal objects have: {bad}; ask the engine's surface "
        "for the value instead (a function in fullshard.engine's __all__ that returns it)"
    )


def test_engine_attribute_exemptions_are_still_needed() -> None:
    methods, data, chain, members = _engine_attributes(_outside_engine_sources())
    reads = [r for p in _above_algorithms() for r in _engine_attribute_reads(p, methods, data, chain, members)]
    for name in ENGINE_ATTRIBUTE_EXEMPTIONS:
        assert name in methods | data, f"{name!r} is no engine-only attribute any more: drop its exemption"
        assert any(f".{name}" in r or f"'{name}'" in r for r in reads), f"nothing reads {name!r}: drop its exemption"


def test_checker_finds_reads_of_engine_internals(tmp_path: Path) -> None:
    # - Set up: the reaches the front end once made, and look-alikes that are not engine objects
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import re\nimport torch.distributed as dist\n"
        "def f(s, sp, model, plugin, text):\n"
        "    n = s.config.invariant_micro_batches // s.group.shard_group.data_parallel_size\n"
        "    managed = [p.sharded_param for p in s.group.params]\n"
        "    g = getattr(s, 'group')\n"
        "    ok = (plugin.invariant_micro_batches, model.config.vocab_size, dist.group.WORLD,\n"
        "          re.match('a', text).group(0), model.module.training)\n"
    )
    # - Run
    found = _checked_reads(bad)
    # - Check: each reach is named, and no look-alike is
    assert {f for f in found if f.startswith("4:")} >= {
        "4: s.config.invariant_micro_batches",
        "4: s.group",
        "4: s.group.shard_group",
        "4: s.group.shard_group.data_parallel_size",
    }
    assert {"5: p.sharded_param", "5: s.group.params", "6: getattr(s, 'group')"} <= set(found)
    assert not [f for f in found if f.startswith(("7:", "8:"))], found


def test_checker_finds_a_surface_that_hands_out_an_engine_object() -> None:
    tree = ast.parse("def unit_state(m) -> UnitState | None: ...\ndef f(m): ...\ndef g(m) -> int: ...\n")
    returns = [n.returns for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert [_hands_out(r, {"UnitState"}) for r in returns] == [{"UnitState"}, {"<no return annotation>"}, set()]


# --- the front end's rule (frontend/__init__.py) ----------------------------------------------------------------

FRONTEND = SRC / "frontend"
# Each flat module of frontend/ -> its topic. A topic of three or more modules is a folder named for it, so no topic
# here has three modules, nor a folder's name. A new flat module gets a topic here (or goes into its topic's folder).
FRONTEND_TOPICS = {
    "accelerator": "accelerator", "one_process": "accelerator",
    "plugin": "plugin", "plugin_values": "plugin",
    "prepare": "prepare",
    "optim": "optimizer",
    "training": "training", "training_step": "training",
    "invariant": "invariant",
    "compile": "compile",
    "adapters": "peft",
    "parallelism": "parallelism",
    "project": "project",
    "preemption": "preemption",
    "enums": "enums",
    "ops": "operations",
    "memory": "memory",
    "trackers": "tracking", "tracker_selection": "tracking",
    "env": "launch environment", "launch_helpers": "launch environment",
    "availability": "installed packages", "versions": "installed packages",
    "refused": "refused",
}  # fmt: skip
# The packages whose imports make a front-end module an Accelerate utility: the public modules (fullshard and its
# top-level modules, fullshard.utils) and the mirror of Accelerate's module paths.
PUBLIC_PACKAGES = ("fullshard.utils", "fullshard.accelerate")


def _frontend_folders(root: Path = FRONTEND) -> dict[str, list[str]]:
    """Each folder (a package) under ``root`` -> its modules, ``__init__`` aside."""
    return {
        str(p.parent.relative_to(root)): sorted(m.stem for m in p.parent.glob("*.py") if m.name != "__init__.py")
        for p in sorted(root.rglob("__init__.py"))
        if p.parent != root
    }


def _topic_problems(flat: set[str], topics: dict[str, str], folders: set[str]) -> list[str]:
    """What breaks the rule among the flat modules ``flat`` of the front end, given their ``topics``."""
    problems = [f"{m}: give it a topic in FRONTEND_TOPICS" for m in sorted(flat - set(topics))]
    problems += [f"{m}: in FRONTEND_TOPICS but no flat module" for m in sorted(set(topics) - flat)]
    by_topic: dict[str, list[str]] = {}
    for module in sorted(flat & set(topics)):
        by_topic.setdefault(topics[module], []).append(module)
    for topic, modules in sorted(by_topic.items()):
        if len(modules) >= 3:
            problems.append(f"topic {topic!r} has {len(modules)} flat modules {modules}: make it a folder")
        if topic in folders:
            problems.append(f"topic {topic!r} is a folder: move {modules} into {topic}/")
    return problems


def test_frontend_folders_hold_three_modules_or_more() -> None:
    small = {name: modules for name, modules in _frontend_folders().items() if len(modules) < 3}
    assert not small, f"a folder of frontend/ holds fewer than three modules (make them flat): {small}"


def test_frontend_flat_modules_have_a_topic_of_fewer_than_three() -> None:
    flat = {p.stem for p in FRONTEND.glob("*.py") if p.name != "__init__.py"}
    problems = _topic_problems(flat, FRONTEND_TOPICS, set(_frontend_folders()))
    assert not problems, f"frontend/'s flat modules break its rule: {problems}"


def _unused_by_accelerator_or_public(root: Path = SRC) -> list[str]:
    """The front-end modules that neither the Accelerator nor its plugin reach, nor a public module imports (nor
    reaches through front-end modules it imports): what only the CLI uses, or nothing."""
    graph = _source_graph(root)
    package = "fullshard.frontend"
    inside = {m for m in graph if m.startswith(package + ".")}
    public = {_module(p, root) for p in root.glob("*.py")} | {m for m in graph if m.startswith(PUBLIC_PACKAGES)}
    roots = {f"{package}.accelerator", f"{package}.plugin"} | {d for m in public for d in graph[m] if d in inside}
    seen: set[str] = set()
    todo = sorted(roots & inside)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(d for d in graph[module] if d in inside)
    packages = {m for m in inside if (root.joinpath(*m.split(".")[1:]) / "__init__.py").exists()}
    return sorted(inside - seen - packages)


def test_frontend_modules_are_the_accelerators_or_accelerate_utilities() -> None:
    unused = _unused_by_accelerator_or_public()
    assert not unused, (
        f"{unused}: neither the Accelerator, its plugin nor a public module (fullshard, fullshard.utils, "
        "fullshard.accelerate) uses them; what only the CLI uses lives in cli/"
    )


def test_checker_finds_a_small_folder_a_crowded_topic_and_a_cli_only_module(tmp_path: Path) -> None:
    # - Set up: a front end with a two-module folder, three flat modules of one topic, one a folder's topic, and
    #   a module only the CLI imports
    front = tmp_path / "frontend"
    (front / "small").mkdir(parents=True)
    for name in ("__init__", "accelerator", "plugin", "a1", "a2", "a3", "b", "cli_only", "small/__init__"):
        (front / f"{name}.py").write_text("")
    (front / "accelerator.py").write_text(
        "from fullshard.frontend import a1, a2\nfrom fullshard.frontend.small import x\n"
    )
    (front / "small" / "x.py").write_text("from fullshard.frontend import b\n")
    (front / "small" / "y.py").write_text("")
    (tmp_path / "utils").mkdir()
    (tmp_path / "utils" / "__init__.py").write_text("from fullshard.frontend.a3 import f\n")
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "__init__.py").write_text("from fullshard.frontend.cli_only import g\n")
    # - Run
    folders = _frontend_folders(front)
    flat = {"accelerator", "plugin", "a1", "a2", "a3", "b", "cli_only"}
    topics = {"accelerator": "accelerator", "plugin": "plugin", "a1": "a", "a2": "a", "a3": "a", "b": "small"}
    problems = _topic_problems(flat, topics, set(folders))
    unused = _unused_by_accelerator_or_public(tmp_path)
    # - Check: each break of the rule is found, and nothing else
    assert folders == {"small": ["x", "y"]}
    assert problems == [
        "cli_only: give it a topic in FRONTEND_TOPICS",
        "topic 'a' has 3 flat modules ['a1', 'a2', 'a3']: make it a folder",
        "topic 'small' is a folder: move ['b'] into small/",
    ]
    assert unused == ["fullshard.frontend.cli_only", "fullshard.frontend.small.y"]


def _design_module_list(text: str) -> set[str]:
    """The modules ``docs/design.md``'s "Every module" block names, as paths under ``src/fullshard``."""
    block = text.split("### Every module", 1)[1].split("```", 2)[1]
    listed: set[str] = set()
    package = ""
    for line in block.strip("\n").splitlines():
        if not line.startswith(" "):
            package = "" if line.split()[0] == "fullshard/" else line.split()[0]
        elif line.strip():
            listed.add(f"{package}{line.split()[0]}.py")
    return listed


def test_design_lists_every_module() -> None:
    design = SRC.parents[1] / "docs" / "design.md"
    listed = _design_module_list(design.read_text())
    actual = {str(p.relative_to(SRC)) for p in _sources()}
    assert listed == actual, (
        f"docs/design.md's 'Every module' list: missing {sorted(actual - listed)}, gone {sorted(listed - actual)}"
    )


def test_checker_reads_the_design_module_list() -> None:
    text = "x\n### Every module\n\ntext\n```\nfullshard/ (top)\n  ranks  r\nengine/\n  __init__  s\n  api  a\n```\n"
    assert _design_module_list(text) == {"ranks.py", "engine/__init__.py", "engine/api.py"}
