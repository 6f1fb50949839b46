"""Paths that may be local or any URI pyarrow.fs understands (s3://, gs://, ...)."""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass

import pyarrow.fs as pafs


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
        try:
            fs, path = pafs.FileSystem.from_uri(uri)
        except (pafs.ArrowInvalid, ValueError) as e:
            raise ValueError(f"cannot open {uri!r}: {e}") from None
        return cls(fs, path.rstrip("/"), uri)

    def child(self, *parts: str) -> Location:
        base, sep, query = self.uri.partition("?")
        uri = posixpath.join(base, *parts) + (sep + query if sep else "")
        return Location(self.fs, posixpath.join(self.path, *parts), uri)

    def info(self) -> pafs.FileInfo:
        return self.fs.get_file_info(self.path)

    def exists(self) -> bool:
        return self.info().type != pafs.FileType.NotFound

    def is_dir(self) -> bool:
        return self.info().type == pafs.FileType.Directory

    def read_bytes(self) -> bytes:
        with self.fs.open_input_stream(self.path) as f:
            return f.read()

    def create_parent(self) -> str:
        """Make the directory this file goes in; return its path."""
        parent = posixpath.dirname(self.path)
        self.fs.create_dir(parent, recursive=True)
        return parent

    def write_bytes(self, data: bytes) -> None:
        """Write so that readers see the old content or the new, never a partial file."""
        parent = self.create_parent()
        if isinstance(self.fs, pafs.LocalFileSystem):
            tmp = posixpath.join(parent, f".{posixpath.basename(self.path)}.tmp-{os.getpid()}")
            with self.fs.open_output_stream(tmp) as f:
                f.write(data)
            self.fs.move(tmp, self.path)  # rename(2): atomic on one filesystem
        else:
            # An object store's single PUT is atomic already.
            with self.fs.open_output_stream(self.path) as f:
                f.write(data)

    def delete(self) -> None:
        """Remove a file or a whole directory; a missing path is fine."""
        info = self.info()
        if info.type == pafs.FileType.Directory:
            self.fs.delete_dir(self.path)
        elif info.type == pafs.FileType.File:
            self.fs.delete_file(self.path)

    def list_files(self) -> list[pafs.FileInfo]:
        """All files below this directory, recursively, sorted by path."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.path, recursive=True))
        return sorted((i for i in infos if i.type == pafs.FileType.File), key=lambda i: i.path)

    def list_dirs(self) -> list[pafs.FileInfo]:
        """Direct subdirectories, sorted by name; none if this directory does not exist."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        return sorted((i for i in infos if i.type == pafs.FileType.Directory), key=lambda i: i.path)
