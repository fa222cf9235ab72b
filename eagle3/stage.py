"""A stage as a declaration, and the one runner of the recipe every stage shares.

A stage (one module of ``stages/``, ``STAGE = MyStage()``) declares

- what it consumes: :meth:`Stage.consume` resolves the target and the upstream runs through the
  manifest (``manifest.consume_upstream``; the stage graph is ``eagle3.contracts.UPSTREAM``) and
  refuses what it cannot take, before any job exists; it returns the stage's :class:`Inputs`;
- how its identity is computed: :meth:`Stage.identity`, the config its run is hashed by (the run's
  directory and its record in the manifest are named by that hash);
- its work: :meth:`Stage.work` ``(job, inputs) -> Facts`` (eagle3.contracts), done by the library.

:meth:`Stage.run` is the recipe, written once: consume, start the job, claim it (a run complete
with this config is announced and returned: nothing to do), the checks that need the job but no
engine (:meth:`Stage.before`), the work inside ``with job`` (complete on success, failed on an
exception), the stage's closing lines (:meth:`Stage.report`). What a stage does differently is a
hook it overrides (train runs on every process of a launch, extract in parts, export publishes a
complete run again); the job, not the stage, says that a run is complete (``job.claim()``).

Not here: the stages that record nothing (``stage=plan``, ``stage=produce``): a plain
``run(cfg, manifest)``.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional


class Inputs(SimpleNamespace):
    """What :meth:`Stage.consume` resolved: ``cfg`` (the validated eagle3.config.Config), ``target``
    (eagle3.target.TargetInfo), ``upstream`` ({stage: StageRecord}, the runs it reads, recorded with
    the job) and whatever else the stage's work needs."""


class Stage:
    """One stage of the pipeline, declared (module docstring). Subclasses set :attr:`name` and
    implement :meth:`consume`, :meth:`identity` and :meth:`work`."""

    name: str = ""

    # -- the declaration
    def consume(self, cfg, manifest) -> Inputs:
        raise NotImplementedError

    def identity(self, inputs: Inputs) -> dict:
        raise NotImplementedError

    def work(self, job, inputs: Inputs):
        """The stage's work; its outputs added to ``job``; returns its Facts."""
        raise NotImplementedError

    # -- hooks, where a stage differs from the plain recipe
    def start(self, manifest, inputs: Inputs):
        """The job of this run (named by its identity's hash)."""
        return manifest.start(self.name, config=self.identity(inputs), target=inputs.target.identity(),
                              inputs=inputs.upstream)

    def claim(self, job, inputs: Inputs):
        """The complete run of this config (then there is nothing to do), else None: the job is this run's."""
        return job.claim()

    def complete_already(self, done, inputs: Inputs) -> None:
        """What a run complete already still does (nothing by default)."""

    def before(self, job, inputs: Inputs) -> None:
        """Refusals and preparations after the claim, before the job runs (nothing by default)."""

    def execute(self, job, inputs: Inputs):
        """The work inside the job; the record of the complete run (None: not this process's to record)."""
        with job:
            job.facts = self.work(job, inputs)
        return job.record

    def report(self, record, inputs: Inputs) -> None:
        """The stage's closing lines, on the process that recorded the run (nothing by default)."""

    # -- the recipe
    def run(self, cfg, manifest) -> Optional[object]:
        inputs = self.consume(cfg, manifest)
        job = self.start(manifest, inputs)
        if (done := self.claim(job, inputs)) is not None:
            self.complete_already(done, inputs)
            return done
        self.before(job, inputs)
        record = self.execute(job, inputs)
        if record is not None and job.is_main:
            self.report(record, inputs)
        return record
