"""Errors that mean the user must change something; jobs print them and exit non-zero."""


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and how to fix it."""


class InputError(ValueError):
    """The input data cannot be used (missing path, empty class, wrong schema, ...)."""


class ClusterError(RuntimeError):
    """The cluster could not do the work: no room for the workers (or no GPU), or failures
    outlasted the retries."""
