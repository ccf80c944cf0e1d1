"""`nmt serve`: an HTTP JSON API over one translator, with requests that arrive together batched together.

    POST /translate  {"text": ["...", ...], "beam": 4, "lenpen": 0.6, "greedy": false}
                     -> {"translations": ["...", ...]}
    GET  /health     -> {"status": "ok", "engine": ..., "queued_sentences": N, "translate_seconds": S, ...}

Errors are JSON `{"error": "..."}` with a 4xx status (400 malformed, 413 over a limit, 422 invalid fields,
503 queue full); the server keeps serving.
"""


import asyncio
import json
import socket
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .errors import NmtError
from .pipeline import TextTranslator

INSTALL_HINT = "nmt serve needs FastAPI and uvicorn; install them with: pip install 'nmt-cli[serve]'"


@dataclass(frozen=True)
class ServeLimits:
    """What one server accepts and how it batches."""

    max_batch: int = 64  # sentences per search batch
    max_tokens: int | None = None  # padded source tokens per search batch (instead of max_batch)
    batch_wait_ms: float = 5.0  # how long the first request of a batch waits for company
    max_queue: int = 1024  # sentences waiting (not counting the batch in progress); beyond, requests get 503
    max_sentences: int = 64  # per request
    max_chars: int = 2000  # per sentence


@dataclass
class _Job:
    sentences: list[str]
    options: tuple
    future: asyncio.Future
    cancelled: bool = False
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = len(self.sentences)


class QueueFull(Exception):
    pass


def translator_thread() -> ThreadPoolExecutor:
    """The one thread that should load the translator and run every batch.

    PyTorch's OpenMP runtime (libgomp) keeps a pool of worker threads per thread that runs parallel work; once
    two pools exist on a machine with few cores, it stops spinning between parallel regions and each one
    waits on the kernel instead: beam search on 2 cores ran ~30% slower (138 vs 190 sentences/s) when the
    model was loaded on the main thread and run on another."""
    return ThreadPoolExecutor(1, thread_name_prefix="nmt-translate")


class Batcher:
    """Collects jobs from concurrent requests into batches for one translator thread."""

    def __init__(self, translator: TextTranslator, limits: ServeLimits,
                 executor: ThreadPoolExecutor | None = None) -> None:
        self.translator, self.limits = translator, limits
        self.queue: deque[_Job] = deque()
        self.queued_sentences = 0
        self.translated_sentences = 0
        self.batches = 0
        self.translate_seconds = 0.0  # time the translator thread spent translating
        # The last batch's sentences and those queued when it ended: how many sentences a batch waits for.
        self.expected = 0
        self._wakeup = asyncio.Event()
        self._executor = executor or translator_thread()

    def submit(self, sentences: list[str], options: tuple) -> _Job:
        """Queue a request's sentences; QueueFull when the queue would pass its bound."""
        if self.queued_sentences + len(sentences) > self.limits.max_queue:
            raise QueueFull
        job = _Job(sentences, options, asyncio.get_running_loop().create_future())
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
            options = dict(batch[0].options)
            try:
                translations = await loop.run_in_executor(self._executor, self._translate, sentences, options)
            except Exception as e:  # bad options reach here as NmtError; anything else is the server's fault
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(e)
            else:
                start = 0
                for job in batch:
                    if not job.future.done():
                        job.future.set_result(translations[start : start + job.size])
                    start += job.size
                self.translated_sentences += len(sentences)
                self.batches += 1
            finally:
                # Its clients are about to send again, beside those that arrived meanwhile and still wait.
                self.expected = len(sentences) + self.queued_sentences

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

    def _translate(self, sentences: list[str], options: dict) -> list[str]:
        start = time.perf_counter()
        try:
            return self.translator.translate(sentences, batch_size=self.limits.max_batch,
                                             max_tokens=self.limits.max_tokens, **options)
        finally:
            self.translate_seconds += time.perf_counter() - start


OPTIONS = {"beam": int, "lenpen": (int, float), "greedy": bool, "max_len_a": (int, float), "max_len_b": int}
DEFAULTS = {"beam": 4, "lenpen": 0.6, "greedy": False, "max_len_a": 1.0, "max_len_b": 50}


