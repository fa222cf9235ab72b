"""`stage=plan` against the real runs of a workspace: the plan's time per stage on this machine beside
each stage's real time (the manifest's started/ended of its complete run of this config), as a table.

    python3 bench/plan_vs_real.py WORKSPACE [OVERRIDES...]            # the probes measured now (or cached)
    python3 bench/plan_vs_real.py WORKSPACE --machine KEY [OVERRIDES] # the probes cached under KEY in
                                                                      # WORKSPACE/plan_cache.json (e.g. taken
                                                                      # on a quiet machine), none measured now
"""
import argparse
import datetime as dt
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import eagle3.plan as plan  # noqa: E402
from eagle3.compose import compose_config  # noqa: E402
from eagle3.manifest import Manifest  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("workspace")
ap.add_argument("--machine", default="", help="the machine key of cached probes to use (plan_cache.json)")
ap.add_argument("overrides", nargs="*")
args = ap.parse_args()
if args.machine:
    plan._machine = lambda: args.machine
cfg = compose_config(["stage=plan", f"workspace={args.workspace}", *args.overrides])
manifest = Manifest(cfg.experiment_dir)
p = plan.make_plan(cfg, manifest)
if args.machine and any(v.get("cached") is False for v in p["probes"].values()):
    sys.exit(f"a probe ran now: {args.workspace}/plan_cache.json holds none for machine {args.machine!r}")
m = json.loads((Path(cfg.experiment_dir) / "manifest.json").read_text())["stages"]
real = {}
for s in ("prepare", "extract", "train", "export"):
    rec = manifest.current(s)
    run = m.get(s, {}).get("runs", {}).get(rec.config_hash) if rec is not None else None
    if run and run.get("status") == "complete":
        real[s] = (dt.datetime.fromisoformat(run["ended"]) - dt.datetime.fromisoformat(run["started"])).total_seconds()
print("export prompts:", p["export_prompts"])
print("| stage | plan s | real s | plan / real |")
print("| --- | ---: | ---: | ---: |")
for s in ("prepare", "extract", "train", "export"):
    t = p["times"]["here"][s]
    print(f"| {s} | {t:.0f} | " + (f"{real[s]:.0f} | {t / real[s]:.2f} |" if s in real else "no complete run | |"))
