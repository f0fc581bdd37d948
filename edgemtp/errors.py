"""Errors raised at edgemtp's boundaries.

Every message says what was expected and what came, in one line, so the CLI can print it
as is and exit non-zero without a traceback.
"""


class EdgeMTPError(Exception):
    """Base class of every error edgemtp raises on purpose."""


class ConfigError(EdgeMTPError, ValueError):
    """A generation option or budget that cannot be honoured."""


class BudgetError(ConfigError):
    """A block-complexity budget too small for the requested plan."""


class ModelLoadError(EdgeMTPError):
    """A model folder or package that cannot be loaded."""


class UnsupportedModelError(ModelLoadError):
    """A model whose family edgemtp does not know."""


class BackendUnavailableError(EdgeMTPError):
    """A backend whose optional dependency is not installed."""


class ContextClampedWarning(UserWarning):
    """``Model.load(max_context=N)`` above what the model holds: its own context is used."""
