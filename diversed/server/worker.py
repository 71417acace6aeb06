"""The engine thread: one continuous Batch (diversed.decoding.engine) fed from a bounded queue.

Requests wait in the queue and join the batch between rounds while it has room; a finished or cancelled
job leaves it at the end of its round. The models run in this one thread; the web server's event loop
only queues jobs and reads their tokens through the jobs' callbacks.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from diversed.decoding.engine import Batch, Job

ErrorFn = Callable[[Job, str], None]


class QueueFull(Exception):
    """More requests are waiting than the server queues."""


class Worker:
    """Runs `new_batch()`'s batch in a thread. capacity: jobs decoded together; max_waiting: jobs queued
    beyond them. A round that raises fails the jobs of the batch (each told through its on_error) and the
    thread goes on with a fresh batch. on_stop: called once the last batch has closed (to save its costs)."""

    def __init__(self, new_batch: Callable[[], Batch], max_waiting: int,
                 on_change: Callable[[int, int], None] = lambda running, waiting: None,
                 on_stop: Callable[[], None] = lambda: None) -> None:
        self.new_batch, self.max_waiting, self.on_change, self.on_stop = new_batch, max_waiting, on_change, on_stop
        self.batch = new_batch()
        self._waiting: deque[tuple[Job, ErrorFn]] = deque()
        self._errors: dict[int, ErrorFn] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="diversed-engine", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self.batch.jobs)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job, on_error: ErrorFn) -> None:
        """Queue a job (admitted already: diversed.admission); QueueFull when max_waiting jobs wait already."""
        with self._wake:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            free_rows = max(self.batch.capacity - len(self.batch.jobs), 0)  # the queue holds joiners too
            if len(self._waiting) >= self.max_waiting + free_rows:
                raise QueueFull(f"{len(self.batch.jobs)} requests are running and {len(self._waiting)} waiting")
            self._waiting.append((job, on_error))
            self._wake.notify()
        self._report()

    def wake(self) -> None:
        """Have the thread look at the queue now (a waiting job was cancelled)."""
        with self._wake:
            self._wake.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Finish every running and waiting job, then end the thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._waiting and not self.batch.jobs and not self._stopping:
                    self._wake.wait()
                if self._stopping and not self._waiting and not self.batch.jobs:
                    self.batch.close()
                    self.on_stop()
                    return
                joining = []
                while self._waiting and len(self.batch.jobs) + len(joining) < self.batch.capacity:
                    joining.append(self._waiting.popleft())
            for job, on_error in joining:
                self._join(job, on_error)
            self._report()
            try:
                for job in self.batch.step():
                    self._errors.pop(id(job), None)
            except Exception as error:  # noqa: BLE001 - the thread must outlive any one round
                self._fail_batch(f"decoding failed: {type(error).__name__}: {error}")
            self._report()

    def _join(self, job: Job, on_error: ErrorFn) -> None:
        if job.cancelled:
            return
        try:
            self.batch.add(job)
            self._errors[id(job)] = on_error
        except (ValueError, RuntimeError) as error:
            on_error(job, str(error))

    def _fail_batch(self, message: str) -> None:
        for job in self.batch.jobs:
            self._errors.pop(id(job), lambda job, message: None)(job, message)
        self.batch.close()
        self.batch = self.new_batch()

    def _report(self) -> None:
        self.on_change(len(self.batch.jobs), len(self._waiting))
