"""Config composition through the real Hydra app: every file composes, bad keys/types fail."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from eagle3.config import Config
from eagle3.preflight import UnknownKeyError

CONF = Path(__file__).resolve().parent.parent / "conf"


def _group_options():
    for group in sorted(p for p in CONF.iterdir() if p.is_dir() and p.name != "hydra"):
        for f in sorted(group.glob("*.yaml")):
            yield group.name, f.stem


@pytest.mark.parametrize("group,option", list(_group_options()))
def test_every_config_file_composes(compose, group, option):
    extra = []
    if group in ("target", "data") and "???" in (CONF / group / f"{option}.yaml").read_text():
        extra = {"target": ["target.path=/some/model"], "data": ["data.path=/some/file.jsonl"]}[group]
        if option == "mixture":
            extra = ["data.sources=[{path: /a.jsonl, weight: 2.0}, {path: /b.jsonl, weight: 0.5}]"]
    cfg = compose(f"{group}={option}", *extra)
    assert isinstance(cfg, Config)


def test_public_keys(compose):
    cfg = compose("target.path=/m", "data.path=/d.jsonl", "workspace=/w", "experiment=myexp",
                  "train.lr=3e-4", "train.ttt_steps=3", "export.from=/x")
    assert (cfg.target.path, cfg.data.path, cfg.workspace, cfg.name) == ("/m", "/d.jsonl", "/w", "myexp")
    assert cfg.train.lr == 3e-4 and cfg.train.ttt_steps == 3 and cfg.export.from_ == "/x"


def test_experiment_preset_sets_name(compose):
    assert compose("experiment=smollm2_large").name == "smollm2_large"


def test_smollm2_large_trains_eagle31_and_refuses_formats_that_cannot_carry_it(compose):
    """The preset took EAGLE-3.1 (bench/results/draft31_h200_202611.md); the schema's default draft stays EAGLE-3."""
    m = compose("experiment=smollm2_large").train.model
    assert (m.norm_before_fc, m.fc_norm, m.norm_output) == (True, True, True)
    d = compose().train.model
    assert (d.norm_before_fc, d.fc_norm, d.norm_output) == (False, False, False)
    with pytest.raises((ConfigCompositionException, ValueError), match="sglang cannot carry norm_before_fc"):
        compose("experiment=smollm2_large", "export.format=sglang")
    m = compose("experiment=smollm2_large", "export.format=speculators", "train.model.fc_norm=false").train.model
    assert (m.norm_before_fc, m.fc_norm, m.norm_output) == (True, False, True)


def test_presets_train_with_muon_at_their_measured_step_the_schema_with_adamw(compose):
    """The embedded default and smollm2_large took Muon at muon_lr 2e-3 (docs/configuration.md,
    "EAGLE-3.1 drafts and the optimizer"); the schema keeps AdamW, and an explicit muon_lr enters the train hash."""
    from eagle3.config import TrainConfig
    from eagle3.hashing import semantic_dict
    for preset in ((), ("experiment=smollm2_large",)):
        t = compose(*preset).train
        assert (t.optimizer, t.muon_lr) == ("muon", 2e-3)
        assert semantic_dict(t)["muon_lr"] == 2e-3
    assert TrainConfig().optimizer == "adamw"
    assert compose("target.path=/m").train.optimizer == "adamw"  # your own target drops the embedded default


def test_unknown_key_fails_at_compose(compose):
    with pytest.raises(UnknownKeyError, match="unknown key train.bogus: no key is close"):
        compose("train.bogus=1")


@pytest.mark.parametrize("override,fix", [
    ("train.ttt_step=3", "did you mean train.ttt_steps=3?"),  # Hydra's hint was: use +train.ttt_step=3
    ("+train.ttt_step=3", "did you mean train.ttt_steps=3?"),  # which then trained with the default
    ("+trian.lr=5e-4", "did you mean train.lr=5e-4?"),
    ("++train.model.fc_nrom=true", "did you mean train.model.fc_norm=true?"),
    ("+ttt_steps=3", "did you mean train.ttt_steps=3?"),
    ("train.fc_norm=true", "did you mean train.model.fc_norm=true?"),
])
def test_unknown_keys_are_refused_in_plain_and_plus_form_with_the_closest_name(compose, override, fix):
    with pytest.raises(UnknownKeyError, match=re.escape(f"unknown key {override.lstrip('+').split('=')[0]}: {fix}")):
        compose(override)


