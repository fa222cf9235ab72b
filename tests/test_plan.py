"""stage=plan on a tiny real target: its counts and store sizes against the runs that follow, and its
time estimates within a stated factor of the real stage times of the same config."""
from __future__ import annotations

import datetime as dt

import pytest

from conftest import chat_records, write_jsonl

from eagle3.manifest import Manifest
from eagle3.runner import run

# The plan's time estimate for extract + train (hf backend, no vLLM engine) must be within this
# factor of the real stages' wall time on a tiny target. Loose on purpose: on a shared 2-core
# machine another job can halve either side (seen here under a load of ~4: 0.67x-1.5x per stage,
# 0.76x-0.79x for the sum).
TIME_FACTOR = 4.0


def _seconds(rec) -> float:
    return (dt.datetime.fromisoformat(rec.data["ended"]) - dt.datetime.fromisoformat(rec.data["started"])).total_seconds()


def test_plan_estimates_then_counts_and_matches_a_real_run(compose, tiny_llama_dir, tmp_path, capsys):
    from eagle3.plan import make_plan

    data = write_jsonl(tmp_path / "c.jsonl", chat_records(400))  # more than the 256 the plan samples
    ws = tmp_path / "ws"
    common = [f"target.path={tiny_llama_dir}", f"data.path={data}", f"workspace={ws}", "experiment=p", "logger=jsonl",
              "progress=false", "prepare.draft_vocab_size=128", "extract.backend=hf", "extract.layer_ids=[1,2,3]",
              "train.max_seq_len=256", "train.epochs=1", "train.ttt_steps=2", "train.warmup_steps=1", "cpu_threads=1",
              "export.verify=false"]  # no vLLM in this config: the probes are transformers' (no engine start)
    m = Manifest(ws / "p")
    run(compose("stage=plan", *common))
    shown = capsys.readouterr().out
    assert "estimated: 256 of 400 conversations tokenized" in shown and "measured now" in shown
    assert "fp8" in shown and "online, a device each" in shown and "assumptions:" in shown
    assert "online with the producer on another host: the network carries" in shown
    assert not m.path.exists()  # no side effects beyond the probe cache
    assert (ws / "plan_cache.json").is_file()
    before = make_plan(compose("stage=plan", *common), m)
    assert all(p["cached"] for p in before["probes"].values())  # the probes ran once
    for stage in ("prepare", "extract", "train"):
        run(compose(f"stage={stage}", *common))
    prep, ext, tr = m.current("prepare"), m.current("extract"), m.current("train")
    after = make_plan(compose("stage=plan", *common), m)
    d = after["data"]
    assert d["exact"] and d["samples"] == {"train": prep.facts.num_train, "eval": prep.facts.num_eval}
    assert d["tokens"] == prep.facts.tokens and d["trainable_tokens"] == prep.facts.trainable_tokens
    assert d["coverage_curve"] == prep.facts.coverage_curve
    # estimated from a sample of 256 of 400: within 15% of the counts
    est = before["data"]
    assert not est["exact"] and abs(est["tokens"] / d["tokens"] - 1) < 0.15
    assert abs(est["trainable_tokens"] / d["trainable_tokens"] - 1) < 0.15
    # the store: bytes per token and size as extraction wrote them
    assert after["store"]["float32"]["bytes_per_token"] == ext.facts.layout.bytes_per_token
    assert after["store"]["float32"]["bytes"] == ext.facts.layout.bytes_per_token * sum(ext.facts.num_tokens.values())
    assert after["store"]["fp8"]["bytes_per_token"] == 4 * (64 + 4) + 5
    assert after["train_steps"] == tr.facts.steps
    # time: extract + train within TIME_FACTOR of the real run
    est_s = after["times"]["here"]["extract"] + after["times"]["here"]["train"]
    real_s = _seconds(ext) + _seconds(tr)
    print(f"plan: extract + train estimated {est_s:.1f} s, real {real_s:.1f} s (ratio {est_s / real_s:.2f})")
    assert 1 / TIME_FACTOR < est_s / real_s < TIME_FACTOR
    assert after["times"]["h200"]["train"] > 0
    # online disk: the window plus the cache (train.online.*), never more than the store itself
    store_bytes = after["store"]["float32"]["bytes"]
    assert after["offline_online"]["online"]["disk"] == min(4 << 30, store_bytes) == store_bytes
    small = make_plan(compose("stage=plan", *common, "train.online.window_bytes=1000000",
                              "train.online.cache_bytes=500000"), m)
    assert small["offline_online"]["online"]["disk"] == 1_500_000 < store_bytes
    # online across hosts: the bytes a token takes on the wire at the trainer's probed rate
    on = after["offline_online"]["online"]
    assert on["bytes_per_token"] == ext.facts.layout.bytes_per_token
    assert on["network_bytes_per_s_here"] == ext.facts.layout.bytes_per_token * after["probes"]["train"]["tokens_per_s"]
    assert on["network_bytes_per_s_h200"] == ext.facts.layout.bytes_per_token * after["h200_train_tokens_per_s"]


