"""The import graph: no circle among the project's modules; the training library (eagle3/train/)
reaches no stage glue (:data:`STAGE_GLUE`); the offline extract stage (stages/extract.py and every
module of eagle3/extract/) reaches no online module (eagle3.online*), not even through an import
inside a function.

A static scan: every ``import`` / ``from ... import`` statement of a module, at any depth of its
code (this project imports lazily inside functions), is followed transitively through the
project's own modules (eagle3.*; eagle3.stages.* is the checkout's stages/). A subprocess that imports the modules would see only
their top-level imports."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("eagle3",)


def _module_file(root: Path, name: str):
    parts = name.split(".")
    if parts[:2] == ["eagle3", "stages"]:  # the wheel's eagle3.stages is the checkout's top-level stages/
        parts = parts[1:]
    p = root.joinpath(*parts)
    if (p / "__init__.py").is_file():
        return p / "__init__.py"
    if p.with_suffix(".py").is_file():
        return p.with_suffix(".py")
    return None


def _statements(name: str, path: Path):
    """(module, names) of every import statement of ``name`` (file ``path``), at any depth of its code:
    ``import a.b`` is ("a.b", None), ``from a import b, c`` is ("a", ["b", "c"]) with relative
    imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            yield base, [a.name for a in node.names]


def _imports(root: Path, name: str, path: Path, packages: bool = True) -> set:
    """The project modules ``name`` (file ``path``) imports anywhere in its code; ``from a import b``
    counts ``a`` and, when it is a module, ``a.b``; relative imports are resolved. ``packages``: the
    packages above each imported module count too (importing them runs their ``__init__``)."""
    found = set()
    for base, names in _statements(name, path):
        found.add(base)
        found |= {f"{base}.{n}" for n in names or ()}
    if packages:  # a.b.c imports its packages a and a.b too
        found |= {".".join(m.split(".")[:k]) for m in found for k in range(1, m.count(".") + 1)}
    return {m for m in found if m.split(".")[0] in PROJECT and _module_file(root, m) is not None}


def reachable(root: Path, start: list) -> dict:
    """module -> the module that first imported it, over everything ``start`` reaches."""
    via, todo = {m: None for m in start}, list(start)
    while todo:
        m = todo.pop()
        for d in sorted(_imports(root, m, _module_file(root, m))):
            if d not in via:
                via[d] = m
                todo.append(d)
    return via


def _chain(via: dict, m: str) -> str:
    out = [m]
    while via[out[-1]] is not None:
        out.append(via[out[-1]])
    return " <- ".join(out)


def extract_modules(root: Path) -> list:
    mods = ["eagle3.stages.extract"]
    for p in sorted((root / "eagle3" / "extract").glob("*.py")):
        mods.append("eagle3.extract" if p.stem == "__init__" else f"eagle3.extract.{p.stem}")
    return mods


def online_reached(root: Path) -> list:
    via = reachable(root, extract_modules(root))
    return [_chain(via, m) for m in sorted(via) if m == "eagle3.online" or m.startswith("eagle3.online.")]


def test_extract_stage_imports_no_online_module():
    assert extract_modules(ROOT)[1:], "no module found under eagle3/extract/"
    assert online_reached(ROOT) == []


@pytest.mark.parametrize("how", ["top", "lazy", "relative", "through"])
def test_the_scan_finds_an_online_import(how, tmp_path):
    """The scan fails on an online import however it is written: at the top, inside a function,
    relative, or through another project module."""
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "__init__.py").write_text("")
    (tmp_path / "stages" / "extract.py").write_text("def run():\n    from eagle3.extract import x\n")
    ext = tmp_path / "eagle3" / "extract"
    (tmp_path / "eagle3" / "online").mkdir(parents=True)
    ext.mkdir()
    for f in (tmp_path / "eagle3" / "__init__.py", tmp_path / "eagle3" / "online" / "__init__.py",
              tmp_path / "eagle3" / "online" / "exchange.py", tmp_path / "eagle3" / "other.py"):
        f.write_text("")
    body = {"top": "from eagle3.online import exchange\n",
            "lazy": "def f():\n    from eagle3.online.exchange import OnlineError\n",
            "relative": "def f():\n    from ..online import exchange\n",
            "through": "from .. import other\n"}[how]
    (ext / "__init__.py").write_text("")
    (ext / "reuse.py").write_text(body)
    if how == "through":
        (tmp_path / "eagle3" / "other.py").write_text("import eagle3.online.exchange\n")
    assert any("eagle3.extract.reuse" in chain for chain in online_reached(tmp_path))


def _modules(root: Path, package: str) -> list:
    return [package if p.stem == "__init__" else f"{package}.{p.stem}"
            for p in sorted(root.joinpath(*package.split(".")).glob("*.py"))]


def test_the_kernels_import_no_other_eagle3_module():
    """eagle3/kernels/ is the floor the train loop and the model stand on: torch and Triton only."""
    mods = _modules(ROOT, "eagle3.kernels")
    assert len(mods) > 3
    found = {m: sorted(d for d in _imports(ROOT, m, _module_file(ROOT, m), packages=False)
                       if not d.startswith("eagle3.kernels")) for m in mods}
    assert found == {m: [] for m in mods}


def test_train_checkpoint_and_inductor_stay_low():
    """The checkpoint's messages need no report (the stage's printing), and inductor.py no package
    __init__: it is what ``import eagle3`` imports first."""
    def explicit(m):
        return _imports(ROOT, m, _module_file(ROOT, m), packages=False)

    assert "eagle3.report" not in explicit("eagle3.train.checkpoint")
    assert explicit("eagle3.train.inductor") == set()