def test_a_composed_config_with_a_key_the_schema_lacks_is_refused():
    """Whatever adds the key (a `+` override, a sweeper's parameter, a YAML file of one's own):
    to_config refuses it, where OmegaConf.to_object kept it as a stray attribute of the dataclass."""
    from eagle3.__main__ import _compose
    from eagle3.config import to_config

    dcfg = _compose(["+train.ttt_step=3"])  # Hydra alone accepts it
    assert dcfg.train.ttt_step == 3
    with pytest.raises(UnknownKeyError, match="train.ttt_step: did you mean train.ttt_steps"):
        to_config(dcfg)
    with pytest.raises(Exception, match="wieght"):  # an element of a list of sections: OmegaConf checks it
        to_config(_compose(["data=mixture", "data.sources=[{path: /a.jsonl, wieght: 2.0}]"]))


@dataclasses.dataclass
class _SectionWithFreeForm:
    lr: float = 1.0
    extra: Dict[str, Any] = dataclasses.field(default_factory=dict)


def test_keys_below_a_dict_field_stay_free_form():
    """The schema has no dict field today; one added later keeps its keys free-form."""
    from omegaconf import OmegaConf

    from eagle3.preflight import _is_known, check_config_keys

    assert _is_known(["extra", "anything"], root=_SectionWithFreeForm) and _is_known(["lr"], root=_SectionWithFreeForm)
    assert not _is_known(["lrr"], root=_SectionWithFreeForm)
    dcfg = OmegaConf.structured(_SectionWithFreeForm)
    dcfg.extra.anything = 3
    check_config_keys(dcfg)


def test_groups_and_hydra_keys_are_not_schema_keys(compose):
    assert compose("debug=fast", "~experiment", "logger=jsonl", "data=jsonl", "data.path=/d.jsonl",
                   "hydra.job.chdir=false").name == "default"


def test_bad_type_fails_at_compose(compose):
    with pytest.raises((ConfigCompositionException, ValidationError)):
        compose("train.lr=fast")


@pytest.mark.parametrize("override,fragment", [
    ("extract.backend=tensorrt", "extract.backend"),
    ("train.decay=1.5", "train.decay"),
    ("stage=deploy", "stage"),
    ("extract.layer_ids=[2,2,3]", "duplicates"),
    # numbers torch (or vLLM) would refuse only after prepare and extract had run
    ("train.betas=[0.9,1.5]", r"train.betas must be two values in \[0, 1\)"),
    ("train.betas=[-0.1,0.95]", r"train.betas must be two values in \[0, 1\)"),
    ("train.weight_decay=-0.1", "train.weight_decay must be >= 0"),
    ("train.min_lr_ratio=2", r"train.min_lr_ratio must be in \[0.0, 1.0\]"),
    ("train.muon_momentum=1.0", r"train.muon_momentum must be in \[0.0, 1.0\)"),
    ("train.grad_clip=0", "train.grad_clip must be > 0"),
    ("train.warmup_steps=-1", "train.warmup_steps must be >= 0"),
    ("train.max_seq_len=0", "train.max_seq_len must be > 0"),
    ("train.model.head_dim=-32", "train.model.head_dim must be >= 0"),
    ("prepare.regen.top_p=0", r"prepare.regen.top_p must be in \(0.0, 1.0\]"),
    ("prepare.regen.temperature=-1", "prepare.regen.temperature must be >= 0"),
    ("prepare.num_proc=0", "prepare.num_proc must be > 0"),
    ("extract.kv_cache_gb=0", "extract.kv_cache_gb must be > 0"),
    ("extract.max_num_seqs=0", "extract.max_num_seqs must be > 0"),
    ("export.gpu_memory_utilization=1.5", r"export.gpu_memory_utilization must be in \(0.0, 1.0\]"),
    ("prepare.regen.gpu_memory_utilization=0", r"prepare.regen.gpu_memory_utilization must be in \(0.0, 1.0\]"),
    ("extract.layer_ids=[-1,2,3]", "extract.layer_ids must be layer numbers >= 0"),
])
def test_invalid_values_name_the_key(compose, override, fragment):
    with pytest.raises(Exception, match=fragment):
        compose(override)


def _run_cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "eagle3", *args], capture_output=True, text=True, timeout=60, **kw)


