"""Errors that mean the user must change something, and the exit code each one ends a job with:
the contract docs/errors.md states, in one place for every job and the chain."""

from __future__ import annotations


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


# pyarrow's errors for Parquet bytes that are not what was written. They are OSErrors, as a
# failed read's are, but reading again reads the same bytes. The shards' own reader tells the
# two apart by where the error arose (dataset.read_row_group); these are for any other read.
PARQUET_DAMAGE_MARKS = (
    "Couldn't deserialize thrift",
    "Unexpected end of stream",
    "decompression failed",
    "Invalid page header",
    "CRC checksum verification failed",
    "Parquet magic bytes not found",
)
# Storage errors that retrying cannot fix: the request itself is wrong, or the bytes.
PERMANENT_TYPES = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
PERMANENT_MARKS = (
    # pyarrow names S3's errors by its own enum ("AWS Error NO_SUCH_KEY during CopyObject"),
    # S3 itself in CamelCase: both spellings.
    "NO_SUCH_BUCKET",
    "NO_SUCH_KEY",
    "NoSuchBucket",
    "NoSuchKey",
    "not found. To create buckets",  # pyarrow's own, making a folder in a missing bucket
    "ACCESS_DENIED",
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    # Google Cloud Storage's status codes (google::cloud::Status(PERMISSION_DENIED: ...)), and
    # Azure's error codes ("Azure Error: [AuthorizationFailure] 403 ...") for a refused request.
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
    "[AuthenticationFailed]",
    "[AuthorizationFailure]",
    "[AuthorizationPermissionMismatch]",
    "Path does not exist",
    "No such file",
    *PARQUET_DAMAGE_MARKS,
)


def is_transient(error: BaseException) -> bool:
    """Whether the same storage call may succeed if tried again."""
    if not isinstance(error, OSError) or isinstance(error, PERMANENT_TYPES):
        return False
    return not any(mark in str(error) for mark in PERMANENT_MARKS)


def failure(error: BaseException) -> tuple[int, str] | None:
    """The exit code and the `error: ` line that end a job or the chain on `error`; None for an
    error that is no one's input (a bug), which keeps its traceback."""
    if isinstance(error, tuple(EXIT_CODES)):
        code = next(code for kind, code in EXIT_CODES.items() if isinstance(error, kind))
        return code, task_error(error) or str(error)
    if isinstance(error, ConnectionError):  # a service that does not answer: it may come back
        return EXIT_CODES[ClusterError], f"cannot connect: {first_line(error)}"
    if isinstance(error, OSError):
        # Storage that failed for good: a wrong path, bucket or credentials is the input's fault
        # (1); one that kept failing through every retry, the service's (3).
        code = EXIT_CODES[ClusterError if is_transient(error) else InputError]
        return code, f"storage: {first_line(error)}"
    return None


def task_error(error: BaseException) -> str | None:
    """The message of the error a Ray task raised, where `error` is Ray's RayTaskError of it
    (whose text is the task's traceback); else None."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException) and isinstance(error, type(cause)):
        # Ray Data adds lines of its own to the cause's message (its retries).
        return first_line(cause)
    return None


def first_line(error: BaseException) -> str:
    """The error's message up to its first line break."""
    # Native libraries' messages run on (pyarrow's HDFS lists every path it tried).
    return str(error).strip().partition("\n")[0]


def validation_problems(error) -> str:
    """A pydantic ValidationError's first problems on one line: `field: message; ...`."""
    return "; ".join(
        f"{'.'.join(map(str, err['loc'])) or 'file'}: {err['msg']}" for err in error.errors()[:3]
    )
