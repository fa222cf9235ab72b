"""Errors of the export stage and of acceptance evaluation (printed without a traceback by the CLI)."""
from ..errors import Eagle3Error


class ExportError(Eagle3Error):
    """The draft cannot be exported as asked (inputs disagree, output directory taken, ...)."""


class ImportDraftError(ExportError):
    """A draft given with export.from= is not in a layout eagle3 can read, or does not fit the target."""


class VerificationError(ExportError):
    """The exported draft failed verification in vLLM (refused to load, not lossless, or it does not
    compute what the trained draft computes)."""
