"""The train stage's library (the stage itself is stages/train.py).

- attention.py: the TTT attention (prefix + diagonals), its masks and backends (flex, sdpa)
- ttt.py: TTTModel, the draft unrolled over its own predictions, with the loss and statistics
- loss.py: soft cross-entropy against the target's distribution
- target_head.py: the frozen target head (targets, embeddings) and a batch -> TTTModel's inputs
- data.py: epoch orders, packing, collation, and which rows each process takes at each step
- source.py: HiddenStateSource, what the loop reads (a store on disk, or an online source)
- optim.py: fused AdamW or Muon + AdamW, the LR schedule, gradient clipping folded into the update
  (Muon itself, the fused head loss and the float8 matmuls are in eagle3/kernels/)
- metrics.py: StepMetrics (loss, accuracy, acceptance per TTT step), FLOPs/MFU, metrics.jsonl
- checkpoint.py: resumable checkpoints and the loop state they carry
- loop.py: train(), the Accelerate loop that ties them together, and the draft it writes
- inputs.py: what the stage hands train(): the store opened and verified, the draft's config, the
  target's head
"""
