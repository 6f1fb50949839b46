"""Paths that may be local or any URI pyarrow.fs understands (s3://, gs://, ...), and retries of
the storage errors that pass.

pyarrow raises OSError for a dropped connection, a timeout or a 503 as for a missing key: every
read and write of the bundle goes through `retry`, which tries again, with backoff, what may
pass and gives up at once on what cannot (a missing file, a denied request).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import posixpath
import random
import shutil
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pyarrow.fs as pafs

from pipeline.core.errors import ConfigError, is_transient
from pipeline.core.gcs import markerless
from pipeline.core.uris import check_scheme, join_uri, parent_uri

log = logging.getLogger(__name__)
T = TypeVar("T")

# Attempts in all, and the wait before the second: doubled each time, with jitter, so five
# attempts span about 8 s, what a storage service's brief unavailability lasts.
ATTEMPTS = 5
FIRST_WAIT_S = 0.5


def retry(call: Callable[[], T], what: str) -> T:
    """`call()`, tried again on transient storage errors; the last error if they persist."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return call()
        except OSError as e:
            if attempt == ATTEMPTS or not is_transient(e):
                raise
            wait = FIRST_WAIT_S * 2 ** (attempt - 1) * random.uniform(0.5, 1.0)
            log.warning(
                "%s failed (%s); attempt %d of %d in %.1f s", what, e, attempt + 1, ATTEMPTS, wait
            )
            time.sleep(wait)
    raise AssertionError("unreachable")


# A version's name begins with its writer's start time (UTC), so that names sort by start.
VERSION_TIME = "%Y%m%dT%H%M%S%fZ"


