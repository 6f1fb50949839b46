"""Paths and URIs as strings: joined and checked without touching storage or importing pyarrow,
so that the chain's client, which runs where only Ray's client is installed, derives its paths
the same way the jobs do."""

from __future__ import annotations

import posixpath

# The URI schemes pyarrow.fs opens; a local path needs none.
SCHEMES = ("file", "s3", "gs", "gcs", "abfs", "abfss", "hdfs", "viewfs")


def join_uri(uri: str, *parts: str) -> str:
    """`uri` with `parts` joined onto its path, before its query (`?endpoint_override=...`)."""
    base, sep, query = uri.partition("?")
    return posixpath.join(base, *parts) + (sep + query if sep else "")


def parent_uri(uri: str) -> str:
    """The directory that holds `uri`, with the same query."""
    base, sep, query = uri.partition("?")
    return posixpath.dirname(base.rstrip("/")) + (sep + query if sep else "")


def check_scheme(uri: str) -> None:
    """Raise ValueError, saying what to write instead, for a URI of a scheme pyarrow cannot open."""
    scheme, sep, _ = uri.partition("://")
    if not sep or scheme in SCHEMES:
        return
    hint = f"; schemes are lower case: {scheme.lower()}://" if scheme.lower() in SCHEMES else ""
    raise ValueError(
        f"no filesystem opens URIs of the scheme {scheme}://{hint} (use an absolute path or one "
        f"of {', '.join(s + '://' for s in SCHEMES)})"
    )
