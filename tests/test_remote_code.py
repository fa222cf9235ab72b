"""A target that ships its own Python code runs it only with ``target.trust_remote_code=true``:
refused before anything loads otherwise (whatever the terminal answers), and passed to every
transformers and vLLM load when set. The target is a tiny Llama whose config names classes in its
own files (tests/conftest.py: build_remote_code_target); importing those files leaves a mark."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import build_remote_code_target, build_tiny_llama, chat_records, child_env, write_jsonl


def _cli(*args, env, stdin=""):
    return subprocess.run([sys.executable, "-m", "eagle3", *args], capture_output=True, text=True, input=stdin,
                          env=env, timeout=900)


@pytest.fixture
def remote(tmp_path):
    ran = tmp_path / "the-target's-code-ran"
    target = build_remote_code_target(tmp_path / "target", ran)
    env = child_env()
    env["HF_MODULES_CACHE"] = str(tmp_path / "hf_modules")  # where transformers copies a checkpoint's code
    return target, ran, env


def test_remote_code_reasons_name_the_classes(tmp_path, remote):
    from eagle3.target import identify, remote_code

    target, ran, _ = remote
    info = identify(target)
    (reason,) = remote_code(info.path, info.config)
    assert "eagle3_test_remote_llama" in reason and "modeling_remote_llama.RemoteLlamaForCausalLM" in reason
    assert not ran.exists()  # reading the config ran nothing
    # an auto_map beside a model_type transformers has: transformers' own class loads it, no code runs
    plain = build_tiny_llama(tmp_path / "plain")
    conf = json.loads((plain / "config.json").read_text())
    conf["auto_map"] = {"AutoModelForCausalLM": "modeling_x.X"}
    (plain / "config.json").write_text(json.dumps(conf))
    assert remote_code(plain, conf) == []
    # a tokenizer of its own class
    tok = json.loads((plain / "tokenizer_config.json").read_text())
    tok.update(tokenizer_class="RemoteTokenizer", auto_map={"AutoTokenizer": ["tokenization_x.RemoteTokenizer", None]})
    (plain / "tokenizer_config.json").write_text(json.dumps(tok))
    (reason,) = remote_code(plain, conf)
    assert "tokenizer_class 'RemoteTokenizer'" in reason and "tokenization_x.RemoteTokenizer" in reason


def test_identity_covers_the_targets_code(remote):
    from eagle3.target import identify

    target, _, _ = remote
    before = identify(target)
    with open(target / "modeling_remote_llama.py", "a") as f:
        f.write("# changed\n")
    after = identify(target)
    assert before.hash != after.hash and before.files["modeling_remote_llama.py"] != after.files["modeling_remote_llama.py"]


@pytest.mark.vllm
@pytest.mark.slow
def test_target_code_runs_only_when_trusted(tmp_path, remote):
    target, ran, env = remote
    data = write_jsonl(tmp_path / "chats.jsonl", chat_records(16))
    common = [f"target.path={target}", f"data.path={data}", f"workspace={tmp_path / 'ws'}", "experiment=rc",
              "logger=jsonl", "progress=false", "prepare.draft_vocab_size=128", "extract.layer_ids=[1,2,3]",
              "train.max_steps=2", "train.eval_every=2", "train.warmup_steps=1", "train.ttt_steps=2",
              "export.eval_prompts=2", "export.eval_max_tokens=8", "export.eval_ks=[1]", "export.num_speculative_tokens=1"]
    # not trusted: refused, naming the key, though the terminal says yes to transformers' question
    out = _cli("stage=prepare", *common, env=env, stdin="y\n")
    assert out.returncode != 0
    err = out.stdout + out.stderr
    assert "target.trust_remote_code=true" in err and "modeling_remote_llama.py" in err, err[-3000:]
    assert "Traceback" not in err and not ran.exists()

    # trusted: every stage loads it (vLLM extraction and its parity check against transformers, the
    # export's offline evaluator and vLLM engines)
    out = _cli("stage=all", *common, "target.trust_remote_code=true", env=env)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert ran.exists()
    assert "served by vLLM" in out.stdout

    # the extract stage refuses it too when the setting is dropped, before any load
    ran.unlink()
    out = _cli("stage=extract", *common, "extract.verify_samples=1", env=env, stdin="y\n")
    assert out.returncode != 0 and "target.trust_remote_code=true" in out.stdout + out.stderr
    assert not ran.exists()