def parse_request(body: bytes, limits: ServeLimits) -> tuple[list[str], tuple]:
    """The sentences and search options of a POST /translate body; HTTPError on anything else."""
    try:
        payload = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise HTTPError(400, f"the body is not UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise HTTPError(400, f"the body is not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(payload, dict):
        raise HTTPError(422, "the body must be a JSON object with a \"text\" list")
    unknown = sorted(set(payload) - set(OPTIONS) - {"text"})
    if unknown:
        raise HTTPError(422, f"unknown field(s): {', '.join(unknown)} (known: text, {', '.join(OPTIONS)})")
    text = payload.get("text")
    if not isinstance(text, list) or not all(isinstance(s, str) for s in text):
        raise HTTPError(422, "\"text\" must be a list of strings")
    if not text:
        raise HTTPError(422, "\"text\" is empty")
    if len(text) > limits.max_sentences:
        raise HTTPError(413, f"{len(text)} sentences; at most {limits.max_sentences} per request")
    for i, sentence in enumerate(text):
        if len(sentence) > limits.max_chars:
            raise HTTPError(413, f"text[{i}] has {len(sentence)} characters; at most {limits.max_chars}")
        if "\n" in sentence or "\r" in sentence:
            raise HTTPError(422, f"text[{i}] holds a line break; send one sentence per list item")
    options = dict(DEFAULTS)
    for name, kind in OPTIONS.items():
        if name in payload:
            value = payload[name]
            if isinstance(value, bool) and kind is not bool:
                raise HTTPError(422, f"\"{name}\" must be a number")
            if not isinstance(value, kind):
                raise HTTPError(422, f"\"{name}\" must be {'true or false' if kind is bool else 'a number'}")
            options[name] = value
    if not 1 <= options["beam"] <= 64:
        raise HTTPError(422, "\"beam\" must be between 1 and 64")
    try:
        TextTranslator.check_options(options["beam"], options["lenpen"], options["max_len_a"],
                                     options["max_len_b"], 1, None, options["greedy"], 1)
    except NmtError as e:
        raise HTTPError(422, str(e).replace("--", "").replace("-", "_")) from None
    return text, tuple(sorted(options.items()))


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def create_app(translator: TextTranslator, limits: ServeLimits = ServeLimits(), engine: str = "nmt",
               executor: ThreadPoolExecutor | None = None) -> Any:
    """The FastAPI application serving `translator`, translating on `executor` (one thread; by default a new
    `translator_thread`)."""
    try:
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse
    except ImportError:
        raise NmtError(INSTALL_HINT) from None
    from contextlib import asynccontextmanager

    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app):
        state["batcher"] = batcher = Batcher(translator, limits, executor)
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()
        batcher._executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="nmt", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def error(status: int, message: str, **headers: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status, headers=headers or None)

    @app.get("/health")
    async def health() -> dict:
        batcher: Batcher = state["batcher"]
        return {"status": "ok", "engine": engine, "source_lang": translator.source_lang,
                "target_lang": translator.target_lang, "queued_sentences": batcher.queued_sentences,
                "translated_sentences": batcher.translated_sentences, "batches": batcher.batches,
                "translate_seconds": round(batcher.translate_seconds, 6)}

    @app.post("/translate")
    async def translate(request: Request) -> Any:
        try:
            sentences, options = parse_request(await request.body(), limits)
        except HTTPError as e:
            return error(e.status, e.message)
        batcher: Batcher = state["batcher"]
        try:
            job = batcher.submit(sentences, options)
        except QueueFull:
            return error(503, f"the queue is full ({limits.max_queue} sentences); retry later", **{"Retry-After": "1"})
        disconnected = asyncio.create_task(_wait_for_disconnect(request))
        try:
            await asyncio.wait({job.future, disconnected}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnected.cancel()
        if not job.future.done():  # the client went away first: skip its work if its batch has not started
            batcher.cancel(job)
            return error(499, "client closed the request")
        try:
            return {"translations": job.future.result()}
        except NmtError as e:
            return error(422, str(e))
        except Exception as e:  # noqa: BLE001 - one failed batch must not stop the server
            return error(500, f"translation failed: {type(e).__name__}: {e}")

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return error(404, f"no such endpoint: {request.method} {request.url.path} (use POST /translate, GET /health)")

    @app.exception_handler(405)
    async def wrong_method(request: Request, exc: Exception) -> JSONResponse:
        return error(405, f"{request.method} not allowed on {request.url.path}")

    return app


async def _wait_for_disconnect(request: Any) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def check_port(host: str, port: int) -> None:
    """Fail with one line, before loading anything, when the address cannot be bound."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise NmtError(f"{host}:{port}: cannot listen there ({e.strerror or e})") from None


def serve(translator: TextTranslator, host: str, port: int, limits: ServeLimits, engine: str,
          on_ready: Any = None, executor: ThreadPoolExecutor | None = None) -> None:
    """Run the HTTP server until interrupted; batches run on `executor` (the thread that loaded `translator`,
    see `translator_thread`)."""
    try:
        import uvicorn
    except ImportError:
        raise NmtError(INSTALL_HINT) from None
    app = create_app(translator, limits, engine, executor)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    if on_ready:
        on_ready()
    server.run()
