"""What the command line refuses before Hydra creates anything for the run (eagle3/preflight.py,
eagle3/__main__.py), and that a refused run leaves no directory behind; through the real CLI."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _cli(*args, cwd, prefix=()):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([*prefix, sys.executable, "-m", "eagle3", "logger=jsonl", "progress=false", *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd, env=env)


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _unprivileged() -> list[str]:
    """A prefix that makes this process respect file modes: root writes anywhere otherwise."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a read-only directory is writable")
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"]


@pytest.mark.parametrize("args,fragment", [
    (("experiment=../../escape", "workspace=a/b/ws"), "experiment must be a non-empty name without '/'"),
    (("train.decay=1.5", "workspace=ws"), "train.decay must be in (0, 1]"),
    (("+trian.lr=5e-4", "workspace=ws"), "did you mean train.lr=5e-4?"),
    (("experiment=..", "workspace=ws"), "experiment must be a non-empty name"),
])
def test_a_refused_run_creates_no_directory(tmp_path, args, fragment):
    """Hydra used to make its run directory (${workspace}/${name}/logs/...) before eagle3 looked at
    the config: outside the workspace for experiment=../../escape, <workspace>/default/logs/ for
    an invalid config."""
    out = _cli("stage=prepare", *args, cwd=tmp_path)
    assert out.returncode == 2 and "eagle3: invalid config: " in out.stderr and fragment in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert _tree(tmp_path) == []


def test_status_of_a_mistyped_workspace_creates_nothing(tmp_path):
    out = _cli("stage=status", "workspace=wrokspace", cwd=tmp_path)
    assert out.returncode == 0 and "no manifest at" in out.stdout, out.stderr
    assert _tree(tmp_path) == []


def test_read_only_workspace(tmp_path, tiny_llama_dir):
    """stage=status reads it (Hydra's log directory used to fail first); a stage that writes is
    refused in one line before anything runs (three tracebacks before)."""
    ws = tmp_path / "ws"
    data = tmp_path / "c.jsonl"
    data.write_text("".join(f'{{"messages": [{{"role": "user", "content": "hi {i}"}}, '
                            f'{{"role": "assistant", "content": "hello {i}"}}]}}\n' for i in range(4)))
    common = [f"workspace={ws}", "experiment=e", f"target.path={tiny_llama_dir}", f"data.path={data}",
              "prepare.draft_vocab_size=64"]
    assert _cli("stage=prepare", *common, cwd=tmp_path).returncode == 0
    dirs = [ws, *(p for p in ws.rglob("*") if p.is_dir())]
    before = _tree(ws)
    for d in dirs:
        d.chmod(0o555)
    try:
        prefix = _unprivileged()
        out = _cli("stage=status", f"workspace={ws}", "experiment=e", cwd=ws, prefix=prefix)
        assert out.returncode == 0 and "complete" in out.stdout, out.stderr
        out = _cli("stage=prepare", *common, "prepare.seed=1", cwd=tmp_path, prefix=prefix)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert f"eagle3: error: experiment directory {ws / 'e'} is read-only for this user" in out.stderr
        assert "set workspace=DIR to a writable directory" in out.stderr
        assert _tree(ws) == before
    finally:
        for d in dirs:
            d.chmod(0o755)


def test_workspace_under_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("a file, not a directory\n")
    out = _cli("stage=prepare", f"workspace={tmp_path}/notes.txt/ws", cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"workspace {tmp_path}/notes.txt/ws: {tmp_path}/notes.txt is a file, not a directory" in out.stderr
    assert _tree(tmp_path) == ["notes.txt"]


def test_dotdot_after_a_missing_directory_is_refused(tmp_path):
    """workspace=<tmp>/missing/../ws: the stages would read it as <tmp>/ws while Hydra's log directory,
    made as written, would create <tmp>/missing as well."""
    out = _cli("stage=prepare", f"workspace={tmp_path}/missing/../ws", cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"{tmp_path}/missing does not exist, so '..' cannot be taken from it" in out.stderr
    assert f"workspace={tmp_path}/ws" in out.stderr
    assert _tree(tmp_path) == []


def test_target_without_a_tokenizer(tmp_path, tiny_llama_dir):
    target = tmp_path / "weights_only"
    target.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama_dir / name, target / name)
    out = _cli("stage=prepare", f"workspace={tmp_path}/ws", f"target.path={target}", f"data.path={tmp_path}/c.jsonl",
               cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"target.path={target} has no tokenizer" in out.stderr and "copy the tokenizer files" in out.stderr
    assert not (tmp_path / "ws").exists()


@pytest.mark.parametrize("stage", ["train", "extract", "export"])
def test_a_stage_that_reads_runs_refuses_a_workspace_where_nothing_ran(tmp_path, stage):
    """A mistyped workspace= (or experiment=): refused before Hydra makes <workspace>/default/logs/."""
    out = _cli(f"stage={stage}", "workspace=wrokspace", cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert (f"eagle3: error: stage={stage} reads the runs recorded in {tmp_path}/wrokspace/default/manifest.json, "
            f"which does not exist") in out.stderr and "Check workspace= and experiment=" in out.stderr
    assert _tree(tmp_path) == []
