"""An ordered, bounded map over worker processes: results in input order, memory independent of input size."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from nmt_cli.errors import NmtError

_POLL_S = 0.5


class WorkerDied(NmtError):
    """A worker process ended without returning its result (killed, or out of memory): one line, exit 2."""


@contextlib.contextmanager
def _frozen_garbage() -> Iterator[None]:
    """While workers are forked: this process's objects moved out of the collector's reach (gc.freeze), so a
    child never collects what it inherited. An object waiting in a reference cycle, such as a CTranslate2
    translator a caller dropped, would otherwise be destroyed in the child, where its thread pool's threads do
    not exist: the child hung in that destructor (seen in CI, after a test that used CTranslate2)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


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
    # Job k goes to worker k % workers through that worker's own pipe and comes back through its own outbox:
    # no lock shared between processes and no handler threads whose state a Ctrl-C can leave half-updated
    # (multiprocessing.Pool has both; a Ctrl-C during a Pool-based prepare once hung CI). Jobs are sent with
    # plain blocking writes, not through a multiprocessing.Queue: a Queue's feeder thread in this process
    # could block forever writing to a dead worker's full pipe, and a Ctrl-C then hung at exit (seen in CI).
    # A worker drains its pipe whatever happens to its results (its outbox buffers them), so a write blocks
    # only while the worker is busy, and a worker that dies breaks the pipe (BrokenPipeError) instead.
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    inboxes = [ctx.Pipe(duplex=False) for _ in range(workers)]  # (worker's read end, our write end)
    outboxes = [ctx.Queue() for _ in range(workers)]
    procs: list = []
    try:
        with _ctrl_c_deferred(), _frozen_garbage():
            for w, ((reader, _), outbox) in enumerate(zip(inboxes, outboxes)):
                inherited = [end for i, pair in enumerate(inboxes) for end in pair if not (i == w and end is reader)]
                procs.append(ctx.Process(target=_serve, args=(fn, reader, outbox, inherited, initializer, initargs,
                                                              os.getpid()), daemon=True))
                procs[-1].start()
        for reader, _ in inboxes:
            reader.close()  # only the worker holds its read end now: its death breaks our write end
        sent = received = 0
        limit = workers * in_flight_per_worker
        for job in jobs:
            _send(inboxes[sent % workers][1], job, procs[sent % workers])
            sent += 1
            if sent - received >= limit:
                yield _receive(outboxes[received % workers], procs[received % workers])
                received += 1
        while received < sent:
            yield _receive(outboxes[received % workers], procs[received % workers])
            received += 1
        for _, writer in inboxes:
            writer.close()  # end of input: the worker reads EOF once its pipe is drained
        for proc in procs:
            proc.join()
    finally:
        for proc in procs:
            if proc.pid is not None:
                proc.kill()
                proc.join()
        for reader, writer in inboxes:
            reader.close()
            writer.close()
        for outbox in outboxes:
            outbox.close()


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


def _send(inbox: Any, job: Any, proc: Any) -> None:
    try:
        inbox.send(job)
    except BrokenPipeError:
        proc.join(_POLL_S)
        raise _died(proc) from None


def _died(proc: Any) -> WorkerDied:
    return WorkerDied(f"a worker process died (exit code {proc.exitcode}; out of memory? try fewer --workers)")


def _receive(outbox: Any, proc: Any) -> Any:
    while True:
        try:
            ok, value = outbox.get(timeout=_POLL_S)
        except queue.Empty:
            if not proc.is_alive():
                raise _died(proc) from None
            continue
        if not ok:
            raise value
        return value


def _serve(fn: Callable[[Any], Any], inbox: Any, outbox: Any, inherited: list, initializer: Callable[..., None] | None,
           initargs: tuple, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent)
    for end in inherited:  # the other workers' pipe ends, copied by the fork: holding them would keep a dead
        end.close()        # worker's pipe open, and the main process's write to it from breaking
    if initializer is not None:
        initializer(*initargs)
    while True:
        if not inbox.poll(_POLL_S):
            if os.getppid() != parent:  # the main process is gone
                outbox.cancel_join_thread()
                return
            continue
        try:
            job = inbox.recv()
        except EOFError:  # the main process closed its end: no more jobs
            return
        try:
            outbox.put((True, fn(job)))
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
