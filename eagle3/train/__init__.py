"""The train stage's library (the stage itself is stages/train.py).

- attention.py: the TTT attention (prefix + diagonals), its masks and backends (flex, sdpa)
- ttt.py: TTTModel, the draft unrolled over its own predictions, with the loss and statistics
- loss.py: soft cross-entropy against the target's distribution
- target_head.py: the frozen target head (targets, embeddings) and a batch -> TTTModel's inputs
- data.py: epoch orders, packing, collation, and which rows each process takes at each step
- source.py: HiddenStateSource, what the loop reads (a store on disk, or an online source)
- optim.py: fused AdamW, the LR schedule, gradient clipping folded into the AdamW kernel
- muon.py: FastMuon, torch's Muon update in fewer FLOPs (Gram-form Newton-Schulz, batched)
- symmm.py (kernels in _symmm_kernels.py): Muon's symmetric products as one Triton kernel over the
  upper tile-triangle
- metrics.py: StepMetrics (loss, accuracy, acceptance per TTT step), FLOPs/MFU, metrics.jsonl
- checkpoint.py: resumable checkpoints and the loop state they carry
- loop.py: train(), the Accelerate loop that ties them together, and the draft it writes
- inputs.py: what the stage hands train(): the store opened and verified, the draft's config, the
  target's head
"""
