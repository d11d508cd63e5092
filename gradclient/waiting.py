"""Waiting on a job: the call's one deadline, the pause between two polls, and the progress bar shown meanwhile."""

from __future__ import annotations

import sys
import time
from typing import Any

from .errors import WaitTimeoutError


class Deadline:
    """gradients()' `timeout` as one deadline over the POST's server-side wait (`wait_s`) and the polling after it."""

    def __init__(self, timeout: float | None) -> None:
        self.at = None if timeout is None else time.monotonic() + timeout

    def left(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def wait(self, wait_s: float) -> float:
        """The POST's `wait`: `wait_s`, cut to what the deadline leaves."""
        left = self.left()
        return wait_s if left is None else min(wait_s, left)


class Poll:
    """How long to wait between GET /jobs/{id}: 20 ms, growing to 0.5 s, capped by the caller's deadline."""

    def __init__(self, timeout: float | None) -> None:
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.interval = 0.02

    def next(self, job_id: str) -> float:
        delay, self.interval = self.interval, min(self.interval * 1.5, 0.5)
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeoutError(f"job {job_id} did not end within the timeout; it goes on: wait again with "
                                       f"client.job({job_id!r}).result(), or stop it with "
                                       f"client.job({job_id!r}).cancel()", detail={"job_id": job_id})
            delay = min(delay, left)
        return delay


class ProgressBar:
    """A tqdm bar showing the job's phase and its done/total (plain lines on stderr without tqdm)."""

    def __init__(self, enabled: bool, job_id: str) -> None:
        self.bar = None
        self.enabled = enabled
        self.last = ""
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=0, desc=f"job {job_id[:8]} queued", unit="step", leave=False)
            except ImportError:
                pass

    def update(self, info: Any) -> None:
        """Shows a GET /jobs/{id} answer: its status, or while it runs its phase and done/total."""
        if not self.enabled:
            return
        p = info.progress
        phase = p.phase if p is not None and info.status == "started" else info.status
        if self.bar is not None:
            self.bar.set_description_str(phase, refresh=False)
            if p is not None:
                self.bar.total, self.bar.n = p.total, p.done
            self.bar.refresh()
        elif phase != self.last:
            print(f"job {info.job_id}: {phase}", file=sys.stderr)
        self.last = phase

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