def _small_plan_config(compose, target, tmp_path, *extra):
    data = write_jsonl(tmp_path / "c.jsonl", chat_records(24))
    return compose("stage=plan", f"target.path={target}", f"data.path={data}", f"workspace={tmp_path / 'ws'}",
                   "experiment=p", "logger=jsonl", "progress=false", "extract.backend=hf", "train.max_seq_len=64",
                   "train.epochs=1", "train.ttt_steps=1", "cpu_threads=1", "export.verify=false", *extra)


def test_plan_on_a_target_smaller_than_the_draft_vocabulary(compose, tiny_llama_dir, tmp_path, capsys):
    """prepare.draft_vocab_size (32000) above the target's vocabulary (384): prepare maps the whole
    vocabulary, and the plan (its train probe) sizes the draft as prepare will."""
    import json

    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    cfg = _small_plan_config(compose, tiny_llama_dir, tmp_path)
    assert cfg.prepare.draft_vocab_size > vocab
    run(cfg)
    assert "measured now" in capsys.readouterr().out
    from eagle3.plan import make_plan

    plan = make_plan(cfg, Manifest(tmp_path / "ws" / "p"))
    assert plan["data"]["draft_vocab_size"] == vocab and plan["probes"]["train"]["cached"]


def test_plan_sizes_the_fp8_store_auto_gives_a_wide_target(compose, tmp_path):
    """extract.store_dtype=auto on a bfloat16 target with hidden 2048: extraction writes fp8
    (eagle3.extract.layers.FP8_MIN_HIDDEN), and the plan's disk figure is that store's."""
    from conftest import build_config_only_target

    from eagle3.plan import make_plan

    target = build_config_only_target(tmp_path / "wide", hidden=2048, num_layers=1, dtype="bfloat16")
    plan = make_plan(_small_plan_config(compose, target, tmp_path), Manifest(tmp_path / "ws" / "p"), probe=False)
    assert plan["store_dtype"] == "fp8"
    assert plan["offline_online"]["offline"]["disk"] == plan["store"]["fp8"]["bytes"] > 0
    assert plan["store"]["fp8"]["bytes_per_token"] == 2 * (2048 + 4) + 5  # layer 0 + the last, + id and mask


