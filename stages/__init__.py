"""One module per stage (installed as ``eagle3.stages``), each with a single entry ``run(cfg, manifest)``.

A stage that records a run is a declaration (eagle3/stage.py: ``STAGE = Prepare()``, ``run = STAGE.run``):
what it consumes (``consume``: the target and its upstream runs, resolved and refused before any
job exists), how its identity is computed (``identity``: the config its run is hashed by) and its
work (``work(job, inputs) -> Facts``, done by the library in eagle3/); the one runner,
``eagle3.stage.Stage.run``, does the recipe around them:

    inputs = stage.consume(cfg, manifest)                # the stage graph: eagle3.contracts.UPSTREAM
    job = manifest.start(name, config=stage.identity(inputs), target=..., inputs=inputs.upstream)
    if (done := job.claim()) is not None:                # complete with this config: nothing to do
        return done
    with job:                                            # complete on success, failed on an exception
        job.facts = stage.work(job, inputs)              # eagle3.contracts
    stage.report(job.record, inputs)                     # the closing lines

``cfg`` is the validated :class:`eagle3.config.Config`; ``manifest`` the experiment's
:class:`eagle3.manifest.Manifest`. Stages never import each other. Where a stage differs it
overrides a hook, and the job, not the stage, says that a run is already complete
(``job.claim()``), runs a stage on every process of a launch (``job.across_ranks()``: train) and
records a scale-out run once all its parts are done (``job.run_parts``: extract). ``plan`` and
``produce`` record nothing: a plain ``run()``. The stages' steps are their library's
(eagle3/data/build.py, eagle3/extract/recording.py, eagle3/train_inputs.py, eagle3/export/pipeline.py).
"""