def test_help_and_cfg_do_not_import_heavy_modules():
    code = ("import sys; sys.argv=['eagle3', '--cfg', 'job']\n"
            "from eagle3.__main__ import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'vllm', 'transformers', 'datasets') if m in sys.modules]\n"
            "assert not heavy, heavy\nprint('LIGHT')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "LIGHT" in out.stdout, out.stderr


def test_cli_bad_key_exits_2_naming_the_closest_key(tmp_path):
    for arg in ("train.nope=1", "+train.ttt_step=3", "train.ttt_step=3"):
        out = _run_cli("stage=status", f"workspace={tmp_path}/ws", arg, cwd=tmp_path)
        assert out.returncode == 2 and "eagle3: invalid config: unknown key train." in out.stderr, out.stderr
        assert "To append to your config use" not in out.stderr  # Hydra's hint, which led to the + form
    assert list(tmp_path.iterdir()) == []


def test_cli_invalid_value_exits_2():
    out = _run_cli("stage=status", "extract.backend=foo")
    assert out.returncode == 2 and "extract.backend" in out.stderr


def test_embedded_default_and_path_overrides(compose):
    default = compose()
    assert default.stage == "all" and default.target.path == "" and default.data.path == ""
    assert default.prepare.regenerate is True  # the built-in prompts have no responses to learn from
    user = compose("target.path=/m", "data.path=/d.jsonl")
    assert user.prepare.regenerate is False and user.target.path == "/m"
    assert compose("target.gguf=/x.gguf").target.gguf == "/x.gguf"


def test_path_keys_work_before_hydra_flags():
    """`target.gguf=FILE --cfg job`: the group a path key selects goes next to the overrides, not
    after the flag (Hydra's parser refused it there as an unknown argument)."""
    out = _run_cli("target.gguf=/x.gguf", "data.path=/d.jsonl", "--cfg", "job")
    assert out.returncode == 0, out.stderr
    assert "gguf: /x.gguf" in out.stdout and "regenerate: false" in out.stdout


def _leaves(node, prefix=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], node


@pytest.mark.parametrize("group,option", list(_group_options()))
def test_no_config_file_restates_a_schema_default(group, option):
    """Each default has one home (eagle3/config.py): a group entry sets only what differs from it."""
    import dataclasses

    from omegaconf import OmegaConf

    path = CONF / group / f"{option}.yaml"
    text = path.read_text()
    values = OmegaConf.to_container(OmegaConf.load(path)) or {}
    if "@package _global_" not in text:
        values = {group: values}
    schema = dataclasses.asdict(Config())
    for key, value in _leaves(values):
        if key == "defaults" or value == "???":
            continue
        node = schema
        for part in key.split("."):
            node = node[part]
        assert node != value, f"{path.name} sets {key}: {value!r}, which is already the schema's default"


def test_conf_has_no_group_that_only_restates_the_schema():
    """The stage sections have no YAML group: their values are the schema's (an experiment or the
    command line changes them)."""
    assert not {p.name for p in CONF.iterdir() if p.is_dir()} & {"prepare", "extract", "train", "export", "target"}


def test_fields_added_with_hash_omit_defaults_keep_existing_hashes():
    """EAGLE-3.1 draft options and the optimizer choice are left out of the train hash at their
    defaults (every existing run keeps its hash) and change it when set."""
    from eagle3.config import DraftModelConfig, TrainConfig
    from eagle3.hashing import semantic_dict

    plain = semantic_dict(TrainConfig())
    assert "optimizer" not in plain and "muon_lr" not in plain
    assert not {"norm_before_fc", "fc_norm", "norm_output"} & set(plain["model"])
    assert semantic_dict(TrainConfig(model=DraftModelConfig(fc_norm=True)))["model"]["fc_norm"] is True
    assert semantic_dict(TrainConfig(optimizer="muon"))["optimizer"] == "muon"
    assert "muon_lr" in semantic_dict(TrainConfig(muon_lr=2e-3))
    with pytest.raises(ValueError, match="train.optimizer='sgd' is not one of"):
        TrainConfig(optimizer="sgd")


def test_eagle31_options_an_export_format_cannot_carry_fail_at_compose_time(compose):
    """Before any training: the draft options that export.format would refuse, with the reason."""
    with pytest.raises(Exception, match="export.format=sglang do not go together.*no input_norm"):
        compose("train.model.norm_before_fc=true", "export.format=sglang")
    with pytest.raises(Exception, match="norm_output=true.*feeds back the pre-norm state"):
        compose("train.model.norm_output=true", "export.format=sglang")
    with pytest.raises(Exception, match="mutually exclusive"):
        compose("train.model.norm_before_fc=true", "train.model.fc_norm=true", "export.format=speculators")
    cfg = compose("train.model.norm_before_fc=true", "train.model.fc_norm=true", "train.model.norm_output=true")
    assert cfg.train.model.fc_norm and cfg.export.format == "vllm"  # vLLM loads every combination
    assert compose("train.model.fc_norm=true", "export.format=sglang").train.model.fc_norm


# Each section's semantic hash (hash_obj(semantic_dict(...))[:16]), computed at 2d4c22d, except the
# embedded default's (and debug=fast's, which builds on it) prepare and train: they changed when its
# prepare.regen.dtype and train.mixed_precision went from bfloat16 / bf16 to native (bf16 only where the CPU
# multiplies it natively: on an AVX2-only CPU bf16 matmuls ran 4x slower than float32).
PRESET_HASHES = {
    "": {"target": "52f27dff6f56caea", "data": "55b0fefde4041c5d", "prepare": "82307684d25f0f8c",
         "extract": "78a07bf8c32508cb", "train": "fe5d7ac2add35121", "export": "817ff0cb9fa4afb6"},
    "experiment=embedded_default": {"target": "52f27dff6f56caea", "data": "55b0fefde4041c5d",
                                    "prepare": "82307684d25f0f8c", "extract": "78a07bf8c32508cb",
                                    "train": "fe5d7ac2add35121", "export": "817ff0cb9fa4afb6"},
    "experiment=smollm2_large": {"target": "52f27dff6f56caea", "data": "1735d47884b1e161",
                                 "prepare": "d54387c0943c6b13", "extract": "78a07bf8c32508cb",
                                 "train": "42077865ea0dd75d", "export": "3adac53b9db003b2"},
    "debug=fast": {"target": "52f27dff6f56caea", "data": "67f6311695692cbe", "prepare": "cb29b9c5b4d001c9",
                   "extract": "78a07bf8c32508cb", "train": "20ad61c5c3b50425", "export": "a0ab8ef27f3200f8"},
}


@pytest.mark.parametrize("preset", sorted(PRESET_HASHES))
def test_presets_keep_their_config_hashes(compose, preset):
    """Reordering, grouping or documenting a schema's fields changes no preset's hash: every run
    already on disk keeps its artifacts' names."""
    from eagle3.hashing import hash_obj, semantic_dict

    cfg = compose(*([preset] if preset else []))
    got = {name: hash_obj(semantic_dict(getattr(cfg, name)))[:16] for name in PRESET_HASHES[preset]}
    assert got == PRESET_HASHES[preset]


def test_the_schemas_import_without_hydra_or_omegaconf():
    """Benchmarks and the GPU tests build the real TrainConfig where Hydra is not installed; its
    MISSING marker is OmegaConf's."""
    code = ("import sys; sys.modules['hydra'] = sys.modules['omegaconf'] = None\n"
            "from eagle3.config import MISSING, TrainConfig\n"
            "assert TrainConfig(optimizer='muon').muon_sym == 'auto'\n"
            "print(MISSING)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    from omegaconf import MISSING

    assert out.stdout.strip() == MISSING


def test_prompt_lookup_replay_of_sampled_runs_is_refused(compose):
    """export.prompt_lookup=replay replays greedy runs only: with a sampled temperature it is refused at
    composition, naming the settings to use; auto serves prompt lookup then, a bad value is named."""
    from eagle3.export.lookup_replay import lookup_mode

    with pytest.raises(Exception, match="export.prompt_lookup=served"):
        compose("export.prompt_lookup=replay", "export.eval_temperatures=[0,0.7]")
    cfg = compose("export.eval_temperatures=[0,0.7]")
    assert lookup_mode(cfg.export.prompt_lookup, cfg.export.eval_temperatures) == "served"
    assert lookup_mode(compose().export.prompt_lookup, [0.0]) == "replay"
    with pytest.raises(Exception, match="export.prompt_lookup"):
        compose("export.prompt_lookup=sometimes")
