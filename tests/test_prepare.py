"""The prepare stage end to end on a tiny real target (tokenizer + random Llama), through the
composed Hydra config and the manifest."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import chat_records, write_jsonl

from eagle3.data.vocab import build_vocab_mapping
from eagle3.manifest import Manifest
from eagle3.runner import run


@pytest.fixture
def workspace(tmp_path):
    return tmp_path / "ws"


def _prepare(compose, target, workspace, *overrides):
    cfg = compose("stage=prepare", f"target.path={target}", f"workspace={workspace}", "experiment=e",
                  "prepare.draft_vocab_size=64", "progress=false", "logger=jsonl", *overrides)
    run(cfg)
    m = Manifest(Path(workspace) / "e")
    return m, m.current("prepare")


def _load(rec, split="train"):
    import datasets

    return datasets.load_from_disk(str(rec.path("dataset")))[split]


def test_jsonl_messages_mask_and_outputs(compose, tiny_llama_dir, workspace, tmp_path):
    data = write_jsonl(tmp_path / "c.jsonl", chat_records(60, turns=2))
    m, rec = _prepare(compose, tiny_llama_dir, workspace, f"data.path={data}")
    ds = _load(rec)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    row = ds[0]
    masked = tok.decode([t for t, k in zip(row["input_ids"], row["loss_mask"]) if k])
    assert masked.count("<|im_end|>") == 2  # two assistant turns, each with its end-of-turn token
    assert "<|im_start|>" not in masked and "user" not in masked
    facts = rec.facts
    assert facts.num_train + facts.num_eval == 60 and facts.num_eval >= 1
    assert facts.draft_vocab_size == 64 and facts.tokenizer_hash
    d2t, t2d = _vocab(rec)
    kept = np.arange(64) + d2t
    assert np.all(np.diff(kept) > 0) and t2d.sum() == 64 and np.all(t2d[kept])
    stats = json.loads(rec.path("stats.json").read_text())
    assert stats["trainable_tokens"] == sum(sum(r) for r in ds["loss_mask"]) + sum(
        sum(r) for r in _load(rec, "eval")["loss_mask"])


def _vocab(rec):
    from eagle3.data.vocab import load_vocab

    d2t, t2d = load_vocab(rec.path("vocab.safetensors"))
    return d2t.numpy(), t2d.numpy()


def test_sharegpt_hf_disk_parquet_and_weights(compose, tiny_llama_dir, workspace, tmp_path):
    import datasets

    share = [{"conversations": [{"from": "human", "value": f"q{i} hello"}, {"from": "gpt", "value": f"a{i} world"}]}
             for i in range(10)]
    sg = write_jsonl(tmp_path / "sg.jsonl", share)
    hf_rows = chat_records(10, seed=1)
    datasets.Dataset.from_list(hf_rows).save_to_disk(str(tmp_path / "hf"))
    datasets.Dataset.from_list(chat_records(10, seed=2)).to_parquet(str(tmp_path / "p.parquet"))
    sources = (f"data.sources=[{{path: {sg}, weight: 2.0}}, {{path: {tmp_path / 'hf'}, weight: 0.5}},"
               f" {{path: {tmp_path / 'p.parquet'}}}]")
    _, rec = _prepare(compose, tiny_llama_dir, workspace, sources, "prepare.dedup=true")
    # 10 ShareGPT x 2 (upsampled copies survive: dedup runs before weighting) + 5 + 10
    assert rec.facts.num_train + rec.facts.num_eval == 35


def test_dedup_system_prompt_truncation_and_drops(compose, tiny_llama_dir, workspace, tmp_path):
    recs = chat_records(20)
    recs += recs[:5]  # duplicates
    recs.append({"messages": [{"role": "user", "content": "only a question"}]})  # nothing to learn
    data = write_jsonl(tmp_path / "c.jsonl", recs)
    _, rec = _prepare(compose, tiny_llama_dir, workspace, f"data.path={data}", "data.system_prompt=Be brief.",
                      "prepare.max_length=120")
    assert rec.facts.dropped == {"duplicate": 5, "no_trainable_tokens": 1}
    stats = json.loads(rec.path("stats.json").read_text())
    assert stats["truncated"] > 0
    ds = _load(rec)
    assert max(len(x) for x in ds["input_ids"]) <= 120
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(str(tiny_llama_dir)).decode(ds[0]["input_ids"])
    assert text.startswith("<|im_start|>system\nBe brief.")


def test_split_is_deterministic_and_content_based(compose, tiny_llama_dir, tmp_path):
    recs = chat_records(80)
    a = write_jsonl(tmp_path / "a.jsonl", recs)
    b = write_jsonl(tmp_path / "b.jsonl", list(reversed(recs)) + chat_records(20, seed=9))
    _, ra = _prepare(compose, tiny_llama_dir, tmp_path / "w1", f"data.path={a}", "prepare.eval_fraction=0.2")
    _, rb = _prepare(compose, tiny_llama_dir, tmp_path / "w2", f"data.path={b}", "prepare.eval_fraction=0.2")
    ea, eb = set(_load(ra, "eval")["sample_id"]), set(_load(rb, "eval")["sample_id"])
    assert ea and ea <= eb  # order does not matter; added samples do not move existing ones


def test_vocab_mapping_topk_padding_identity():
    freq = np.array([0, 5, 1, 5, 0, 9, 0, 0], dtype=np.int64)
    m = build_vocab_mapping(freq, 3)
    assert list(m.kept_ids) == [1, 3, 5] and m.coverage == pytest.approx(19 / 20)
    padded = build_vocab_mapping(freq, 6)  # only 4 seen: padded with the lowest unseen ids
    assert list(padded.kept_ids) == [0, 1, 2, 3, 4, 5] and padded.num_seen == 4
    ident = build_vocab_mapping(freq, 8)
    assert ident.identity and list(ident.d2t) == [0] * 8 and ident.t2d.all()


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "eagle3", "logger=jsonl", *args], capture_output=True, text=True,
                          timeout=120)


def test_bad_json_line_names_file_and_line(tiny_llama_dir, tmp_path):
    data = tmp_path / "bad.jsonl"
    good = json.dumps(chat_records(1)[0])
    data.write_text(good + "\n" + good.replace("}", "", 1) + "\n")
    out = _cli("stage=prepare", f"target.path={tiny_llama_dir}", f"data.path={data}", f"workspace={tmp_path}/w")
    assert out.returncode == 1 and f"{data}:2" in out.stderr and "on_bad_record=skip" in out.stderr


def test_skip_bad_records_counts_them(compose, tiny_llama_dir, workspace, tmp_path):
    data = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in chat_records(6)]
    lines.insert(2, "{not json")
    lines.insert(4, json.dumps({"messages": [{"role": "wizard", "content": "x"}]}))
    data.write_bytes(("\n".join(lines) + "\n").encode() + b"\xff\xfe bad bytes\n")
    _, rec = _prepare(compose, tiny_llama_dir, workspace, f"data.path={data}", "data.on_bad_record=skip")
    assert rec.facts.bad_records == 3 and rec.facts.num_train + rec.facts.num_eval == 6


def test_a_file_of_bad_records_only_says_so_once(compose, tiny_llama_dir, workspace, tmp_path):
    from eagle3.data.sources import DataError

    data = tmp_path / "allbad.jsonl"
    data.write_text("{not json\n")
    with pytest.raises(DataError) as e:
        _prepare(compose, tiny_llama_dir, workspace, f"data.path={data}", "data.on_bad_record=skip")
    assert "read 0 records from" in str(e.value) and ", dropped 1 bad record (e.g. " in str(e.value), str(e.value)
    assert "skipped" not in str(e.value)


def test_a_draft_vocabulary_larger_than_the_targets_names_the_key(compose, tiny_llama_dir, workspace, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="eagle3.prepare")
    data = write_jsonl(tmp_path / "c.jsonl", chat_records(20))
    _, rec = _prepare(compose, tiny_llama_dir, workspace, f"data.path={data}", "prepare.draft_vocab_size=100000")
    vocab = rec.facts.vocab_size
    assert rec.facts.draft_vocab_size == vocab
    assert (f"prepare.draft_vocab_size=100000 is larger than the target's vocabulary ({vocab} ids)" in caplog.text
            and f"set prepare.draft_vocab_size={vocab} or less" in caplog.text), caplog.text


@pytest.mark.parametrize("record,fragment", [
    ({"messages": [{"role": "wizard", "content": "x"}]}, "wizard"),
    ({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "a"}]}, "empty"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}, "content"),
])
def test_bad_records_fail_clearly_and_keep_earlier_artifacts(tiny_llama_dir, tmp_path, record, fragment):
    good = write_jsonl(tmp_path / "good.jsonl", chat_records(5))
    ws = tmp_path / "w"
    assert _cli("stage=prepare", f"target.path={tiny_llama_dir}", f"data.path={good}", f"workspace={ws}").returncode == 0
    before = json.loads((ws / "default" / "manifest.json").read_text())["stages"]["prepare"]["current"]
    bad = write_jsonl(tmp_path / "bad.jsonl", chat_records(3) + [record])
    out = _cli("stage=prepare", f"target.path={tiny_llama_dir}", f"data.path={bad}", f"workspace={ws}")
    assert out.returncode == 1 and fragment in out.stderr and "Traceback" not in out.stderr
    m = Manifest(ws / "default")
    assert m.current("prepare").config_hash == before and m.consume("prepare", by="extract")


def test_missing_target_and_missing_template(tmp_path, tiny_llama_dir):
    data = write_jsonl(tmp_path / "c.jsonl", chat_records(3))
    out = _cli("stage=prepare", f"target.path={tmp_path}/nope", f"data.path={data}", f"workspace={tmp_path}/w")
    assert out.returncode == 1 and "does not exist" in out.stderr
    import shutil

    no_tpl = tmp_path / "notpl"
    shutil.copytree(tiny_llama_dir, no_tpl)
    cfg = json.loads((no_tpl / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (no_tpl / "tokenizer_config.json").write_text(json.dumps(cfg))
    (no_tpl / "chat_template.jinja").unlink(missing_ok=True)
    out = _cli("stage=prepare", f"target.path={no_tpl}", f"data.path={data}", f"workspace={tmp_path}/w2")
    assert out.returncode == 1 and "target.chat_template" in out.stderr


def test_changed_config_reruns_and_same_is_noop(tiny_llama_dir, tmp_path):
    data = write_jsonl(tmp_path / "c.jsonl", chat_records(5))
    args = ["stage=prepare", f"target.path={tiny_llama_dir}", f"data.path={data}", f"workspace={tmp_path}/w"]
    assert _cli(*args).returncode == 0
    again = _cli(*args)
    assert "already complete" in again.stdout
    changed = _cli(*args, "prepare.max_length=64")
    assert changed.returncode == 0 and "already complete" not in changed.stdout


def test_categories_travel_to_the_dataset_and_the_coverage_curve_is_recorded(compose, tiny_llama_dir, workspace,
                                                                              tmp_path):
    """A `category` (JSONL messages) or `domain` (ShareGPT) field becomes the dataset's category column,
    per sample, through weighting and max_samples; prepare's facts count them per split and record
    the share of trainable tokens covered per draft vocabulary size (exactly the mapping's at the
    chosen size)."""
    from eagle3.data.vocab import coverage_curve

    msgs = chat_records(30, seed=1)
    for i, r in enumerate(msgs):
        r["category"] = "code" if i % 3 else "maths"
    msgs[0]["category"] = ""  # empty: no category
    share = [{"domain": "chat", "conversations": [{"from": "human", "value": f"hi {i} sea?"},
                                                 {"from": "gpt", "value": "blue wind " * (i + 1)}]}
             for i in range(10)]
    a, b = write_jsonl(tmp_path / "a.jsonl", msgs), write_jsonl(tmp_path / "b.jsonl", share)
    m, rec = _prepare(compose, tiny_llama_dir, workspace, f"data.sources=[{{path: {a}}}, {{path: {b}, weight: 2.0}}]",
                      "prepare.dedup=false", "data.max_samples=45", "prepare.eval_fraction=0.2")
    want = {}
    for r in msgs:
        want[r["messages"][0]["content"]] = r["category"] or None
    for r in share:
        want[r["conversations"][0]["value"]] = "chat"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    counts: dict = {}
    for split in ("train", "eval"):
        ds = _load(rec, split)
        assert "category" in ds.column_names
        for ids, cat in zip(ds["input_ids"], ds["category"]):
            text = tok.decode(ids)
            (first,) = [q for q in want if q in text]  # the sample's first user turn names it
            assert cat == want[first], (first, cat)
            counts.setdefault(split, {}).setdefault("(none)" if cat is None else cat, 0)
            counts[split]["(none)" if cat is None else cat] += 1
    facts = rec.facts
    assert facts.categories == counts and facts.num_train + facts.num_eval == 45
    assert set(facts.categories["train"]) >= {"code", "chat"}
    curve = facts.coverage_curve
    assert set(curve) == {"64", "4096", "8192", "16384", "32768", "65536"}
    assert curve["64"] == round(facts.coverage, 6) and curve["4096"] == 1.0  # the tiny vocabulary has 384 ids
    assert "64* " in facts.coverage_line()
    freq = np.array([5, 0, 3, 2], dtype=np.int64)
    assert coverage_curve(freq, sizes=(1, 2, 8)) == {"1": 0.5, "2": 0.8, "8": 1.0}
    stats = json.loads(rec.path("stats.json").read_text())
    assert stats["coverage_curve"] == curve and stats["categories"] == counts
    from eagle3.report import status_rows

    (row,) = [r for r in status_rows(m) if r["stage"] == "prepare"]
    assert f"coverage by draft vocabulary size: 64* {curve['64']:.4f}" in row["facts"]
    assert "categories (eval split): " in row["facts"]
    # without any category field: no column, no counts
    plain = write_jsonl(tmp_path / "p.jsonl", chat_records(12, seed=2))
    _, rec2 = _prepare(compose, tiny_llama_dir, tmp_path / "ws2", f"data.path={plain}")
    assert "category" not in _load(rec2).column_names and rec2.facts.categories is None


def _refusal(compose, target, workspace, *overrides) -> str:
    from eagle3.data.sources import DataError

    with pytest.raises(DataError) as e:
        _prepare(compose, target, workspace, *overrides)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_empty_data_file_says_nothing_was_read_and_no_regeneration_hint_when_it_is_set(compose, tiny_llama_dir,
                                                                                      workspace, tmp_path):
    """It used to blame missing assistant turns and suggest prepare.regenerate=true, set or not."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    msg = _refusal(compose, tiny_llama_dir, workspace, f"data.path={empty}", "prepare.regenerate=true")
    assert f"read 0 records from data.path={empty} (the file is empty)" in msg
    assert "give a file with conversations" in msg and "prepare.regenerate" not in msg


