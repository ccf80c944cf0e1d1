"""`nmt serve`'s batching: what a server accepts (`ServeLimits`), and the batcher that gathers the sentences of
concurrent requests into batches for the one translator thread."""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from nmt_cli.decode.pipeline import TextTranslator
from nmt_cli.errors import NmtError


def release_free_heap() -> bool:
    """Hand the memory the process's allocator keeps after frees back to the kernel: tcmalloc's or jemalloc's when
    one is preloaded (`--cpu-allocator`), else glibc's (malloc_trim); False where none of them is found."""
    import ctypes

    try:
        process = ctypes.CDLL(None)
    except OSError:
        return False
    if hasattr(process, "MallocExtension_ReleaseFreeMemory"):  # tcmalloc: glibc's heap holds little here
        process.MallocExtension_ReleaseFreeMemory()
        return True
    if hasattr(process, "mallctl"):  # jemalloc: purge every arena (MALLCTL_ARENAS_ALL = 4096)
        return process.mallctl(b"arena.4096.purge", None, None, None, ctypes.c_size_t(0)) == 0
    if hasattr(process, "malloc_trim"):
        return bool(process.malloc_trim(0))
    return False


@dataclass(frozen=True)
class ServeLimits:
    """What one server accepts and how it batches."""

    max_batch: int = 64  # sentences per search batch
    max_tokens: int | None = None  # padded source tokens per search batch (instead of max_batch)
    batch_wait_ms: float = 5.0  # how long the first request of a batch waits for company
    max_queue: int = 1024  # sentences waiting (not counting the batch in progress); beyond, requests get 503
    max_sentences: int = 64  # per request
    max_chars: int = 2000  # per sentence
    max_body_bytes: int | None = None  # per request body; None: sized from max_sentences x max_chars
    max_work: int = 64 * 4 * 1024  # decoder tokens per request: the defaults' largest request at any length
    cache_mb: float = 256.0  # decoder cache kept between requests, at most
    # Freed memory glibc keeps is handed back to the kernel when the queue empties (at most once a second) and at
    # least every `trim_seconds` under constant load (0: never); docs/benchmarks.md, "Serving soak".
    trim_seconds: float = 5.0
    shutdown_seconds: float = 30.0  # after SIGTERM, how long queued work may take before the server exits

    def check(self) -> None:
        """One line for a limit no server can work with (`nmt serve`'s flags, before the model loads)."""
        for flag, value in (("--batch-size", self.max_batch), ("--max-queue", self.max_queue),
                            ("--max-sentences", self.max_sentences), ("--max-chars", self.max_chars)):
            if value < 1:
                raise NmtError(f"{flag} must be at least 1 (got {value})")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise NmtError(f"--max-tokens must be at least 1 (got {self.max_tokens})")
        if self.batch_wait_ms < 0:
            raise NmtError(f"--batch-wait-ms must be 0 or more (got {self.batch_wait_ms})")
        if self.max_sentences > self.max_queue:
            raise NmtError(f"--max-sentences {self.max_sentences} exceeds --max-queue {self.max_queue}: such a "
                           "request never fits")
        for flag, number in (("--max-body-bytes", self.max_body_bytes), ("--max-work", self.max_work)):
            if number is not None and number < 1:
                raise NmtError(f"{flag} must be at least 1 (got {number})")
        for flag, seconds in (("--cache-mb", self.cache_mb), ("--shutdown-seconds", self.shutdown_seconds)):
            if not math.isfinite(seconds) or seconds < 0:
                raise NmtError(f"{flag} must be 0 or more (got {seconds})")

    def body_limit(self) -> int:
        """The body size limit: `max_body_bytes`, or room for the largest allowed text written with JSON's
        longest escapes (a character as \\uXXXX\\uXXXX: 12 bytes) and the options."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return self.max_sentences * (12 * self.max_chars + 8) + 4096


@dataclass
class _Job:
    sentences: list[str]
    options: tuple
    future: asyncio.Future
    cancelled: bool = False
    size: int = field(init=False)
    prefixes: list[str] | None = None  # per sentence, "" for none
    constraints: list[list[str]] | None = None  # per sentence

    def __post_init__(self) -> None:
        self.size = len(self.sentences)


class QueueFull(Exception):
    pass


def translator_thread() -> ThreadPoolExecutor:
    """The one thread that should load the translator and run every batch.

    PyTorch's OpenMP runtime (libgomp) keeps a pool of worker threads per thread that runs parallel work; once
    two pools exist on a machine with few cores, it stops spinning between parallel regions and each one
    waits on the kernel instead, and beam search on 2 cores ran markedly slower when the model was loaded on the
    main thread and run on another."""
    return ThreadPoolExecutor(1, thread_name_prefix="nmt-translate")


class Batcher:
    """Collects jobs from concurrent requests into batches for one translator thread."""

    def __init__(self, translator: TextTranslator, limits: ServeLimits,
                 executor: ThreadPoolExecutor | None = None, metrics: Any = None) -> None:
        self.translator, self.limits, self.metrics = translator, limits, metrics
        self.queue: deque[_Job] = deque()
        self.queued_sentences = 0
        self.translated_sentences = 0
        self.batches = 0
        self.translate_seconds = 0.0  # time the translator thread spent translating
        # The last batch's sentences and those queued when it ended: how many sentences a batch waits for.
        self.expected = 0
        self._wakeup = asyncio.Event()
        self._executor = executor or translator_thread()
        self._trimmed = time.monotonic()

    def submit(self, sentences: list[str], options: tuple, prefixes: list[str] | None = None,
               constraints: list[list[str]] | None = None) -> _Job:
        """Queue a request's sentences (with their target prefixes and constraints, if any); QueueFull when the
        queue would pass its bound."""
        if self.queued_sentences + len(sentences) > self.limits.max_queue:
            raise QueueFull
        job = _Job(sentences, options, asyncio.get_running_loop().create_future(), prefixes=prefixes,
                   constraints=constraints)
        self.queue.append(job)
        self.queued_sentences += job.size
        self._wakeup.set()
        return job

    def cancel(self, job: _Job) -> None:
        """A job whose client went away: dropped if its batch has not started."""
        job.cancelled = True

    def _take_batch(self) -> list[_Job]:
        first = self.queue[0]
        batch, size, kept = [], 0, deque()
        while self.queue:
            job = self.queue.popleft()
            fits = not batch or size + job.size <= self.limits.max_batch
            if job.cancelled or (job.options == first.options and fits):
                self.queued_sentences -= job.size
                if not job.cancelled:
                    batch.append(job)
                    size += job.size
            else:
                kept.append(job)
        self.queue = kept
        return batch

    async def run(self) -> None:
        """Serve batches until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                self._wakeup.clear()
                await self._wakeup.wait()
            await self._gather()
            batch = self._take_batch()
            if not batch:
                continue
            sentences = [s for job in batch for s in job.sentences]
            try:
                outcome: dict[int, Any] = await loop.run_in_executor(self._executor, self._translate, batch)
            except Exception as e:  # noqa: BLE001 - each job gets its own outcome
                # A request whose prefix or constraints cannot be honoured (NmtError: its 4xx), or whose line breaks
                # the search (anything else: a 500), fails that request only: the others are translated alone.
                outcome = {0: e} if len(batch) == 1 else await self._one_by_one(batch)
            try:
                answered = 0
                for j, job in enumerate(batch):
                    if isinstance(outcome[j], Exception):
                        if not job.future.done():
                            job.future.set_exception(outcome[j])
                        continue
                    answered += job.size
                    if not job.future.done():
                        job.future.set_result(outcome[j])
                if answered:
                    self.translated_sentences += answered
                    self.batches += 1
                    if self.metrics is not None:
                        self.metrics.batch(answered)
            finally:
                # Its clients are about to send again, beside those that arrived meanwhile and still wait.
                self.expected = len(sentences) + self.queued_sentences

    async def _one_by_one(self, batch: list[_Job]) -> dict[int, Any]:
        """Each job of a failed batch translated alone: its answer, or the exception it alone raises."""
        loop, outcome = asyncio.get_running_loop(), {}
        for j, job in enumerate(batch):
            try:
                outcome[j] = (await loop.run_in_executor(self._executor, self._translate, [job]))[0]
            except Exception as e:  # noqa: BLE001 - delivered to its own request
                outcome[j] = e
        return outcome

    async def _gather(self) -> None:
        """Wait for company: up to `batch_wait_ms`, but no longer once as many sentences are queued as the last
        batch answered plus those queued when it ended (clients that send again when answered are back;
        one client alone is not kept waiting). Before any batch, the whole `batch_wait_ms`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.batch_wait_ms / 1000
        target = min(self.limits.max_batch, self.expected or self.limits.max_batch)
        while self.queued_sentences < target and loop.time() < deadline:
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                return

    def _translate(self, batch: list[_Job]) -> dict[int, tuple]:
        """Each job's answer, by its place in the batch: its n-best (translation, score) lists, its warnings
        (lines truncated, constraints unmet) and its word alignments when asked for. The batch's sentences are
        searched together; the translator's warning lists are emptied each batch, so a server running for
        weeks keeps none. NmtError for a prefix or constraint that cannot be honoured."""
        start = time.perf_counter()
        tokens_before = self.translator.generated_tokens
        self.translator.warnings.clear()
        self.translator.truncated.clear()
        self.translator.unmet.clear()
        sentences = [s for job in batch for s in job.sentences]
        options = dict(batch[0].options)
        aligning = options.pop("alignments", False)
        steering: dict = {}
        if any(job.prefixes for job in batch):
            steering["prefixes"] = [p for job in batch for p in (job.prefixes or [""] * job.size)]
        if any(job.constraints for job in batch):
            steering["constraints"] = [c for job in batch for c in (job.constraints or [[]] * job.size)]
        try:
            with self.translator.serving():
                return self._search(batch, sentences, options, aligning, steering)
        finally:
            self.translator.warnings.clear()
            self.translator.truncated.clear()
            self.translator.unmet.clear()
            self.translate_seconds += time.perf_counter() - start
            since = time.monotonic() - self._trimmed
            if self.limits.trim_seconds and (since > self.limits.trim_seconds or (since > 1 and not self.queue)):
                release_free_heap()
                self._trimmed = time.monotonic()
            if self.metrics is not None:
                self.metrics.generated(self.translator.generated_tokens - tokens_before)

    def _search(self, batch: list[_Job], sentences: list[str], options: dict, aligning: bool,
                steering: dict) -> dict[int, tuple]:
        """The batch searched (and aligned): `_translate`'s answers."""
        ids: list | None = [] if aligning else None
        try:
            results = self.translator.translate_nbest(sentences, batch_size=self.limits.max_batch,
                                                      max_tokens=self.limits.max_tokens, ids_out=ids,
                                                      where=("prefix", "constraints"), **options, **steering)
        except NmtError as e:
            raise NmtError(re.sub(r"^(prefix|constraints):(\d+):",
                                  lambda m: f"{m[1]}[{int(m[2]) - 1}]:", str(e))) from None
        alignments = None
        if aligning:
            from nmt_cli.model.attention import format_alignments

            pairs = self.translator.align(sentences, [r[0][0] for r in results], ids)  # type: ignore[attr-defined]
            alignments = [format_alignments(p) for p in pairs]
        out, first, limit = {}, 0, self.translator.max_positions - 2
        for j, job in enumerate(batch):
            mine = range(first + 1, first + job.size + 1)  # the job's lines, 1-based in the batch
            warnings = [f"text[{line - first - 1}]: {tokens} tokens exceed the model's {limit}; translated "
                        "truncated" for line, tokens in self.translator.truncated if line in mine]
            warnings += [f"text[{line - first - 1}]: its constraints could not all be met within the length "
                         "limit; translated with the best hypothesis found"
                         for line in self.translator.unmet if line in mine]
            out[j] = (results[first : first + job.size], warnings,
                      alignments[first : first + job.size] if alignments else None)
            first += job.size
        return out
