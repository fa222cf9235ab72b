"""``stage=plan``: disk, time and GPU-hours of this config before running it (``eagle3.plan``).

Reads the data sources (or the prepared dataset of this config when one is complete), measures a
few probes on this machine (cached in ``${workspace}/plan_cache.json``, the only file written) and
prints the table. Records nothing in the manifest.
"""
from __future__ import annotations


def run(cfg, manifest):
    from eagle3.plan import make_plan, print_plan

    plan = make_plan(cfg, manifest)
    print_plan(plan)
    return None
