"""An ordered, bounded map over worker processes: results in input order, memory independent of input size."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .errors import NmtError

_POLL_S = 0.5


class WorkerDied(NmtError):
    """A worker process ended without returning its result (killed, or out of memory): one line, exit 2."""


def ordered_map(fn: Callable[[Any], Any], jobs: Iterable[Any], workers: int,
                initializer: Callable[..., None] | None = None, initargs: tuple = (),
                in_flight_per_worker: int = 3) -> Iterator[Any]:
    """Yield fn(job) for each job, in order, computed on `workers` processes (in this one when workers <= 1).

    At most `workers * in_flight_per_worker` jobs are pending at once (Pool.imap reads its whole input
    ahead), so a streamed corpus stays streamed. An exception in fn is raised here; leaving the loop early
    (an exception, Ctrl-C, a closed generator) kills the workers at once.
    """
    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        for job in jobs:
            yield fn(job)
        return
    # Job k goes to worker k % workers through that worker's own inbox and comes back through its own outbox:
    # no lock shared between processes and no handler threads whose state a Ctrl-C can leave half-updated
    # (multiprocessing.Pool has both; a Ctrl-C during a Pool-based prepare once hung CI).
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    inboxes = [ctx.Queue() for _ in range(workers)]
    outboxes = [ctx.Queue() for _ in range(workers)]
    for inbox in inboxes:
        inbox.cancel_join_thread()  # never wait at exit to feed a worker that is gone
    procs: list = []
    try:
        with _ctrl_c_deferred():
            for inbox, outbox in zip(inboxes, outboxes):
                procs.append(ctx.Process(target=_serve, args=(fn, inbox, outbox, initializer, initargs, os.getpid()),
                                         daemon=True))
                procs[-1].start()
        sent = received = 0
        limit = workers * in_flight_per_worker
        for job in jobs:
            inboxes[sent % workers].put((job,))
            sent += 1
            if sent - received >= limit:
                yield _receive(outboxes[received % workers], procs[received % workers])
                received += 1
        while received < sent:
            yield _receive(outboxes[received % workers], procs[received % workers])
            received += 1
        for inbox in inboxes:
            inbox.put(None)
            inbox.close()
        for proc in procs:
            proc.join()
    finally:
        for proc in procs:
            if proc.pid is not None:
                proc.kill()
                proc.join()


@contextlib.contextmanager
def _ctrl_c_deferred() -> Iterator[None]:
    """Hold back a Ctrl-C while workers start, then deliver it.

    Workers ignore Ctrl-C (the main process alone handles it, and kills them). A KeyboardInterrupt raised
    inside Process.start, between the fork and the bookkeeping, would leave a worker untracked, and one
    raised in a worker before it ignores SIGINT would print its traceback; while this is active, SIGINT only
    sets a flag (in the workers too, which inherit the handler until they ignore SIGINT).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)


def _receive(outbox: Any, proc: Any) -> Any:
    while True:
        try:
            ok, value = outbox.get(timeout=_POLL_S)
        except queue.Empty:
            if not proc.is_alive():
                raise WorkerDied(f"a worker process died (exit code {proc.exitcode}; out of memory? "
                                 "try fewer --workers)") from None
            continue
        if not ok:
            raise value
        return value


def _serve(fn: Callable[[Any], Any], inbox: Any, outbox: Any, initializer: Callable[..., None] | None,
           initargs: tuple, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent)
    if initializer is not None:
        initializer(*initargs)
    while True:
        try:
            message = inbox.get(timeout=_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:  # the main process is gone
                outbox.cancel_join_thread()
                return
            continue
        except EOFError:
            return
        if message is None:
            return
        try:
            outbox.put((True, fn(message[0])))
        except Exception as e:  # raised again in the main process
            outbox.put((False, e if _picklable(e) else RuntimeError(f"{type(e).__name__}: {e}")))


def _die_with_parent(parent: int) -> None:
    """Have Linux kill this worker the moment its parent dies (prctl PR_SET_PDEATHSIG), even in the middle of a
    job; elsewhere the worker notices between jobs (`_serve`'s poll)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # died before the request took effect
        os._exit(0)


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True
