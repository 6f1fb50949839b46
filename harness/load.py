"""A bounded HTTP load on loopback, for the serving tests and bench/serve.py.

`concurrency` threads, each with one keep-alive connection, post the bodies in turn: each waits
for its answer before the next request (a closed loop, so at most `concurrency` requests are in
flight), and waits `pause_s` after each answer before its next request (0: at once). Each stops at
`stop()`, after `duration_s` or after `requests` in all, whichever comes
first; every answer is recorded, a dropped connection as an answer without a status.
"""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

# What a client retries: the proxy's timeout, the server's transient failures and the
# gateway's. Classifying an image changes nothing on the server, so a retried POST is safe.
RETRYABLE = frozenset({408, 500, 502, 503, 504})


@dataclass
class Answer:
    status: int | None  # None: no HTTP answer (connection refused, reset or closed early)
    body: bytes
    headers: dict[str, str]
    error: str  # why there is no status
    sent_at: float  # time.monotonic()
    latency_s: float
    request: bytes = b""  # the body sent, to send again

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status in RETRYABLE

    def json(self) -> dict:
        return json.loads(self.body)

    def timing_ms(self) -> dict[str, float]:
        """The replica's Server-Timing header: {"decode": ms, "queue": ms, "forward": ms}."""
        timing = {}
        for part in self.headers.get("server-timing", "").split(","):
            name, _, dur = part.strip().partition(";dur=")
            if dur:
                timing[name] = float(dur)
        return timing


class Client:
    """One keep-alive HTTP/1.1 connection, opened again after any failure."""

    def __init__(self, url: str, timeout_s: float = 60):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port or 80
        self.path = parts.path or "/"
        self.timeout_s = timeout_s
        self.conn: http.client.HTTPConnection | None = None

    def request(
        self, method: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> Answer:
        sent = time.monotonic()
        try:
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            self.conn.request(method, self.path, body=body, headers=headers or {})
            response = self.conn.getresponse()
            data = response.read()
            answer = Answer(
                response.status,
                data,
                {k.lower(): v for k, v in response.getheaders()},
                "",
                sent,
                time.monotonic() - sent,
            )
            if response.will_close:
                self.close()
            return answer
        except (OSError, http.client.HTTPException) as e:
            self.close()
            return Answer(None, b"", {}, repr(e), sent, time.monotonic() - sent)

    def post(self, body: bytes) -> Answer:
        answer = self.request("POST", body, {"Content-Type": "application/octet-stream"})
        answer.request = body
        return answer

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def post(url: str, body: bytes, timeout_s: float = 60) -> Answer:
    """One POST on a connection of its own."""
    client = Client(url, timeout_s)
    try:
        return client.post(body)
    finally:
        client.close()


@dataclass
class Load:
    """`with Load(url, bodies, concurrency=8, duration_s=5) as load: ...; load.answers`."""

    url: str
    bodies: list[bytes]
    concurrency: int
    duration_s: float = 60
    requests: int | None = None
    timeout_s: float = 60
    pause_s: float = 0
    answers: list[Answer] = field(default_factory=list)

    def __post_init__(self):
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sent = itertools.count()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True)
            for i in range(self.concurrency)
        ]

    def _run(self, index: int) -> None:
        client = Client(self.url, self.timeout_s)
        deadline = time.monotonic() + self.duration_s
        bodies = itertools.islice(itertools.cycle(self.bodies), index, None)
        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                if self.requests is not None and next(self._sent) >= self.requests:
                    break
                answer = client.post(next(bodies))
                with self._lock:
                    self.answers.append(answer)
                if self.pause_s:
                    self._stop.wait(self.pause_s)
        finally:
            client.close()

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> list[Answer]:
        self._stop.set()
        return self.wait()

    def wait(self) -> list[Answer]:
        for t in self._threads:
            t.join()
        return self.answers

    def __enter__(self) -> Load:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
