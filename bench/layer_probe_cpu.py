"""prepare.draft_vocab_size=auto and extract.layer_ids=auto on the embedded default (CPU):
``python bench/layer_probe_cpu.py [WORKSPACE]``. The real prepare stage with auto, then the layer
probe computed (never from its cache); prints both choices and the probe's wall time."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    import torch
    import transformers

    from eagle3.__main__ import compose_config
    from eagle3.contracts import layer_probe_line, vocab_choice_line
    from eagle3.extract.layer_probe import run_probe
    from eagle3.manifest import Manifest
    from eagle3.runner import run
    from eagle3.target import resolve

    ws = sys.argv[1] if len(sys.argv) > 1 else "workspace"
    cfg = compose_config([f"workspace={ws}", "experiment=bench_choose", "stage=prepare", "logger=jsonl",
                          "prepare.draft_vocab_size=auto", "extract.layer_ids=auto", "progress=false"])
    t0 = time.perf_counter()
    run(cfg)
    t1 = time.perf_counter()
    target, prep = resolve(cfg.target, cfg.workspace), Manifest(cfg.experiment_dir).current("prepare")
    probe = run_probe(target, prep, cfg.extract, target.run_dtype(cfg.target.dtype))
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads; "
          f"prepare {t1 - t0:.1f} s; probe wall {time.perf_counter() - t1:.1f} s")
    print(vocab_choice_line(prep.facts.vocab_choice))
    print(layer_probe_line(probe))
    print(f"greedy {probe['greedy']}; positions {probe['positions']}, {probe['classes']} classes")


if __name__ == "__main__":
    main()
