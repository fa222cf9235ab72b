"""A wheel of eagle3 carries its configs and data and runs from any directory, reading them from the
installed package rather than from a checkout. Built offline from a copy of the sources, installed
into a scratch virtualenv that borrows the running interpreter's torch, transformers and Hydra.

The borrowing goes through a ``.pth`` file naming the running interpreter's site directories, not
``venv --system-site-packages``: when the tests themselves run inside a virtualenv (as most users'
do), ``--system-site-packages`` shows the scratch venv the *base* interpreter's packages, not the
user's venv's. The test runs once from the interpreter as it is and once from a virtualenv made on it,
so a plain (non-venv) CI covers the virtualenv case too."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# what the build reads: pyproject.toml names README.md (readme) and LICENSE (license files)
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "eagle3", "stages", "conf")


def _run(args, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, **kw)
    assert r.returncode == 0, f"{args} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _expected_files() -> set[str]:
    """Every module of the repo's packages and every config and data file, as the wheel names them."""
    out = {str(p.relative_to(REPO)) for p in (REPO / "eagle3").rglob("*.py")}
    out |= {"eagle3/stages/" + str(p.relative_to(REPO / "stages")) for p in (REPO / "stages").rglob("*.py")}
    out |= {"eagle3/conf/" + str(p.relative_to(REPO / "conf")) for p in (REPO / "conf").rglob("*.yaml")}
    out |= {str(p.relative_to(REPO)) for p in (REPO / "eagle3" / "data" / "builtin").glob("*.jsonl")}
    return out


def _site_dirs(py) -> list[str]:
    """The directories ``py`` imports installed packages from (a venv's own and, with
    ``--system-site-packages``, its base's), in its order."""
    code = "import sys; print('\\n'.join(p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))))"
    return _run([str(py), "-c", code]).stdout.split("\n")[:-1]


def _venv_borrowing(parent, where: Path) -> Path:
    """A virtualenv at ``where`` whose own site-packages comes first, then ``parent``'s site
    directories (read by path: ``parent``'s .pth files, e.g. an editable eagle3, stay out)."""
    _run([str(parent), "-m", "venv", str(where)])
    py = where / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    (site / "_eagle3_test_parent_site.pth").write_text("\n".join(_site_dirs(parent)) + "\n")
    return py


@pytest.fixture(params=["interpreter", "virtualenv"])
def parent_python(request, tmp_path):
    """The interpreter the user installed eagle3's dependencies into, and the modules to look up
    through it: this interpreter, or a virtualenv made on it (``--system-site-packages``, as a user's
    venv that sees the system's torch would be) with a module installed in the venv alone."""
    modules = ["hydra", "omegaconf", "transformers", "torch"]
    if request.param == "interpreter":
        return Path(sys.executable), modules
    user_venv = tmp_path / "user-venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(user_venv)])
    py = user_venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    (site / "eagle3_user_venv_only.py").write_text("")  # what the user pip-installed into the venv
    return py, modules + ["eagle3_user_venv_only"]


def test_wheel_carries_conf_and_runs_from_elsewhere(tiny_llama_dir, tmp_path, parent_python):
    src = tmp_path / "src"  # a copy: an in-tree build would leave build/ and *.egg-info in the checkout
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(REPO / name, src / name)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)])
    (wheel,) = dist.glob("eagle3-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    missing = _expected_files() - names
    assert not missing, f"left out of the wheel: {sorted(missing)}"
    # eagle3 alone at the top: a package `stages` beside it would clash with any other of that name
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"eagle3"}

    parent, modules = parent_python
    py = _venv_borrowing(parent, tmp_path / "venv")
    where_from = f"import importlib; print(*(importlib.import_module(m).__file__ for m in {modules!r}))"
    assert _run([str(py), "-c", where_from]).stdout == _run([str(parent), "-c", where_from]).stdout
    # --force-reinstall: the system may hold eagle3 of the same version (an editable install)
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--force-reinstall", str(wheel)])
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    installed_conf = site / "eagle3" / "conf"

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the tests' checkout stays out of the path
    env["OMP_NUM_THREADS"] = "1"

    def cli(*args):
        return _run([str(py), "-m", "eagle3", *args], cwd=elsewhere, env=env)

    assert "stage" in cli("--help").stdout
    where = _run([str(py), "-c", "import eagle3.config as c; print(c.__file__); print(c.CONF_DIR)"], cwd=elsewhere,
                 env=env).stdout.split()
    assert where == [str(site / "eagle3" / "config.py"), str(installed_conf)]
    stages = _run([str(py), "-c", "import importlib.util as u, eagle3.stages.train as t; print(t.__file__); "
                   "print(u.find_spec('stages'))"], cwd=elsewhere, env=env).stdout.split()
    assert stages == [str(site / "eagle3" / "stages" / "train.py"), "None"]
    # Hydra's own account of where the config came from
    searchpath = cli("--info", "searchpath").stdout
    assert f"file://{installed_conf}" in searchpath and str(REPO) not in searchpath
    # a preset from conf/experiment/ and a group choice from conf/logger/, composed
    job = cli("experiment=smollm2_large", "logger=jsonl", "--cfg", "job").stdout
    assert "name: smollm2_large" in job and "backend: jsonl" in job

    ws = tmp_path / "ws"
    plan = cli("stage=plan", f"target.path={tiny_llama_dir}", f"workspace={ws}", "experiment=p", "logger=jsonl",
               "progress=false", "prepare.draft_vocab_size=128", "extract.backend=hf", "extract.layer_ids=[1,2,3]",
               "train.max_seq_len=256", "train.epochs=1", "cpu_threads=1", "export.verify=false")
    assert "conversations tokenized" in plan.stdout, plan.stdout[-2000:]
    assert (ws / "plan_cache.json").is_file() and not (ws / "p" / "manifest.json").exists()
