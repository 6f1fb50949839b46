"""Errors that mean the user must change something; jobs print them and exit non-zero."""


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and how to fix it."""


class InputError(ValueError):
    """The input data cannot make a dataset (missing path, empty class, nothing usable)."""
