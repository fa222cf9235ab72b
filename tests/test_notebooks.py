"""The notebooks run against a tiny real pipeline's outputs and are stored without outputs."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import chat_records, write_jsonl

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def experiment(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nb")
    data = write_jsonl(tmp / "c.jsonl", chat_records(24))
    common = [f"target.path={tiny_llama_dir}", f"data.path={data}", f"workspace={tmp / 'ws'}", "experiment=nb",
              "logger=jsonl", "progress=false", "prepare.draft_vocab_size=128", "extract.backend=hf",
              "train.max_steps=4", "train.eval_every=2", "train.warmup_steps=1", "train.ttt_steps=2",
              "export.eval_prompts=2", "export.eval_max_tokens=16", "export.eval_ks=[1,2]",
              "export.num_speculative_tokens=2"]
    out = subprocess.run([sys.executable, "-m", "eagle3", "stage=all", *common], capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    return tmp / "ws" / "nb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path):
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    assert all(not c.get("outputs") and not c.get("execution_count") for c in nb.cells if c.cell_type == "code")


@pytest.mark.vllm
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_on_a_real_experiment(path, experiment, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("EAGLE3_EXPERIMENT_DIR", str(experiment))
    monkeypatch.setenv("CI", "1")
    nb = nbformat.read(str(path), as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "error"]
    assert not errors
    assert len(nb.cells) == len(nbformat.read(str(path), as_version=4).cells)