def test_max_length_too_small_says_how_many_were_dropped_and_why(compose, tiny_llama_dir, workspace, tmp_path):
    recs = chat_records(12) + [{"messages": [{"role": "user", "content": "only a question"}]}] * 2
    data = write_jsonl(tmp_path / "c.jsonl", recs)
    msg = _refusal(compose, tiny_llama_dir, workspace, f"data.path={data}", "prepare.max_length=4")
    assert f"read 14 records from data.path={data}" in msg
    assert "12 with every assistant token beyond prepare.max_length" in msg
    assert "1 without an assistant turn" in msg and "1 identical to an earlier conversation" in msg
    assert "raise prepare.max_length (now 4)" in msg and "or set prepare.regenerate=true" in msg


def test_a_json_array_file_is_read_as_its_records(compose, tiny_llama_dir, workspace, tmp_path):
    """Read, not refused: the same records as JSONL, which is read whole as well."""
    recs = chat_records(30)
    array = tmp_path / "c.json"
    array.write_text(json.dumps(recs, indent=1))
    _, rec = _prepare(compose, tiny_llama_dir, workspace, f"data.path={array}")
    _, rec_jsonl = _prepare(compose, tiny_llama_dir, tmp_path / "w2", f"data.path={write_jsonl(tmp_path / 'c.jsonl', recs)}")
    assert rec.facts.num_train + rec.facts.num_eval == 30
    assert _load(rec)["input_ids"] == _load(rec_jsonl)["input_ids"]
    array.write_text(json.dumps(recs[:3] + ["not a conversation"]))
    msg = _refusal(compose, tiny_llama_dir, tmp_path / "w3", f"data.path={array}")
    assert f"{array}[3]: expected a JSON object, got str" in msg


