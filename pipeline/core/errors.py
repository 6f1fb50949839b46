"""Errors that mean the user must change something, and the exit code each one ends a job with."""


class InputError(ValueError):
    """The input data cannot be used (missing path, empty class, wrong schema, ...)."""


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and how to fix it."""


class ClusterError(RuntimeError):
    """The cluster could not do the work: no room for the workers (or no GPU), or failures
    outlasted the retries."""


# A job's exit code: 0 done, then one per kind of error. `python -m jobs.submit` passes a
# failed job's code on, so a scheduler sees which it was.
EXIT_CODES: dict[type[Exception], int] = {InputError: 1, ConfigError: 2, ClusterError: 3}
