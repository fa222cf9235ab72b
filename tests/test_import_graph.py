"""The import graph: the offline extract stage (stages/extract.py and every module of eagle3/extract/)
reaches no online module (eagle3.online*), not even through an import inside a function.

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


def _imports(root: Path, name: str, path: Path, packages: bool = True) -> set:
    """The project modules ``name`` (file ``path``) imports anywhere in its code; ``from a import b``
    counts ``a`` and, when it is a module, ``a.b``; relative imports are resolved. ``packages``: the
    packages above each imported module count too (importing them runs their ``__init__``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
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
