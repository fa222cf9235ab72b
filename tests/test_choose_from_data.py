"""Settings chosen from the data: ``prepare.draft_vocab_size=auto`` (eagle3.data.vocab_choice) and
``extract.layer_ids=auto`` (eagle3.extract.layer_probe), on tiny real targets built here."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import build_tiny_llama, chat_records, write_jsonl
from hydra.errors import ConfigCompositionException

from eagle3.config import Config, DataConfig, ExtractConfig, LoggerConfig, PrepareConfig, TargetConfig, TrainConfig
from eagle3.data.vocab_choice import MULTIPLE, choose_draft_vocab_size
from eagle3.manifest import Manifest
from eagle3.runner import run

COST = dict(hidden=64, draft_fixed=60_000, target_cost=400_000, draft_tokens=3)


def _brute_force(freq, hidden, draft_fixed, target_cost, draft_tokens):
    """Every allowed size scored from its definition: (size, coverage, score) of each."""
    ordered = sorted((int(f) for f in freq), reverse=True)
    total = sum(ordered)
    sizes = sorted({min(m, len(freq)) for m in range(MULTIPLE, len(freq) + MULTIPLE, MULTIPLE)})
    out = []
    for V in sizes:
        cov = sum(ordered[:V]) / total
        out.append((V, cov, cov / (1 + draft_tokens * (draft_fixed + hidden * V) / target_cost)))
    return out


def test_vocab_auto_maximises_the_objective():
    rng = np.random.default_rng(0)
    vocab = 3000
    freq = (1e5 / np.arange(1, vocab + 1) ** 1.1).astype(np.int64)  # Zipf-like, shuffled over the ids
    freq[rng.choice(vocab, 300, replace=False)] = 0
    freq = freq[rng.permutation(vocab)]
    choice = choose_draft_vocab_size(freq, **COST)
    brute = _brute_force(freq, **COST)
    best = max(brute, key=lambda r: (r[2], -r[0]))
    assert choice["chosen"] == best[0] and choice["chosen"] % MULTIPLE == 0
    assert MULTIPLE < choice["chosen"] < vocab  # the cost model's optimum is inside, not at an end
    assert choice["coverage"] == pytest.approx(best[1], abs=1e-6) and choice["score"] == pytest.approx(best[2], abs=1e-6)
    second = sorted(brute, key=lambda r: (-r[2], r[0]))[1]
    assert choice["runner_up"]["size"] == second[0] and choice["runner_up"]["score"] <= choice["score"]
    assert choice["default"]["size"] == vocab  # the default 32000 capped at the vocabulary
    assert choice["candidates"] == len(brute)
    # a dearer draft (more passes per target step) prefers a smaller head
    dear = choose_draft_vocab_size(freq, **{**COST, "draft_tokens": 12})
    assert dear["chosen"] < choice["chosen"]


def test_vocab_auto_respects_the_cap():
    freq = np.arange(1, 101, dtype=np.int64)  # 100 ids, every one seen: the cheaper the head, the more it pays
    choice = choose_draft_vocab_size(freq, hidden=64, draft_fixed=10, target_cost=10**9, draft_tokens=3)
    assert choice["chosen"] == 100 and choice["coverage"] == 1.0  # the whole vocabulary, not the next multiple (128)
    assert choice["candidates"] == 2  # 64 and the cap


@pytest.mark.parametrize("override, message", [
    ("prepare.draft_vocab_size=abc", "prepare.draft_vocab_size must be a positive integer or 'auto', got 'abc'"),
    ("prepare.draft_vocab_size=-5", "prepare.draft_vocab_size must be a positive integer or 'auto', got -5"),
    ("prepare.draft_vocab_size=0", "got 0"),
    ("extract.layer_ids=foo", "extract.layer_ids must be a list of layer numbers .* or 'auto'.* got 'foo'"),
    ("extract.layer_ids=[-1,2]", "extract.layer_ids must be layer numbers >= 0"),
    ("extract.layer_ids=[a,b]", "extract.layer_ids must hold layer numbers"),
    ("prepare.vocab_choice.draft_tokens=0", "prepare.vocab_choice.draft_tokens must be > 0"),
    ("extract.layer_probe.samples=0", "extract.layer_probe.samples must be > 0"),
])
def test_bad_values_refused(compose, override, message):
    with pytest.raises((ConfigCompositionException, ValueError), match=message):
        compose(override)


def test_auto_layers_refused_where_no_extract_stage_runs(compose):
    with pytest.raises((ConfigCompositionException, ValueError), match="train.hidden_states=online"):
        compose("extract.layer_ids=auto", "train.hidden_states=online")
    with pytest.raises((ConfigCompositionException, ValueError), match="stage=produce"):
        compose("extract.layer_ids=auto", "stage=produce", "train.hidden_states=online")
    cfg = compose("extract.layer_ids=auto", "prepare.draft_vocab_size=auto")
    assert cfg.extract.layer_ids == "auto" and cfg.prepare.draft_vocab_size == "auto"


def test_new_sections_leave_the_hashes_alone_at_their_defaults(compose):
    from eagle3.data.dataset import prepare_config
    from eagle3.hashing import hash_obj, semantic_dict

    base = compose()
    assert "vocab_choice" not in semantic_dict(base.prepare) and "layer_probe" not in semantic_dict(base.extract)
    same = compose("prepare.vocab_choice.draft_tokens=3", "extract.layer_probe.min_z=2.0")
    assert hash_obj(prepare_config(same)) == hash_obj(prepare_config(base))
    assert semantic_dict(same.extract) == semantic_dict(base.extract)
    other = compose("prepare.draft_vocab_size=auto", "prepare.vocab_choice.draft_tokens=5")
    assert semantic_dict(other.prepare)["vocab_choice"] == {"draft_tokens": 5}
    assert hash_obj(prepare_config(other)) != hash_obj(prepare_config(compose("prepare.draft_vocab_size=auto")))


@pytest.fixture(scope="module")
def eight_layers(tmp_path_factory):
    """8 decoder layers: 8 candidates for 3 aux layers (the default is (2, 4, 5))."""
    return build_tiny_llama(tmp_path_factory.mktemp("eight"), num_layers=8, hidden=64, seed=3)


def _cfg(tmp_path, target, stage, **extract):
    return Config(stage=stage, workspace=str(tmp_path / "ws"), name="auto", target=TargetConfig(path=str(target)),
                  data=DataConfig(path=str(write_jsonl(tmp_path / "chats.jsonl", chat_records(48, turns=2)))),
                  prepare=PrepareConfig(max_length=128, draft_vocab_size="auto"),
                  extract=ExtractConfig(backend="hf", device="cpu", layer_ids="auto", verify_samples=1, **extract),
                  train=TrainConfig(max_steps=4, ttt_steps=2, log_every=2, eval_every=4, save_every=4, warmup_steps=1,
                                    max_seq_len=256),
                  logger=LoggerConfig(backend="jsonl"), progress=False)


def test_prepare_extract_train_with_both_auto(tmp_path, eight_layers, capsys):
    from eagle3.extract.layer_probe import PROBE_DIR
    from eagle3.report import status_rows

    cfg = _cfg(tmp_path, eight_layers, "prepare")
    run(cfg)
    out = capsys.readouterr().out
    exp = tmp_path / "ws" / "auto"
    prep = Manifest(exp).current("prepare").facts
    vc = prep.vocab_choice
    target_vocab = prep.vocab_size
    assert vc is not None and prep.draft_vocab_size == vc["chosen"] <= target_vocab
    assert vc["chosen"] % MULTIPLE == 0 or vc["chosen"] == target_vocab
    assert vc["default"]["size"] == min(32000, target_vocab) and vc["cost_model"]["draft_tokens"] == 3
    assert f"prepare: draft vocabulary auto: {vc['chosen']} (coverage {vc['coverage']:.4f}" in out

    cfg.stage = "extract"
    run(cfg)
    out = capsys.readouterr().out
    rec = Manifest(exp).current("extract")
    probe = rec.facts.layer_probe
    assert probe is not None and probe["reused"] is False and len(probe["layer_ids"]) == 3
    assert probe["default"] == [2, 4, 5] and probe["candidates"] == 8
    assert probe["layer_ids"] == (probe["default"] if probe["kept_default"] else probe["chosen"])
    assert probe["kept_default"] == (probe["chosen"] == probe["default"] or probe["z"] is None
                                     or probe["z"] < probe["min_z"])
    assert probe["samples"] == min(64, prep.num_train)  # the train split's first samples
    assert probe["positions"]["test"] > 0 and probe["seconds"]["total"] > 0
    assert list(rec.facts.layout.layer_ids) == probe["layer_ids"]  # what the store holds
    assert "extract: layer probe: layer ids" in out and f"default [2, 4, 5] {probe['scores']['default']:.4f}" in out
    (cache,) = (exp / PROBE_DIR).glob("*.json")
    assert json.loads(cache.read_text())["layer_ids"] == probe["layer_ids"]
    assert any("layer probe: layer ids" in r.get("facts", "") for r in status_rows(Manifest(exp)))

    # a re-run reads the cache: the file is not written again and the run says it reused it
    mtime = cache.stat().st_mtime_ns
    run(cfg)
    out = capsys.readouterr().out
    assert f"extract: layer probe reused from {cache}" in out and "already complete" in out
    assert cache.stat().st_mtime_ns == mtime

    cfg.stage = "train"
    run(cfg)
    train = Manifest(exp).current("train").facts
    assert train.layer_ids == probe["layer_ids"] and train.draft_vocab_size == vc["chosen"]

    # the default layers' arm beside it (same prepare, same train.*), trained last; each arm's export
    # ships the draft of its own extract run, not merely the latest draft
    arms = {"probe": cfg, "default": _cfg(tmp_path, eight_layers, "extract")}
    arms["default"].extract.layer_ids = [2, 4, 5]
    for stage in ("extract", "train"):
        arms["default"].stage = stage
        run(arms["default"])
    for name, arm_cfg in arms.items():
        arm_cfg.stage = "export"
        arm_cfg.export.verify = False
        run(arm_cfg)
        m = Manifest(exp)
        export, train_run = m.current("export"), m.record("train", m.current("export").data["upstream"]["train"])
        assert export.data["upstream"]["extract"] == train_run.data["upstream"]["extract"]
        assert m.record("extract", export.data["upstream"]["extract"]).data["config"]["extract"]["layer_ids"] == \
            ("auto" if name == "probe" else [2, 4, 5])


def test_probe_refuses_a_target_with_nothing_to_choose(tmp_path):
    """Three decoder layers hold exactly the three aux layers: auto is refused, naming what to set."""
    from eagle3.extract.layer_probe import LayerProbeError

    cfg = _cfg(tmp_path, build_tiny_llama(tmp_path / "three", num_layers=3, hidden=64), "prepare")
    run(cfg)
    cfg.stage = "extract"
    with pytest.raises(LayerProbeError, match="leave nothing to choose; set extract.layer_ids=\\[\\]"):
        run(cfg)


def test_plan_shows_both_choices(compose, eight_layers, tmp_path, capsys):
    """stage=plan: the vocabulary chosen on its sample of the data (then the prepare run's own choice),
    the layers as chosen at extract time with the probe's estimated time, the store sized as the default's."""
    from eagle3.manifest import Manifest
    from eagle3.plan import make_plan, print_plan

    data = write_jsonl(tmp_path / "c.jsonl", chat_records(24))
    common = [f"target.path={eight_layers}", f"data.path={data}", f"workspace={tmp_path / 'ws'}", "experiment=p",
              "logger=jsonl", "progress=false", "extract.backend=hf", "train.max_seq_len=64", "train.epochs=1",
              "train.ttt_steps=1", "cpu_threads=1", "export.verify=false", "prepare.draft_vocab_size=auto",
              "extract.layer_ids=auto"]
    manifest = Manifest(tmp_path / "ws" / "p")
    plan = make_plan(compose("stage=plan", *common), manifest)
    capsys.readouterr()
    print_plan(plan)
    out = capsys.readouterr().out
    assert plan["layer_ids"] == [2, 4, 5] and plan["layer_ids_auto"] and plan["layer_probe_s"] > 0
    assert f"auto (chosen at extract time, probe ~{plan['layer_probe_s']:.0f} s" in out
    estimated = plan["data"]["vocab_choice"]
    assert estimated and plan["data"]["draft_vocab_size"] == estimated["chosen"]
    assert f"draft vocabulary auto: {estimated['chosen']} (coverage {estimated['coverage']:.4f}" in out
    run(compose("stage=prepare", *common))
    counted = make_plan(compose("stage=plan", *common), manifest, probe=False)["data"]
    assert counted["exact"] and counted["vocab_choice"] == manifest.current("prepare").facts.vocab_choice