def test_data_path_a_directory_without_a_dataset(compose, tiny_llama_dir, workspace, tmp_path):
    folder = tmp_path / "chats"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", chat_records(3))
    msg = _refusal(compose, tiny_llama_dir, workspace, f"data.path={folder}")
    assert f"data source {folder} is a directory but not a dataset saved with datasets' save_to_disk" in msg
    assert f"it holds a.jsonl: set data.path={folder / 'a.jsonl'}" in msg
    (folder / "a.jsonl").unlink()
    msg = _refusal(compose, tiny_llama_dir, workspace, f"data.path={folder}")
    assert "set data.path to a conversations file (JSONL, parquet)" in msg


@pytest.fixture
def umask():
    """Set the process's umask for one test (restored after it)."""
    import os

    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


def _modes(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_mode & 0o777 for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_prepared_files_take_the_umask(compose, tiny_llama_dir, workspace, tmp_path, umask, mask):
    """Every file prepare writes (the vocabulary and token counts in safetensors too, which
    safetensors' save_file creates owner-only) gets the mode the umask gives: readable by the other
    users a server may run as."""
    umask(mask)
    data = write_jsonl(tmp_path / "c.jsonl", chat_records(20))
    _, rec = _prepare(compose, tiny_llama_dir, workspace, f"data.path={data}")
    modes = _modes(rec.out_dir)
    assert {"vocab.safetensors", "token_freq.safetensors", "stats.json"} <= set(modes)
    assert {name: mode for name, mode in modes.items() if name != ".run.lock"} == \
        {name: 0o666 & ~mask for name in modes if name != ".run.lock"}
    import torch

    from eagle3.atomic import save_safetensors

    save_safetensors({"x": torch.zeros(2)}, tmp_path / "one.safetensors")
    assert (tmp_path / "one.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask
    assert [p.name for p in tmp_path.glob(".one.safetensors.tmp*")] == []


def test_no_held_out_split_is_refused_when_composed_and_when_prepared(compose, tiny_llama_dir, workspace, tmp_path):
    """Without a held-out split nothing downstream can run as documented (extraction's agreement
    check, training's held-out metrics, export's verification prompts): prepare.eval_fraction=0 is
    refused when the config is composed, naming what to set; a dataset too small to hold one out
    fails prepare (never recorded complete with an empty eval split)."""
    for bad in ("prepare.eval_fraction=0", "prepare.eval_fraction=0.0", "prepare.eval_min=0"):
        with pytest.raises(Exception, match=r"held-out.*prepare\.eval_min"):
            compose("stage=prepare", bad)
    data = write_jsonl(tmp_path / "one.jsonl", chat_records(1))
    from eagle3.data.sources import DataError

    with pytest.raises(DataError, match=r"1 sample.*held out"):
        _prepare(compose, tiny_llama_dir, workspace, f"data.path={data}")
    rec = Manifest(Path(workspace) / "e").record("prepare", Manifest(Path(workspace) / "e").read()["stages"]["prepare"]["latest"])
    assert rec.status == "failed"


def test_a_regeneration_kv_cache_that_cannot_fit_is_refused_naming_its_key(compose, tiny_llama_dir, workspace,
                                                                           tmp_path):
    """As export's: vLLM on a CPU would refuse it after loading the target, naming its own flags."""
    import psutil

    from eagle3.kv_cache import KVCacheError

    huge = int(psutil.virtual_memory().total / 2**30) + 1000
    data = write_jsonl(tmp_path / "c.jsonl", chat_records(4))
    with pytest.raises(KVCacheError, match=rf"prepare.regen.kv_cache_gb={huge} does not fit.*at most"):
        _prepare(compose, tiny_llama_dir, workspace, f"data.path={data}", "prepare.regenerate=true",
                 f"prepare.regen.kv_cache_gb={huge}")
