"""One derivation of the store's layout (eagle3/extract/layout.py): the extract stage, online
training and stage=plan derive the same layout from one config, and refuse the same prepared data
with the same message."""
from __future__ import annotations

import pytest
from conftest import build_config_only_target, chat_records, write_jsonl

from eagle3.manifest import Manifest, ManifestError
from eagle3.runner import run


class _Stop(Exception):
    """Raised where the extract stage would build its engine: what it was given is all we need."""


def _config(compose, target, tmp_path, *extra):
    data = tmp_path / "c.jsonl"
    if not data.exists():
        write_jsonl(data, chat_records(24))
    return compose("stage=prepare", f"target.path={target}", f"data.path={data}", f"workspace={tmp_path / 'ws'}",
                   "experiment=l", "logger=jsonl", "progress=false", "extract.backend=hf", "prepare.max_length=128",
                   "export.verify=false", *extra)


def _extract_derives(cfg, manifest, monkeypatch) -> tuple:
    """(layout, target dtype, max_model_len) the extract stage hands its backend."""
    import dataclasses

    import eagle3.extract
    from eagle3.stages import extract as extract_stage

    seen = {}

    def make_extractor(engine, work_dir):
        seen.update(layout=engine.layout, target_dtype=engine.target_dtype, max_model_len=engine.max_model_len)
        raise _Stop

    monkeypatch.setattr(eagle3.extract, "make_extractor", make_extractor)
    with pytest.raises(_Stop):
        extract_stage.run(dataclasses.replace(cfg, stage="extract"), manifest)
    return seen["layout"], seen["target_dtype"], seen["max_model_len"]


def _online_run(cfg, manifest):
    import dataclasses

    from eagle3.online import OnlineRun

    return OnlineRun(dataclasses.replace(cfg, stage="train", train=dataclasses.replace(cfg.train,
                                                                                         hidden_states="online")),
                     manifest)


@pytest.mark.parametrize("case, store_dtype", [("float32", "float32"), ("bfloat16", "bfloat16"), ("wide", "fp8")])
def test_extract_online_and_plan_derive_one_layout(case, store_dtype, compose, tiny_llama_dir, tmp_path,
                                                   monkeypatch):
    """extract.store_dtype=auto: float32 from a float32 target, bfloat16 from a bfloat16 one of hidden
    64, fp8 from a bfloat16 one of hidden 2048 (config only: nothing here loads weights)."""
    from eagle3.plan import make_plan

    if case == "wide":
        target, extra = build_config_only_target(tmp_path / "wide", hidden=2048, num_layers=1), ()
    else:
        target, extra = tiny_llama_dir, (f"target.dtype={case}",)
    cfg = _config(compose, target, tmp_path, *extra)
    assert cfg.extract.store_dtype == "auto"
    run(cfg)
    manifest = Manifest(cfg.experiment_dir)
    layout, target_dtype, max_model_len = _extract_derives(cfg, manifest, monkeypatch)
    assert layout.dtype == store_dtype and target_dtype == ("float32" if case == "float32" else "bfloat16")
    online = _online_run(cfg, manifest)
    assert (online.layout, online.target_dtype, online.max_model_len) == (layout, target_dtype, max_model_len)
    assert online.layer_ids == list(layout.layer_ids)
    plan = make_plan(cfg, manifest, probe=False)
    assert plan["store_layout"] == layout.to_json() and plan["target_dtype"] == target_dtype
    assert plan["store_dtype"] == store_dtype and plan["layer_ids"] == list(layout.layer_ids)
    # the plan's store size is that layout's on the counted tokens
    assert plan["offline_online"]["offline"]["disk"] == layout.bytes_per_token * plan["data"]["tokens"]


@pytest.mark.parametrize("bad", ["context", "split"])
def test_online_refuses_what_extract_refuses(bad, compose, tmp_path, monkeypatch):
    """A sample longer than the target's context, a split extract.splits names that prepare did not
    write: train.hidden_states=online refuses them with the extract stage's message."""
    import dataclasses

    context = 24 if bad == "context" else 4096
    target = build_config_only_target(tmp_path / "t", hidden=64, num_layers=4, dtype="float32",
                                      max_position_embeddings=context)
    cfg = _config(compose, target, tmp_path)
    run(cfg)
    if bad == "split":
        cfg = dataclasses.replace(cfg, extract=dataclasses.replace(cfg.extract, splits=["train", "eval", "test"]))
    manifest = Manifest(cfg.experiment_dir)
    match = (r"the longest prepared sample has \d+ tokens but the target's context is 24" if bad == "context" else
             r"extract.splits=\['train', 'eval', 'test'\]: the prepared dataset has no split \['test'\]")
    with pytest.raises(ManifestError, match=match) as offline:
        _extract_derives(cfg, manifest, monkeypatch)
    with pytest.raises(ManifestError, match=match) as online:
        _online_run(cfg, manifest)
    assert str(online.value) == str(offline.value)
