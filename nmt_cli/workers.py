"""An ordered, bounded map over worker processes: results in input order, memory independent of input size."""

from __future__ import annotations

import multiprocessing as mp
import signal
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def ordered_map(fn: Callable[[Any], Any], jobs: Iterable[Any], workers: int,
                initializer: Callable[..., None] | None = None, initargs: tuple = (),
                in_flight_per_worker: int = 3) -> Iterator[Any]:
    """Yield fn(job) for each job, in order, computed on `workers` processes (in this one when workers <= 1).

    Unlike Pool.imap, which reads its whole input ahead into a queue, at most
    `workers * in_flight_per_worker` jobs are pending at once, so a streamed corpus stays streamed.
    """
    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        for job in jobs:
            yield fn(job)
        return
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    limit = workers * in_flight_per_worker
    # Workers ignore Ctrl-C: the main process alone gets KeyboardInterrupt, and leaving this block
    # terminates the pool at once (no tracebacks from every worker, no wait for their queues).
    # SIGINT is blocked while the workers fork, so none can take a Ctrl-C before it ignores SIGINT; one that
    # arrives meanwhile is delivered to this process when the mask is restored.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        pool = ctx.Pool(workers, initializer=_start_worker, initargs=(initializer, initargs))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    with pool:
        pending: deque = deque()
        for job in jobs:
            pending.append(pool.apply_async(fn, (job,)))
            if len(pending) >= limit:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _start_worker(initializer: Callable[..., None] | None, initargs: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if initializer is not None:
        initializer(*initargs)
