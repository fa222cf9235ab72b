"""The file names of every stage's artifacts, each defined once.

A stage's outputs live in ``${workspace}/${experiment}/<stage>/<config hash>/``; these are the
names inside that directory that the next stage (and a user) reads. The manifest records each
output's size and sha256 (``eagle3.manifest``); the typed facts beside them are in
``eagle3.contracts``.
"""

# prepare
DATASET_DIR = "dataset"                   # datasets.DatasetDict: train / eval splits
VOCAB_FILE = "vocab.safetensors"          # d2t / t2d (eagle3.data.vocab)
TOKEN_FREQ_FILE = "token_freq.safetensors"
STATS_FILE = "stats.json"
REGENERATED_FILE = "regenerated.jsonl"    # the conversations with the target's own answers

# extract: the hidden-state store (eagle3.store)
STORE_JSON = "store.json"                 # written last: the store is complete once it exists
INDEX_JSON = "index.json"                 # one per split directory

# train
DRAFT_FILE = "draft.safetensors"          # vLLM tensor names, float32
DRAFT_CONFIG_FILE = "draft_config.json"   # eagle3.model.Eagle3DraftConfig
VLLM_CONFIG_FILE = "draft_vllm_config.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"           # step-XXXXXXXX/, valid once COMPLETE exists inside
CHECKPOINT_COMPLETE = "COMPLETE"

# export
MODEL_DIR = "model"                       # the served draft directory
EXPORT_MARKER = "eagle3_export.json"      # inside MODEL_DIR: what was exported, from what
