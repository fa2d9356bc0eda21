"""User-facing errors.

Every error a user can cause (bad path, unsupported architecture, short corpus, corrupted file,
wrong key) is an `MLPSurgeryError` whose message names the problem and the fix. The CLI prints
these without a traceback and exits with status 2; anything else is a bug and keeps its traceback.
"""


class MLPSurgeryError(Exception):
    """A problem with the user's input, explained in the message (what is wrong and how to fix it)."""


class UnsupportedArchitectureError(MLPSurgeryError):
    """The model's architecture has no site specification."""


class NotExportableError(MLPSurgeryError):
    """The model's structure has no stock `transformers` equivalent."""


class IntegrityError(MLPSurgeryError):
    """A file was truncated, corrupted or tampered with, or does not belong to this model."""
