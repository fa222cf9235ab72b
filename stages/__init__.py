"""One module per stage, each with a single entry ``run(cfg, manifest)``.

``cfg`` is the validated :class:`eagle3.config.Config`; ``manifest`` the experiment's
:class:`eagle3.manifest.Manifest`. A stage reads its inputs only through ``manifest.consume``,
starts its run with ``manifest.start`` (whose config hash names the output directory), returns
early when that run is already complete, and records outputs and facts on the job. Stages never
import each other.
"""
