"""Errors that mean the user must change something; jobs print them and exit non-zero."""


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and how to fix it."""


class InputError(ValueError):
    """The input data cannot be used (missing path, empty class, wrong schema, ...)."""


class TrainingFailed(RuntimeError):
    """Training stopped for good: workers could not be placed, or failures outlasted retries."""
