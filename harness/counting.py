"""A filesystem that counts the bytes read through it, across processes, for tests and benchmarks.

    counter = ByteCounter(pafs.LocalFileSystem(), tmp_path / "reads")
    root = counter.location(Location.parse(...))   # read the dataset through `root`
    counter.total()                                 # bytes read so far, by every process

Each file opened for reading appends the bytes read from it to the counts file when it is
closed, with O_APPEND: DataLoader processes and Ray tasks (which get the filesystem pickled)
add their own lines without a lock. `FlakyHandler` also fails some opens, for the tests of the
retries of storage errors.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from pipeline.core.storage import Location


class ByteCounter:
    """`fs`: the wrapped filesystem, reading through to `inner`; `total()`: bytes read so far."""

    def __init__(self, inner: pafs.FileSystem, counts: str | os.PathLike):
        self.counts = str(counts)
        Path(self.counts).touch()
        self.fs = pafs.PyFileSystem(CountingHandler(inner, self.counts))

    def location(self, loc: Location) -> Location:
        """`loc`, read through the counting filesystem."""
        return Location(self.fs, loc.path, loc.uri)

    def total(self) -> int:
        return sum(int(line) for line in Path(self.counts).read_text().split())


class CountingHandler(pafs.FileSystemHandler):
    """Every call goes to `inner`; files opened for reading are wrapped to count."""

    def __init__(self, inner: pafs.FileSystem, counts: str):
        self.inner, self.counts = inner, counts

    def __eq__(self, other):
        return isinstance(other, CountingHandler) and (self.inner, self.counts) == (
            other.inner,
            other.counts,
        )

    def __ne__(self, other):
        return not self == other

    def get_type_name(self):
        return f"counting+{self.inner.type_name}"

    def normalize_path(self, path):
        return self.inner.normalize_path(path)

    def get_file_info(self, paths):
        return self.inner.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.inner.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.inner.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.inner.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.inner.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        self.inner.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path):
        self.inner.delete_file(path)

    def move(self, src, dest):
        self.inner.move(src, dest)

    def copy_file(self, src, dest):
        self.inner.copy_file(src, dest)

    def open_input_stream(self, path):
        return pa.PythonFile(CountedReads(self.inner.open_input_stream(path), self.counts), "r")

    def open_input_file(self, path):
        return pa.PythonFile(CountedReads(self.inner.open_input_file(path), self.counts), "r")

    def open_output_stream(self, path, metadata):
        return self.inner.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path, metadata):
        return self.inner.open_append_stream(path, metadata=metadata)


class CountedReads:
    """The Python file API over a pyarrow file, counting the bytes its reads return."""

    def __init__(self, f: pa.NativeFile, counts: str):
        self.f, self.counts, self.read_bytes = f, counts, 0

    def read(self, nbytes=None):
        data = self.f.read(nbytes)
        self.read_bytes += len(data)
        return data

    def seek(self, position, whence=0):
        return self.f.seek(position, whence)

    def tell(self):
        return self.f.tell()

    def size(self):
        return self.f.size()

    def readable(self):
        return True

    def seekable(self):
        return self.f.seekable()

    def writable(self):
        return False

    @property
    def closed(self):
        return self.f.closed

    def close(self):
        if self.f.closed:
            return
        self.f.close()
        fd = os.open(self.counts, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, f"{self.read_bytes}\n".encode())  # one short write: appended whole
        finally:
            os.close(fd)


class FlakyHandler(CountingHandler):
    """Reads and writes through `inner`, where opening a file fails with `error` as storage
    does when a connection drops: the first `failures` opens in each process, and then every
    `every`-th one (0: never)."""

    def __init__(
        self, inner: pafs.FileSystem, counts: str, *, error: OSError, failures: int, every=0
    ):
        super().__init__(inner, counts)
        self.error, self.failures, self.every, self.opened = error, failures, every, 0

    def _open(self) -> None:
        self.opened += 1
        if self.opened <= self.failures or (self.every and self.opened % self.every == 0):
            raise self.error

    def open_input_stream(self, path):
        self._open()
        return super().open_input_stream(path)

    def open_input_file(self, path):
        self._open()
        return super().open_input_file(path)

    def open_output_stream(self, path, metadata):
        self._open()
        return super().open_output_stream(path, metadata)