def new_version(now: datetime.datetime | None = None) -> str:
    """A version's name: the start time `now` (default: the current time), then a short uuid
    that keeps two writers started in the same microsecond apart."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return f"{now:{VERSION_TIME}}-{uuid.uuid4().hex[:8]}"


def version_started(name: str) -> datetime.datetime | None:
    """When the writer of version `name` started; None if the name is not one new_version makes."""
    try:
        return datetime.datetime.strptime(name.partition("-")[0], VERSION_TIME).replace(
            tzinfo=datetime.timezone.utc
        )
    except ValueError:
        return None


@dataclass(frozen=True)
class Location:
    """A directory or file on some filesystem; picklable, so it travels to Ray tasks."""

    fs: pafs.FileSystem
    path: str
    uri: str

    @classmethod
    def parse(cls, uri: str) -> Location:
        """Local paths (relative ones too) or URIs; query options such as
        `?endpoint_override=...` are passed to pyarrow."""
        if "://" not in uri:
            return cls(pafs.LocalFileSystem(), os.path.abspath(uri), os.path.abspath(uri))
        scheme = uri.partition("://")[0]
        try:
            check_scheme(uri)
            fs, path = pafs.FileSystem.from_uri(uri)
        except ValueError as e:  # pyarrow's ArrowInvalid is one: a URI it cannot parse
            raise ConfigError(f"cannot open {uri}: {e}") from None
        except OSError as e:
            if scheme not in ("hdfs", "viewfs"):
                raise
            # pyarrow loads Java and libhdfs when it first opens an HDFS URI.
            raise ConfigError(
                f"cannot open {uri}: {str(e).partition(chr(10))[0]}; HDFS needs Java and libhdfs "
                "on every node (JAVA_HOME, ARROW_LIBHDFS_DIR)"
            ) from None
        return cls(markerless(_with_environment(fs, uri)), path.rstrip("/"), uri)

    def child(self, *parts: str) -> Location:
        return Location(self.fs, posixpath.join(self.path, *parts), join_uri(self.uri, *parts))

    @property
    def parent(self) -> Location:
        return Location(self.fs, posixpath.dirname(self.path), parent_uri(self.uri))

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    def same_place(self, uri: str) -> bool:
        """Whether `uri` names this place, however it is spelled (a trailing slash, a relative
        or file:// local path), decided from the two strings: no storage is touched, so a URI
        of a store this process cannot reach is simply another place."""
        return _place(self.uri) == _place(uri)

    def info(self) -> pafs.FileInfo:
        return retry(lambda: self.fs.get_file_info(self.path), f"looking up {self.uri}")

    def exists(self) -> bool:
        return self.info().type != pafs.FileType.NotFound

    def is_dir(self) -> bool:
        return self.info().type == pafs.FileType.Directory

    def read_bytes(self) -> bytes:
        def read() -> bytes:
            with self.fs.open_input_stream(self.path) as f:
                return f.read()

        return retry(read, f"reading {self.uri}")

    def create_parent(self) -> str:
        """Make the directory this file goes in; return its path."""
        parent = posixpath.dirname(self.path)
        retry(lambda: self.fs.create_dir(parent, recursive=True), f"creating {parent}")
        return parent

    def write_bytes(self, data: bytes) -> None:
        """Write so that readers see the old content or the new, never a partial file."""
        parent = self.create_parent()

        def write() -> None:
            if isinstance(self.fs, pafs.LocalFileSystem):
                name = f"{partial_prefix(posixpath.basename(self.path))}{os.getpid()}"
                tmp = posixpath.join(parent, name)
                with self.fs.open_output_stream(tmp) as f:
                    f.write(data)
                self.fs.move(tmp, self.path)  # rename(2): atomic on one filesystem
            else:
                # An object store's single PUT is atomic already.
                with self.fs.open_output_stream(self.path) as f:
                    f.write(data)

        retry(write, f"writing {self.uri}")

    def delete(self) -> None:
        """Remove a file or a whole directory; a missing path is fine."""
        info = self.info()
        if info.type == pafs.FileType.Directory:
            retry(lambda: self.fs.delete_dir(self.path), f"deleting {self.uri}")
        elif info.type == pafs.FileType.File:
            retry(lambda: self.fs.delete_file(self.path), f"deleting {self.uri}")

    def list_files(self) -> list[pafs.FileInfo]:
        """All files below this directory, recursively, sorted by path."""
        selector = pafs.FileSelector(self.path, recursive=True)
        infos = retry(lambda: self.fs.get_file_info(selector), f"listing {self.uri}")
        return sorted((i for i in infos if i.type == pafs.FileType.File), key=lambda i: i.path)

    def list_dirs(self) -> list[pafs.FileInfo]:
        """Direct subdirectories, sorted by name; none if this directory does not exist."""
        selector = pafs.FileSelector(self.path, allow_not_found=True)
        infos = retry(lambda: self.fs.get_file_info(selector), f"listing {self.uri}")
        return sorted((i for i in infos if i.type == pafs.FileType.Directory), key=lambda i: i.path)


# What the nodes' environment adds to a gs:// or abfs:// URI's filesystem, as AWS_ENDPOINT_URL
# and AWS_ACCESS_KEY_ID do to an s3:// one; pyarrow reads neither variable itself.
GCS_EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
AZURE_KEY_ENV = "AZURE_STORAGE_ACCOUNT_KEY"
# How long Google's client retries one GCS call before it fails, unless the URI says
# (`retry_limit_seconds=`). Its own default is 15 minutes, which with `retry`'s attempts could
# hold the job of a node that cannot reach GCS (no route, no credentials) for over an hour.
GCS_RETRY_LIMIT_S = 20


def _with_environment(fs: pafs.FileSystem, uri: str) -> pafs.FileSystem:
    """`fs` pointed where the environment says, unless `uri` said otherwise. With
    STORAGE_EMULATOR_HOST (`http://host:port`), gs:// goes to that emulator, unauthenticated,
    as Google's own clients do; with AZURE_STORAGE_ACCOUNT_KEY, abfs:// signs its requests with
    that key (Azurite's, or an account's that takes keys) instead of Azure's default credential
    chain. Every gs:// call gives up after GCS_RETRY_LIMIT_S. The filesystem is rebuilt from its
    own arguments, the ones pickling uses."""
    query = uri.partition("?")[2]
    host = os.environ.get(GCS_EMULATOR_ENV)
    if isinstance(fs, pafs.GcsFileSystem):
        options = fs.__reduce__()[1][0]
        if host and "endpoint_override=" not in query:
            scheme, _, authority = host.rstrip("/").rpartition("://")
            options.update(anonymous=True, scheme=scheme or "http", endpoint_override=authority)
        if options["retry_time_limit"] is None:
            options["retry_time_limit"] = datetime.timedelta(seconds=GCS_RETRY_LIMIT_S)
        return pafs.GcsFileSystem(**options)
    if isinstance(fs, pafs.AzureFileSystem) and "credential_kind=" not in query:
        options = fs.__reduce__()[1][0]
        key = os.environ.get(AZURE_KEY_ENV)
        if key and not any(options[k] for k in ("sas_token", "client_id")):
            return pafs.AzureFileSystem(**{**options, "account_key": key})
    return fs


def partial_prefix(name: str) -> str:
    """How the temporary file of a write of `name` in progress (or crashed) begins, on local
    disk (Location.write_bytes)."""
    return f".{name}.tmp-"


def _place(uri: str) -> tuple[str, str, str]:
    """(scheme, normalised path, query) of a local path or a URI."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return "file", os.path.abspath(uri), ""
    path, _, query = rest.partition("?")
    if scheme == "file":
        return "file", os.path.abspath(path), query
    return scheme, posixpath.normpath(path), query


# Written first into each version directory the bundle makes (a dataset's, an inference run's):
# retention removes only directories that hold it, never by a name's look.
VERSION_MARKER = "_version.json"


def mark_version(directory: Location) -> None:
    """Mark `directory`, a version named by new_version, as the bundle's, before anything else is
    written in it."""
    version = posixpath.basename(directory.path)
    directory.child(VERSION_MARKER).write_bytes(json.dumps({"version": version}).encode())


def is_marked(directory: Location) -> bool:
    """Whether the bundle made `directory` (mark_version)."""
    return directory.child(VERSION_MARKER).exists()


def foreign_entries(
    root: Location, own: Collection[str], *, versions: str | None = None
) -> list[str]:
    """What directory `root` holds that the bundle did not write, sorted: the entries not named
    in `own` (nor a write of one of them in progress), and in `root/<versions>/` those that are
    no version directory with the bundle's marker."""
    listing = pafs.FileSelector(root.path)
    entries = retry(lambda: root.fs.get_file_info(listing), f"listing {root.uri}")
    names = [e.base_name for e in entries]
    foreign = [n for n in names if n not in own and not n.startswith(_partials(own))]
    if versions is not None and versions in names:
        below = root.child(versions)
        listing = pafs.FileSelector(below.path)
        inside = retry(lambda: root.fs.get_file_info(listing), f"listing {below.uri}")
        foreign += [
            f"{versions}/{e.base_name}"
            for e in inside
            if e.type != pafs.FileType.Directory or not is_marked(below.child(e.base_name))
        ]
    return sorted(foreign)


def _partials(names: Collection[str]) -> tuple[str, ...]:
    return tuple(partial_prefix(n) for n in names)


def publish_directory(staged: Path, output: Location, *, last: str) -> None:
    """Make the files of the local directory `staged` the new directory `output`, so that a
    reader finds all of them whole or none. On local disk they are copied into a temporary
    sibling, which one rename(2) then makes `output`; a rename refuses an `output` that has
    appeared meanwhile, and the sibling is removed. On object stores, where a move is a copy and
    a delete (neither atomic nor safe to retry), each file is put straight into place, each PUT
    atomic, and `last` goes last: a reader that finds `last` finds every other file whole."""
    files = sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file())
    assert last in files, (last, files)
    if isinstance(output.fs, pafs.LocalFileSystem):
        sibling = output.parent.child(f".{output.name}.tmp-{new_version()}")
        try:
            shutil.copytree(staged, sibling.path)
            os.rename(sibling.path, output.path)  # fails on an output that is no empty directory
        finally:
            shutil.rmtree(sibling.path, ignore_errors=True)
        return
    local = pafs.LocalFileSystem()
    for name in [*(f for f in files if f != last), last]:
        target = output.child(name)
        retry(
            lambda f=name, t=target: pafs.copy_files(
                str(staged / f), t.path, source_filesystem=local, destination_filesystem=t.fs
            ),
            f"writing {target.uri}",
        )
