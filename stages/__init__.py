"""One module per stage, each with a single entry ``run(cfg, manifest)`` that reads as the same
recipe (docs/architecture.md):

    inputs = manifest.consume_upstream(STAGE, target.identity())  # the stage graph: eagle3.contracts.UPSTREAM
    job = manifest.start(STAGE, config=..., target=..., inputs=inputs)
    if (done := job.claim()) is not None:                    # complete with this config: nothing to do
        return done
    with job:                                                # complete on success, failed on an exception
        ...                                                  # the work, done by the library (eagle3/)
        job.facts = <the stage's Facts>                      # eagle3.contracts

``cfg`` is the validated :class:`eagle3.config.Config`; ``manifest`` the experiment's
:class:`eagle3.manifest.Manifest`. Stages never import each other. The job, not the stage, says that
a run is already complete (``job.claim()``), runs a stage on every process of a launch
(``job.across_ranks()``: train) and records a scale-out run once all its parts are done
(``job.run_parts``: extract). A ``run()`` reads in one page; its steps are its library's
(eagle3/data/build.py, eagle3/extract/recording.py, eagle3/train/inputs.py, eagle3/export/pipeline.py).
"""