def test_plan_refuses_an_online_window_below_one_micro_batch(compose, tmp_path):
    """train.online.window_bytes below the largest micro-batch, which the trainer refuses only when
    it starts: stage=plan refuses it with the trainer's message (both keys and the minimum), before
    its probes; the minimum it names is accepted."""
    import re

    import pytest
    from conftest import build_config_only_target

    from eagle3.online import OnlineError
    from eagle3.plan import make_plan

    target = build_config_only_target(tmp_path / "t", hidden=64, num_layers=4, dtype="float32")
    online = ["train.hidden_states=online", "train.online.producer=external", "train.batch_size=2"]
    with pytest.raises(OnlineError) as e:
        run(_small_plan_config(compose, target, tmp_path, *online, "train.online.window_bytes=1000"))
    msg = str(e.value)
    assert "train.online.window_bytes=1000 is smaller than one micro-batch of train.batch_size=2 rows" in msg, msg
    assert "estimated" in msg and not (tmp_path / "ws" / "plan_cache.json").exists()  # no probe ran
    need = int(re.search(r"at least (\d+)", msg).group(1))
    make_plan(_small_plan_config(compose, target, tmp_path, *online, f"train.online.window_bytes={need}"),
              Manifest(tmp_path / "ws" / "p"), probe=False)


def test_plan_prices_the_export_by_engine_starts_and_runs(compose, tiny_llama_dir, tmp_path):
    """The export's verification: a generation run each for plain decoding, every k and prompt lookup
    unless it is replayed (export.prompt_lookup); one engine start with export.shared_engines (two with
    prompt lookup served), one per run without; the process's first start (vLLM's import) at its own
    price, each later one at the restart price; the offline evaluator as transformers' forward over the
    prompts and their greedy paths."""
    from eagle3.plan import DataCount, export_engines, stage_times

    base = ("export.verify=true", "prepare.regenerate=false")
    shared = _small_plan_config(compose, tiny_llama_dir, tmp_path, *base)
    served = _small_plan_config(compose, tiny_llama_dir, tmp_path, *base, "export.prompt_lookup=served")
    apart = _small_plan_config(compose, tiny_llama_dir, tmp_path, *base, "export.shared_engines=false")
    apart_served = _small_plan_config(compose, tiny_llama_dir, tmp_path, *base, "export.shared_engines=false",
                                      "export.prompt_lookup=served")
    sampled = _small_plan_config(compose, tiny_llama_dir, tmp_path, *base, "export.eval_temperatures=[0,0.7]")
    assert export_engines(shared.export) == (1, 6) and export_engines(served.export) == (2, 7)
    assert export_engines(apart.export) == (6, 6) and export_engines(apart_served.export) == (7, 7)
    assert export_engines(sampled.export) == (2, 7)  # auto serves prompt lookup for a sampled run
    assert export_engines(_small_plan_config(compose, tiny_llama_dir, tmp_path).export) == (0, 0)  # verify=false
    data = DataCount(samples={"train": 10, "eval": 0}, tokens=1000, trainable_tokens=500, exact=True, how="test")
    rates = dict(prefill_tps=100.0, decode_tps=10.0, hf_prefill_tps=100.0, step_s=1.0, load_s=2.0, setup_s=1.0,
                 engine_s=20.0, restart_s=5.0)
    for cfg in (shared, served, apart, apart_served):
        engines, runs = export_engines(cfg.export)
        t = stage_times(cfg, data, 1000, 0, 1, engines, 100, 0, runs=runs, **rates)
        x = cfg.export
        n, prompt_tokens = x.eval_prompts, x.eval_prompts * 100  # the data's mean length: 1000 / 10
        offline = (prompt_tokens + n * (x.eval_max_tokens + max(x.eval_ks) + 1)) / 100.0
        # extract (backend=hf) starts no engine: the export's first start is the process's first; every run
        # prefills the prompts and generates 100 tokens
        assert t["export"] == pytest.approx(20.0 + (engines - 1) * 5.0 + runs * (prompt_tokens / 100.0 + 100 / 10.0)
                                            + 2.0 + offline)
        # the prompts the export serves, counted (and the extra documents)
        t2 = stage_times(cfg, data, 1000, 0, 1, engines, 100, 0, runs=runs, export_prompts=(3, 600), **rates)
        assert t2["export"] == pytest.approx(20.0 + (engines - 1) * 5.0 + runs * (600 / 100.0 + 100 / 10.0) + 2.0
                                             + (600 + 3 * (x.eval_max_tokens + max(x.eval_ks) + 1)) / 100.0)
