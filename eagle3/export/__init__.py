"""Export and acceptance evaluation of EAGLE-3 drafts.

- checkpoint.py: ``DraftCheckpoint``, a draft under vLLM's tensor names (what every format renames)
- formats.py: writers for ``vllm`` (default), ``speculators`` and ``sglang`` layouts
- importers.py: readers for drafts written by eagle3, EAGLE/SpecForge (``midlayer``) and speculators
- sources.py: the draft to export, from the manifest (train/extract/prepare runs) or ``export.from``
- outdir.py: publishing into ``export.out_dir`` without clobbering another model, swapped in whole or not at all
- acceptance.py: acceptance statistics counted as vLLM counts them
- offline_eval.py: chain speculative decoding in PyTorch (HF target + draft)
- vllm_eval.py: greedy generation in vLLM counting drafts, accepted tokens and target steps
- verify.py: ``export.verify``: load in vLLM, lossless check, agreement with the offline evaluator,
  acceptance by k, prompt-lookup baseline
- prompts.py: held-out prompts from the prepare stage's eval split (and export.extra_prompts)
- context_length.py: acceptance per bucket of prompt context length (export.context_buckets)
- model_card.py: the export's README.md
- pipeline.py: the export stage's steps: written and verified in a partial directory, the
  ExportFacts the marker and the model card are derived from, the summary it prints

Heavy imports (torch, vllm, transformers) happen inside these modules, which the stages import
lazily.
"""
