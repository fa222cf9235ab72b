"""User-facing errors: the CLI prints their message (what is wrong and how to fix it), no traceback."""


class Eagle3Error(RuntimeError):
    """Base class for errors caused by inputs, configs or the environment rather than by a bug."""