# -- the whole graph: no circle, and the training library free of stage glue ----------------------

# Stage glue: what knows the stage graph, the manifest or another stage's artifacts: the stages and
# their runner, the manifest and the reports read from it, the hidden-state store (extract's output),
# the train stage's inputs (eagle3.train_inputs), and the other stages' libraries (prepare's
# eagle3.data, extract, online, export). eagle3.train trains a draft from what it is handed
# (eagle3.train.loop.TrainInputs) and imports none of it.
STAGE_GLUE = ("eagle3.stages", "eagle3.runner", "eagle3.manifest", "eagle3.report", "eagle3.store",
              "eagle3.train_inputs", "eagle3.data", "eagle3.extract", "eagle3.online", "eagle3.export")


def project_modules(root: Path) -> list:
    """Every module of eagle3/ and of the checkout's stages/ (as eagle3.stages.*)."""
    out = []
    for top, prefix in ((root / "eagle3", ("eagle3",)), (root / "stages", ("eagle3", "stages"))):
        for p in sorted(top.rglob("*.py")):
            parts = (*prefix, *p.relative_to(top).with_suffix("").parts)
            out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def direct_imports(root: Path, name: str) -> set:
    """The project modules ``name`` imports itself, anywhere in its code: ``import a.b`` is a.b,
    ``from a import b`` is a.b when b is a module, else a (a package's own code). Unlike
    :func:`_imports`, a module's parent packages are not counted (Python runs them first, but a
    submodule does not depend on them)."""
    found = set()
    for base, names in _statements(name, _module_file(root, name)):
        if names is None:
            found.add(base)
            continue
        subs = {f"{base}.{n}" for n in names if _module_file(root, f"{base}.{n}") is not None}
        found |= subs if len(subs) == len(names) else subs | {base}
    return {m for m in found if m.split(".")[0] in PROJECT and m != name and _module_file(root, m) is not None}


def import_circles(root: Path) -> list:
    """The circles of the import graph (its strongly connected components of more than one module)."""
    graph = {m: sorted(direct_imports(root, m)) for m in project_modules(root)}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on_stack.discard(comp[-1])
            if len(comp) > 1:
                circles.append(sorted(comp))

    for m in graph:
        if m not in index:
            visit(m)
    return circles


def glue_reached_by_train(root: Path) -> list:
    """The stage glue the modules of eagle3/train/ reach, as import chains. The root package
    ``eagle3`` is not followed: every eagle3 module runs it, and what it imports (inside its
    functions) is its own public API's, not the importer's."""
    start = ["eagle3.train"] + [f"eagle3.train.{p.stem}" for p in sorted((root / "eagle3" / "train").glob("*.py"))
                                if p.stem != "__init__"]
    via, todo = {m: None for m in start}, list(start)
    while todo:
        m = todo.pop()
        if m == "eagle3":
            continue
        for d in sorted(direct_imports(root, m)):
            if d not in via:
                via[d] = m
                todo.append(d)
    return [_chain(via, m) for m in sorted(via) if any(m == g or m.startswith(g + ".") for g in STAGE_GLUE)]


KNOWN_CIRCLES: list = []  # none: a circle that must stay would be named here, so none can grow unseen


def test_no_import_circle():
    assert len(project_modules(ROOT)) > 50 and "eagle3.stages.train" in project_modules(ROOT)
    assert import_circles(ROOT) == KNOWN_CIRCLES


def test_train_imports_no_stage_glue():
    assert glue_reached_by_train(ROOT) == []


def _tree(tmp_path, files: dict) -> Path:
    for rel, text in {"eagle3/__init__.py": "", "eagle3/train/__init__.py": "", **files}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


@pytest.mark.parametrize("how", ["top", "lazy", "relative", "three"])
def test_the_scan_finds_an_import_circle(how, tmp_path):
    """A circle however it is written: at the top, inside a function, relative, through a third module."""
    back = {"top": "from eagle3.config import Config\n", "lazy": "def f():\n    from .config import Config\n",
            "relative": "def f():\n    from . import config\n", "three": "from . import other\n"}[how]
    root = _tree(tmp_path, {"eagle3/config.py": "def to_config():\n    from .preflight import check\n",
                            "eagle3/preflight.py": back, "eagle3/other.py": "import eagle3.config\n"})
    expected = ["eagle3.config", "eagle3.preflight"] + (["eagle3.other"] if how == "three" else [])
    assert import_circles(root) == [sorted(expected)]
    (root / "eagle3" / "preflight.py").write_text("")
    assert import_circles(root) == []


@pytest.mark.parametrize("how", ["lazy", "through", "stages"])
def test_the_scan_finds_stage_glue_in_train(how, tmp_path):
    body = {"lazy": "def f():\n    from ..manifest import Manifest\n", "through": "from ..helpers import x\n",
            "stages": "import eagle3.stages.extract\n"}[how]
    root = _tree(tmp_path, {"eagle3/train/inputs.py": body, "eagle3/manifest.py": "",
                            "eagle3/helpers.py": "def x():\n    from .store import open_hidden_states\n",
                            "eagle3/store.py": "", "stages/__init__.py": "", "stages/extract.py": ""})
    (chain,) = glue_reached_by_train(root)
    assert chain.endswith("eagle3.train.inputs") and chain.split(" <- ")[0] in (
        "eagle3.manifest", "eagle3.store", "eagle3.stages.extract")
