"""The chain's side of a job on the cluster: submitted, and followed to its end whatever happens
to the connection.

A cluster that cannot take a submission yet (its dashboard not up, "No available agent ... try
again later", a proxy's 502) is tried again for `Patience.submit_s`. A log stream that drops is
streamed again from where it stopped, or the log is polled while it cannot be; the job's end is
read from its status, never from the stream. A cluster that answers nothing for
`Patience.reconnect_s` while a job runs ends the chain with exit 3 and the job's id: the job may
still run there. A connection that goes silent (a host gone without a word, a proxy that holds
it) is found out too: no request waits longer than `REQUEST_S` for its answer, and a log stream
silent for `QUIET_S` is checked by asking for the job's status, and left once that status is an
end (a stream that died without a word after the job ended: an idle NAT or firewall, a proxy).
A chain interrupted once a request to take its job has gone out stops that job (`stop`)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.core.errors import ClusterError, first_line

POLL_S = 2.0  # between tries, and between polls of a job whose log stream is down
REQUEST_S = 30.0  # the longest a request to the dashboard may go unanswered
QUIET_S = 30.0  # a log stream silent this long: is the cluster still there, the job running?
# How long after an interrupted submission request the job may take to appear on the cluster:
# the head registers it at once, and the request's answer may be all that was lost.
TAKEN_S = 10.0
# The dashboard's answer when the head's job agent is not up; a second cluster on one machine
# finds Ray's default agent port taken, and its agent never starts.
NO_AGENT = "No available agent"
AGENT_PORT = 52365
_FAILED_REQUEST = re.compile(r"Request failed with status code (\d+): (.*)", re.S)


@dataclass(frozen=True)
class Patience:
    """How long the chain waits on a cluster that does not answer, in seconds."""

    submit_s: float = 60.0  # a cluster that cannot take a submission yet
    reconnect_s: float = 300.0  # a cluster that stops answering while a job runs


def _answer(error: BaseException) -> tuple[int, str] | None:
    """(status code, first line of the text) of a request the dashboard answered with an error."""
    found = _FAILED_REQUEST.match(str(error)) if isinstance(error, RuntimeError) else None
    return (int(found[1]), first_line(found[2])) if found else None


def not_yet(error: BaseException) -> str | None:
    """What the cluster answered, if asking again later may help; None for any other error."""
    import requests

    if isinstance(error, ConnectionError | requests.RequestException):
        return "connection refused" if "refused" in str(error) else first_line(error)
    if answer := _answer(error):
        code, text = answer
        if code in (502, 503, 504) or (code == 500 and "try again" in text):
            return f"{code}: {text}"
    return None


def _gone(error: BaseException) -> bool:
    answer = _answer(error)
    return answer is not None and answer[0] == 404


@dataclass
class Submission:
    """A job the chain submits to the cluster at `address` as `submission_id`; `sent` once a
    request to take it has gone out: from then on the job may run, whatever became of the
    answer."""

    address: str
    submission_id: str
    sent: bool = False


def job_client(address: str, submission: Submission | None = None):
    """Ray's job client, whose every request gives up after REQUEST_S without an answer (its
    own wait for one has no end), and which marks `submission` sent as it asks to take a job."""
    from ray.job_submission import JobSubmissionClient

    class Client(JobSubmissionClient):
        def _do_request(self, method: str, endpoint: str, **kwargs):
            kwargs.setdefault("timeout", REQUEST_S)
            if submission is not None and (method, endpoint) == ("POST", "/api/jobs/"):
                submission.sent = True  # before the request: an interrupt may come within it
            return super()._do_request(method, endpoint, **kwargs)

    return Client(address)


def submit(submission: Submission, patience: Patience, say: Callable[[str], None], **job):
    """A client of the cluster at `submission.address` that has taken the job (`job`: the rest
    of `submit_job`'s arguments)."""
    address, submission_id = submission.address, submission.submission_id
    started, client, told = time.monotonic(), None, False
    while True:
        try:
            if client is None:
                client = job_client(address, submission)
            elif _known(client, submission_id):  # an earlier try went through, its answer lost
                return client
            client.submit_job(submission_id=submission_id, **job)
            return client
        except Exception as e:
            answer = not_yet(e)
            if answer is None:
                raise
            waited = time.monotonic() - started
            if waited >= patience.submit_s:
                raise ClusterError(_not_taken(address, answer, waited, reached=client)) from None
            if not told:
                say(
                    f"the cluster at {address} cannot take the job yet ({answer}); trying again "
                    f"for up to {patience.submit_s:.0f} s (--submit-timeout-s)"
                )
                told = True
            time.sleep(min(POLL_S, patience.submit_s - waited))


def stop(submission: Submission) -> str:
    """Stop the job of an interrupted chain, once a request to take it has gone out; one line
    that says what became of it."""
    submission_id, address = submission.submission_id, submission.address
    if not submission.sent:
        return f"interrupted before job {submission_id} was submitted: nothing runs"
    started = time.monotonic()
    try:
        client = job_client(address)
        while True:
            try:
                stopped = client.stop_job(submission_id)
                break
            except RuntimeError as e:
                # Not there yet: the interrupted request may still be on its way to the head.
                if not _gone(e) or time.monotonic() - started >= TAKEN_S:
                    raise
            time.sleep(POLL_S)
    except Exception as e:
        if _gone(e):
            return f"interrupted; the cluster did not take job {submission_id}: nothing runs"
        answer = not_yet(e)
        if answer is None:
            raise
        return (
            f"interrupted; cannot reach the cluster at {address} to stop job {submission_id} "
            f"({answer}): it may run there: ray job stop {submission_id}"
        )
    if not stopped:
        return f"interrupted: job {submission_id} had ended already"
    return f"interrupted: stopped {submission_id}"


def _known(client, submission_id: str) -> bool:
    try:
        client.get_job_info(submission_id)
    except RuntimeError as e:
        if _gone(e):
            return False
        raise
    return True


def _not_taken(address: str, answer: str, waited: float, *, reached) -> str:
    if reached is None:  # not even the dashboard's version check answered
        return (
            f"cannot reach the cluster at --address {address} ({answer}) for {waited:.0f} s "
            "(--submit-timeout-s): is it up, and is that its dashboard?"
        )
    cause = ""
    if NO_AGENT in answer:
        cause = (
            "; its job agent did not start: another Ray cluster on this machine may hold the "
            f"agent's default port {AGENT_PORT} ('address already in use' in the head's "
            "dashboard_agent.log): start this one with --dashboard-agent-listen-port=<a free port>"
        )
    return (
        f"the cluster at --address {address} did not take the job for {waited:.0f} s "
        f"(--submit-timeout-s): {answer}{cause}"
    )


class _Printed:
    """The job's log written once, in order, however many times its parts arrive."""

    def __init__(self, write: Callable[[str], None]):
        self.write = write
        self.chars = 0  # of the log, written so far

    def add(self, text: str, at: int) -> None:
        """`text`, found at character `at` of the log."""
        if at + len(text) > self.chars:
            self.write(text[max(self.chars - at, 0) :])
            self.chars = at + len(text)


def follow(
    client,
    submission_id: str,
    address: str,
    patience: Patience,
    write: Callable[[str], None],
    say: Callable[[str], None],
):
    """The job's details once it has ended; its log written through `write` meanwhile."""
    import aiohttp

    printed = _Printed(write)
    lost = told = None  # since when the cluster does not answer; whether a drop was said
    while True:
        dropped = None
        try:
            asyncio.run(_stream(client, submission_id, printed))
        except (RuntimeError, OSError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            dropped = e
        try:
            info = client.get_job_info(submission_id)
            if dropped is not None or info.status.is_terminal():
                printed.add(client.get_job_logs(submission_id), 0)  # what the stream missed
        except Exception as e:
            if _gone(e):
                raise ClusterError(
                    f"the cluster at --address {address} no longer knows job {submission_id}: "
                    "was it restarted? Run the step again"
                ) from None
            if not_yet(e) is None:
                raise
            if lost is None:
                lost = time.monotonic()
                say(
                    f"cannot reach the cluster at {address} ({not_yet(e)}); following job "
                    f"{submission_id} again for up to {patience.reconnect_s:.0f} s "
                    "(--reconnect-timeout-s)"
                )
            elif time.monotonic() - lost >= patience.reconnect_s:
                raise ClusterError(
                    f"cannot reach the cluster at --address {address} for "
                    f"{time.monotonic() - lost:.0f} s (--reconnect-timeout-s), following job "
                    f"{submission_id}, which may still run there: ray job status {submission_id}"
                ) from None
            time.sleep(POLL_S)
            continue
        if lost is not None:
            say(f"the cluster at {address} answers again")
            lost = None
        if info.status.is_terminal():
            return info
        if dropped is not None and not told:
            say(
                f"the log stream of job {submission_id} dropped ({first_line(dropped)}); "
                "following the job again"
            )
            told = True
        time.sleep(POLL_S)


async def _stream(client, submission_id: str, printed: _Printed) -> None:
    # The dashboard streams a job's log from its start on every connection.
    at = 0
    chunks = aiter(client.tail_job_logs(submission_id))
    while True:
        chunk = asyncio.ensure_future(anext(chunks))
        while not (await asyncio.wait({chunk}, timeout=QUIET_S))[0]:
            # Silent: a job between lines, a stream that died without a word (an idle NAT or
            # firewall, a proxy), or a connection that will never speak again. The status
            # answers: an end ends this stream (`follow` reads the rest of the log from the
            # job), and so does its error.
            try:
                info = await asyncio.to_thread(client.get_job_info, submission_id)
            except BaseException:
                chunk.cancel()
                raise
            if info.status.is_terminal():
                chunk.cancel()
                return
        try:
            text = chunk.result()
        except StopAsyncIteration:
            return
        printed.add(text, at)
        at += len(text)
