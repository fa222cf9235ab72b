"""The training step's optimizers and GPU kernels: torch and Triton code that knows nothing of stages,
stores or configs (a key's value comes in as an argument), imported by eagle3/train/ and eagle3/model/.

- muon.py: FastMuon, torch's Muon update in fewer FLOPs (Gram-form Newton-Schulz, batched, sharded
  over processes)
- symmm.py (kernels in _symmm_kernels.py): Muon's symmetric products as one Triton kernel over the
  upper tile-triangle
- head_loss.py (kernel in _head_loss_kernels.py): the draft head and its soft cross-entropy as one op
- fp8_matmul.py: the draft layer's matmuls in float8 (``train.fp8_matmul``)

What each was measured to bring, and against what: bench/results/kernels_history_202612.md and the
results files it links.
"""
