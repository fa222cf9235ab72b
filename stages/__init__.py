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
:class:`eagle3.manifest.Manifest`. Stages never import each other.
"""
