"""GCS as pyarrow opens it, but with folders that have no marker object.

GCS has no folders, only object names with slashes; pyarrow marks a folder it makes with an
object of its own (`name/`), and writers that make no markers (Ray Train's checkpoint uploads
among them) leave folders without one (apache/arrow, cpp/src/arrow/filesystem/gcsfs.cc):
- a listing of a folder leaves them out: a resumed run found none of its checkpoints, and
  trained again from scratch beside Ray's record of them;
- delete_dir deletes the objects below one, then fails (NOT_FOUND) on its missing marker.
Here a listing finds them by the names of the objects they hold, and such a delete succeeds once
nothing is left below the folder. And a file opened for random access seeks to its end, as
torch.load's zip reader does first, without the request that GCS answers with 416.
"""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.fs as pafs


class _Handler(pafs.FileSystemHandler):
    """Every call goes to `fs`, a GcsFileSystem; delete_dir forgives a missing marker."""

    def __init__(self, fs: pafs.GcsFileSystem):
        self.fs = fs

    def __eq__(self, other) -> bool:
        return isinstance(other, _Handler) and self.fs.equals(other.fs)

    def __ne__(self, other) -> bool:
        return not self == other

    def __reduce__(self):
        return _Handler, (self.fs,)

    def get_type_name(self) -> str:
        return "gcs"

    def normalize_path(self, path: str) -> str:
        return self.fs.normalize_path(path)

    def get_file_info(self, paths):
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector):
        if selector.recursive:
            return self.fs.get_file_info(selector)
        # pyarrow lists a folder's objects and marker objects, not the folders below it that
        # have no marker: those are found from the names of the objects they hold.
        below = pafs.FileSelector(
            selector.base_dir, allow_not_found=selector.allow_not_found, recursive=True
        )
        base = selector.base_dir.rstrip("/")
        children: dict[str, pafs.FileInfo] = {}
        for info in self.fs.get_file_info(below):
            name, sep, _ = info.path[len(base) + 1 :].partition("/")
            path = f"{base}/{name}"
            if not sep:
                children[path] = info  # an object, or a folder's marker
            elif path not in children:
                children[path] = pafs.FileInfo(path, pafs.FileType.Directory)
        return [children[path] for path in sorted(children)]

    def create_dir(self, path: str, recursive: bool) -> None:
        self.fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        try:
            self.fs.delete_dir(path)
        except FileNotFoundError:
            # The objects below are deleted; the marker it failed on was never written.
            if self.fs.get_file_info(path).type != pafs.FileType.NotFound:
                raise

    def delete_dir_contents(self, path: str, missing_dir_ok: bool) -> None:
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        self.fs.delete_dir_contents("", accept_root_dir=True)

    def delete_file(self, path: str) -> None:
        self.fs.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self.fs.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.fs.copy_file(src, dest)

    def open_input_stream(self, path: str):
        return self.fs.open_input_stream(path)

    def open_input_file(self, path: str):
        native = self.fs.open_input_file(path)
        return pa.PythonFile(_Ranged(native, native.size()), mode="r")

    def open_output_stream(self, path: str, metadata):
        return self.fs.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path: str, metadata):
        return self.fs.open_append_stream(path, metadata=metadata)


class _Ranged(io.RawIOBase):
    """A GCS object read by ranges from its known size: a seek only moves the position."""

    def __init__(self, native: pa.NativeFile, size: int):
        self.native, self.size, self.position = native, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = start + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def read(self, size: int = -1) -> bytes:
        left = max(0, self.size - self.position)
        size = left if size is None or size < 0 else min(size, left)
        data = self.native.read_at(size, self.position) if size else b""
        self.position += len(data)
        return data

    def readall(self) -> bytes:
        return self.read()

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self.native.close()
        super().close()


def markerless(fs: pafs.FileSystem) -> pafs.FileSystem:
    """`fs`, and a GcsFileSystem wrapped so that deleting a folder without a marker works."""
    return pafs.PyFileSystem(_Handler(fs)) if isinstance(fs, pafs.GcsFileSystem) else fs
