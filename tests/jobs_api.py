"""A stand-in for a Ray head's Job REST API, served from a thread of the test process: enough of
it for Ray's JobSubmissionClient to submit a job, stream and read its log and read its end (the
routes of ray.dashboard.modules.job.job_head), and for a test to break the connection where it
chooses. No Ray cluster runs."""

from __future__ import annotations

import asyncio
import math
import threading
from dataclasses import dataclass, field

import ray
from aiohttp import web

from harness.cluster import free_port

NO_AGENT = "No available agent to submit job, please try again later."
LINE_S = 0.01  # between two lines of a job's log


@dataclass
class Job:
    submission_id: str
    entrypoint: str
    log: list[str] = field(default_factory=list)
    status: str = "RUNNING"
    exit_code: int | None = None
    message: str = ""

    def details(self) -> dict:
        return {
            "type": "SUBMISSION",
            "job_id": None,
            "submission_id": self.submission_id,
            "status": self.status,
            "entrypoint": self.entrypoint,
            "message": self.message,
            "driver_exit_code": self.exit_code,
        }


class JobsAPI:
    """Each job submitted writes `lines`, then ends as `ending` says: ("SUCCEEDED", 0) or
        ("FAILED", its exit code). The first `busy` submissions are answered 500 NO_AGENT, as Ray's
        head answers while its job agent is not up. With `drop_after`, the first log stream is cut
        (no close frame: 1006) once that many lines have gone out, and the job waits for the cut;
        then, by `after_drop`: "reconnect" the API serves on; "poll" its log stream answers 502 from
        then on (a proxy that passes no websocket) while the rest answers; "vanish" the server stops
        listening (connection refused); "forget" it answers 404 for the job (a restarted head);
        "hang" the stream goes silent and stays open, and no request is answered any more (a
        host gone without a word, or a proxy that holds the connection). With
    `late_s`, it listens only that long after it starts (a head whose dashboard is starting).
    With `hold`, a submission is taken (its job runs, until stopped) and never answered: a
    request cut short by an interrupt. `stops` counts the requests to stop a job."""

    def __init__(
        self,
        lines: list[str],
        ending: tuple[str, int] = ("SUCCEEDED", 0),
        *,
        busy: float = 0,
        drop_after: int | None = None,
        after_drop: str = "reconnect",
        late_s: float = 0,
        hold: bool = False,
    ):
        self.lines, self.ending = lines, ending
        self.busy, self.drop_after, self.after_drop = busy, drop_after, after_drop
        self.late_s, self.hold = late_s, hold
        self.jobs: dict[str, Job] = {}
        self.tasks: set[asyncio.Task] = set()  # the jobs running
        self.posts = self.streams = self.stops = 0
        self.port = free_port()
        self.address = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> JobsAPI:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/version", self.version)
        app.router.add_route("*", "/api/packages/{protocol}/{name}", self.package)
        app.router.add_post("/api/jobs/", self.submit)
        app.router.add_get("/api/jobs/{id}", self.info)
        app.router.add_post("/api/jobs/{id}/stop", self.stop)
        app.router.add_get("/api/jobs/{id}/logs", self.logs)
        app.router.add_get("/api/jobs/{id}/logs/tail", self.tail)
        self.dropped = asyncio.Event()
        self.stopping = asyncio.Event()
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        self.site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        if self.late_s:
            self.loop.call_later(self.late_s, lambda: self.loop.create_task(self.site.start()))
        else:
            await self.site.start()

    async def _stop(self) -> None:
        self.stopping.set()  # what "hang" holds, let go
        for task in self.tasks:
            task.cancel()
        await self.runner.cleanup()

    async def version(self, request):
        return web.json_response(
            {"version": "4", "ray_version": ray.__version__, "ray_commit": "", "session_name": "f"}
        )

    async def package(self, request):  # every package is "already uploaded"
        return web.Response()

    async def submit(self, request):
        self.posts += 1
        if self.posts <= self.busy:
            return web.Response(text=NO_AGENT, status=500)
        body = await request.json()
        job = Job(body["submission_id"], body["entrypoint"])
        self.jobs[job.submission_id] = job
        self.tasks.add(asyncio.get_running_loop().create_task(self._run(job)))
        if self.hold:
            await self.stopping.wait()  # taken, never answered
        return web.json_response({"submission_id": job.submission_id, "job_id": None})

    async def _run(self, job: Job) -> None:
        for i, line in enumerate(self.lines):
            if i == self.drop_after:
                await self.dropped.wait()  # the cut comes while the job runs
            job.log.append(line)
            await asyncio.sleep(LINE_S)
        if self.hold:
            await self.stopping.wait()  # runs until stopped
        if job.status != "RUNNING":  # stopped
            return
        job.status, job.exit_code = self.ending
        job.message = "Job finished successfully." if job.exit_code == 0 else "Job failed."

    async def _job(self, request) -> Job | None:
        if self.after_drop == "hang" and self.dropped.is_set():
            await self.stopping.wait()  # taken, never answered
        if self.after_drop == "forget" and self.dropped.is_set():
            return None
        return self.jobs.get(request.match_info["id"])

    async def info(self, request):
        job = await self._job(request)
        if job is None:
            return web.Response(text=f"Job {request.match_info['id']} does not exist", status=404)
        return web.json_response(job.details())

    async def stop(self, request):
        self.stops += 1
        job = await self._job(request)
        if job is None:
            return web.Response(text=f"Job {request.match_info['id']} does not exist", status=404)
        running = job.status == "RUNNING"
        if running:
            job.status, job.message = "STOPPED", "Job was intentionally stopped."
        return web.json_response({"stopped": running})

    async def logs(self, request):
        job = await self._job(request)
        if job is None:
            return web.Response(text="no such job", status=404)
        return web.json_response({"logs": "".join(job.log)})

    async def tail(self, request):
        job = await self._job(request)
        if job is None:
            return web.Response(text="no such job", status=404)
        if self.after_drop == "poll" and self.dropped.is_set():
            return web.Response(text="Bad Gateway", status=502)
        self.streams += 1
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        # As Ray's head does: the log from its start, then each line as it comes. What is
        # there already goes in one message, so a stream taken up again starts mid-message.
        sent = len(job.log)
        if sent:
            await ws.send_str("".join(job.log))
        # Only the first stream is cut, and only with drop_after.
        first = self.streams == 1 and self.drop_after is not None
        cut = self.drop_after if first else math.inf
        while True:
            if sent >= cut and self.after_drop == "hang":
                self.dropped.set()
                await self.stopping.wait()  # open, and silent
                return ws
            if sent >= cut:
                request.transport.abort()  # no close frame: the client reads close code 1006
                self.dropped.set()
                if self.after_drop == "vanish":
                    await self.site.stop()  # connection refused from here on
                return ws
            if sent < len(job.log):
                await ws.send_str(job.log[sent])
                sent += 1
            elif job.status != "RUNNING":
                await ws.close()
                return ws
            else:
                await asyncio.sleep(LINE_S)
