"""`nmt serve`: an HTTP JSON API over one translator, with requests that arrive together batched together.

    POST /translate  {"text": ["...", ...] or "...", "beam": 4, "lenpen": 0.6, "greedy": false, "nbest": 1,
                      "return_scores": false}
                     -> {"translations": [...] (or one string), "scores": [...], "warnings": [...]}
    GET  /health     -> {"status": "ok", "engine": ..., "queued_sentences": N, "translate_seconds": S, ...}
    GET  /metrics    -> Prometheus text format (prometheus_client)

Every request is bounded before it takes memory: the body (`max_body_bytes`, counted while it is read), the
sentences and characters, and the decoder work (sentences x beam x length limit, `max_work`). Errors are JSON
`{"error": "..."}` with a 4xx status (400 malformed, 401 no or a wrong API key, 413 over a limit, 422 invalid
fields, 503 queue full); the server keeps serving.
"""

import asyncio
import hmac
import json
import math
import signal
import socket
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .errors import NmtError
from .hardware import release_free_heap
from .pipeline import TextTranslator

INSTALL_HINT = "nmt serve needs FastAPI and uvicorn; install them with: pip install -e '.[serve]'"


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
                results, truncated, alignments = await loop.run_in_executor(self._executor, self._translate,
                                                                             sentences, options)
            except Exception as e:  # bad options reach here as NmtError; anything else is the server's fault
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(e)
            else:
                start, limit = 0, self.translator.max_positions - 2
                for job in batch:
                    warnings = [f"text[{line - start - 1}]: {tokens} tokens exceed the model's {limit}; translated "
                                "truncated" for line, tokens in truncated if start < line <= start + job.size]
                    if not job.future.done():
                        job.future.set_result((results[start : start + job.size], warnings,
                                               alignments[start : start + job.size] if alignments else None))
                    start += job.size
                self.translated_sentences += len(sentences)
                self.batches += 1
                if self.metrics is not None:
                    self.metrics.batch(len(sentences))
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

    def _translate(self, sentences: list[str],
                   options: dict) -> tuple[list[list[tuple[str, float]]], list, list[str] | None]:
        """n-best (translation, score) lists of a batch, its truncated lines (line in the batch, tokens), and
        its word alignments when asked for; the translator's warning lists are emptied each batch, so a server
        running for weeks keeps none."""
        start = time.perf_counter()
        tokens_before = self.translator.generated_tokens
        self.translator.warnings.clear()
        self.translator.truncated.clear()
        options = dict(options)
        aligning = options.pop("alignments", False)
        try:
            ids: list | None = [] if aligning else None
            results = self.translator.translate_nbest(sentences, batch_size=self.limits.max_batch,
                                                      max_tokens=self.limits.max_tokens, ids_out=ids, **options)
            alignments = None
            if aligning:
                from .attention import format_alignments

                pairs = self.translator.align(sentences, [r[0][0] for r in results], ids)  # type: ignore[attr-defined]
                alignments = [format_alignments(p) for p in pairs]
            return results, list(self.translator.truncated), alignments
        finally:
            self.translator.warnings.clear()
            self.translator.truncated.clear()
            self.translate_seconds += time.perf_counter() - start
            since = time.monotonic() - self._trimmed
            if self.limits.trim_seconds and (since > self.limits.trim_seconds or (since > 1 and not self.queue)):
                release_free_heap()
                self._trimmed = time.monotonic()
            if self.metrics is not None:
                self.metrics.generated(self.translator.generated_tokens - tokens_before)


OPTIONS = {"beam": int, "lenpen": (int, float), "greedy": bool, "max_len_a": (int, float), "max_len_b": int,
           "nbest": int, "alignments": bool}
DEFAULTS = {"beam": 4, "lenpen": 0.6, "greedy": False, "max_len_a": 1.0, "max_len_b": 50, "nbest": 1,
            "alignments": False}
RANGES = {"beam": (1, 64), "nbest": (1, 64), "lenpen": (0, 100), "max_len_a": (0, 100), "max_len_b": (0, 100_000)}
FLAGS = {"return_scores": bool}  # shape the answer only: requests with other values still share a batch


@dataclass(frozen=True)
class ParsedRequest:
    """A valid POST /translate body."""

    sentences: list[str]
    options: tuple  # the search options, sorted (name, value) pairs: requests with equal ones share a batch
    single: bool  # "text" was one string: so is the answer
    return_scores: bool


def parse_request(body: bytes, limits: ServeLimits, max_positions: int = 1024,
                  can_align: bool = True, defaults: dict | None = None) -> ParsedRequest:
    """The sentences and search options of a POST /translate body; HTTPError on anything else. `can_align`:
    whether the engine can give word alignments; `defaults`: options a request does not give (DEFAULTS, with
    the model file's own beam and length penalty)."""
    try:
        payload = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise HTTPError(400, f"the body is not UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise HTTPError(400, f"the body is not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise HTTPError(400, "the body is not a request: JSON nested too deeply") from None
    if not isinstance(payload, dict):
        raise HTTPError(422, "the body must be a JSON object with a \"text\" list")
    unknown = sorted(set(payload) - set(OPTIONS) - set(FLAGS) - {"text"})
    if unknown:
        raise HTTPError(422, f"unknown field(s): {', '.join(unknown)} (known: text, {', '.join([*OPTIONS, *FLAGS])})")
    text = payload.get("text")
    single = isinstance(text, str)
    if single:
        text = [text]
    if not isinstance(text, list) or not all(isinstance(s, str) for s in text):
        raise HTTPError(422, "\"text\" must be a string or a list of strings")
    if not text:
        raise HTTPError(422, "\"text\" is empty")
    if len(text) > limits.max_sentences:
        raise HTTPError(413, f"{len(text)} sentences; at most {limits.max_sentences} per request")
    for i, sentence in enumerate(text):
        if len(sentence) > limits.max_chars:
            raise HTTPError(413, f"text[{i}] has {len(sentence)} characters; at most {limits.max_chars}")
        if "\n" in sentence or "\r" in sentence:
            raise HTTPError(422, f"text[{i}] holds a line break; send one sentence per list item")
    options = dict(defaults or DEFAULTS)
    for name, kind in {**OPTIONS, **FLAGS}.items():
        if name in payload:
            value = payload[name]
            if isinstance(value, bool) and kind is not bool:
                raise HTTPError(422, f"\"{name}\" must be a number")
            if not isinstance(value, kind):
                raise HTTPError(422, f"\"{name}\" must be {'true or false' if kind is bool else 'a number'}")
            if isinstance(value, float) and not math.isfinite(value):
                raise HTTPError(422, f"\"{name}\" must be a finite number (got {value})")
            low, high = RANGES.get(name, (None, None))
            if low is not None and not low <= value <= high:
                raise HTTPError(422, f"\"{name}\" must be between {low} and {high:,} (got {value})")
            options[name] = value
    return_scores = bool(options.pop("return_scores", False))
    try:
        TextTranslator.check_options(options["beam"], options["lenpen"], options["max_len_a"],
                                     options["max_len_b"], 1, None, options["greedy"], options["nbest"])
    except NmtError as e:
        raise HTTPError(422, str(e).replace("--", "").replace("-", "_")) from None
    if options["alignments"] and options["nbest"] > 1:
        raise HTTPError(422, "\"alignments\" are given for the best translation only: drop \"nbest\"")
    if options["alignments"] and not can_align:
        raise HTTPError(422, "\"alignments\" read nmt's own attention: this server runs CTranslate2")
    work = decoder_work(text, options, max_positions)
    if work > limits.max_work:
        raise HTTPError(413, f"the request may decode {work:,} tokens (sentences x beam x length limit); at most "
                             f"{limits.max_work:,} per request: send fewer or shorter sentences, or a smaller beam")
    return ParsedRequest(text, tuple(sorted(options.items())), single, return_scores)


def token_bound(sentence: str) -> int:
    """At least as many tokens as any of nmt's tokenizers makes of `sentence`: its UTF-8 bytes, plus one.
    A Moses + BPE token is at most a piece per character; SentencePiece's byte fallback spells a character
    outside its vocabulary (an emoji, a rare CJK character) in one piece per UTF-8 byte, after a word-start
    piece."""
    return len(sentence.encode("utf-8", "surrogatepass")) + 1


def decoder_work(sentences: list[str], options: dict, max_positions: int) -> int:
    """An upper bound on the decoder tokens a request can cost: for each sentence, hypotheses (the beam, 1 when
    greedy) x its length limit a x length + b, with `token_bound` as its length, and no limit beyond the
    model's positions."""
    hypotheses = 1 if options["greedy"] else options["beam"]
    cap = max_positions - 1
    return sum(hypotheses * min(int(options["max_len_a"] * token_bound(s) + options["max_len_b"]) + 1, cap)
               for s in sentences)


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (prometheus_client)."""

    def __init__(self, batcher_state: dict, translator: TextTranslator) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        except ImportError:
            raise NmtError(INSTALL_HINT) from None
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("nmt_requests", "POST /translate requests, by HTTP status", ["status"],
                                registry=registry)
        self.sentences = Counter("nmt_sentences", "Sentences translated", registry=registry)
        self.tokens = Counter("nmt_generated_tokens", "Output tokens generated (best hypotheses, </s> included)",
                              registry=registry)
        self.batches = Histogram("nmt_batch_sentences", "Sentences per search batch", registry=registry,
                                 buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
        self.latency = Histogram("nmt_request_seconds", "Latency of answered POST /translate requests",
                                 registry=registry, buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        queue = Gauge("nmt_queue_sentences", "Sentences waiting for a batch", registry=registry)
        queue.set_function(lambda: batcher_state["batcher"].queued_sentences if "batcher" in batcher_state else 0)
        cache = Gauge("nmt_decoder_cache_bytes", "Decoder cache kept between searches", registry=registry)
        cache.set_function(translator.cache_bytes)

    def batch(self, sentences: int) -> None:
        self.batches.observe(sentences)
        self.sentences.inc(sentences)

    def generated(self, tokens: int) -> None:
        self.tokens.inc(max(tokens, 0))

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def read_api_keys(path: str | None, environment: str | None) -> tuple[str, ...]:
    """API keys from a file (one per line; blank lines and # comments skipped) and from NMT_API_KEYS (comma or
    space separated); one-line NmtError for a missing file or one without keys."""
    keys: list[str] = []
    if path is not None:
        from .textio import read_lines

        lines = [line.strip() for line in read_lines(path)]
        found = [line for line in lines if line and not line.startswith("#")]
        if not found:
            raise NmtError(f"{path}: no API keys in it (one key per line)")
        keys += found
    if environment:
        keys += environment.replace(",", " ").split()
    return tuple(keys)


def authorized(header: str | None, keys: tuple[str, ...]) -> bool:
    """Whether an Authorization header carries one of `keys` as a Bearer token; every key is compared, in
    constant time, whatever matches."""
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    given = token.strip().encode()
    return sum(hmac.compare_digest(given, key.encode()) for key in keys) > 0


class AccessLog:
    """One line per request on stderr: method, path, status, sentences, latency; never the text."""

    def __init__(self, style: str) -> None:
        if style not in ("plain", "json", "off"):
            raise NmtError(f"--access-log must be plain, json or off (got {style!r})")
        self.style = style

    def write(self, method: str, path: str, status: int, sentences: int, seconds: float) -> None:
        if self.style == "off":
            return
        if self.style == "json":
            line = json.dumps({"time": round(time.time(), 3), "method": method, "path": path, "status": status,
                               "sentences": sentences, "seconds": round(seconds, 6)})
        else:
            line = (f"{time.strftime('%Y-%m-%d %H:%M:%S')} {method} {path} {status} {sentences} sentences "
                    f"{seconds:.3f} s")
        print(line, file=sys.stderr, flush=True)


async def read_body(request: Any, limit: int) -> bytes:
    """The request body, read chunk by chunk and refused (413) once it passes `limit` bytes: a declared
    Content-Length over it is refused before reading, a chunked upload as soon as it grows past it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPError(413, f"the body has {int(declared):,} bytes; at most {limit:,}")
    from starlette.requests import ClientDisconnect

    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, f"the body passed {limit:,} bytes; at most {limit:,}")
            chunks.append(chunk)
    except ClientDisconnect:  # gone before its body arrived: nobody to answer, nothing to log as an error
        raise HTTPError(499, "client closed the request") from None
    return b"".join(chunks)


def answer(results: list[list[tuple[str, float]]], request: ParsedRequest, nbest: int, warnings: list[str],
           alignments: list[str] | None = None) -> dict:
    """The response body: the translations (a list, or one string for a single "text" string; n-best lists
    when nbest > 1), their scores and word alignments ("i-j ..." strings) on request, and the request's
    warnings."""
    def shape(items: list) -> Any:
        return items[0] if request.single else items

    if nbest == 1:
        body: dict[str, Any] = {"translations": shape([r[0][0] for r in results])}
        scores = shape([r[0][1] for r in results])
    else:
        body = {"translations": shape([[text for text, _ in r] for r in results])}
        scores = shape([[score for _, score in r] for r in results])
    if request.return_scores:
        body["scores"] = scores
    if alignments is not None:
        body["alignments"] = shape(alignments)
    if warnings:
        body["warnings"] = warnings
    return body


def create_app(translator: TextTranslator, limits: ServeLimits = ServeLimits(), engine: str = "nmt",
               executor: ThreadPoolExecutor | None = None, api_keys: tuple[str, ...] = (),
               access_log: str = "off") -> Any:
    """The FastAPI application serving `translator`, translating on `executor` (one thread; by default a new
    `translator_thread`). With `api_keys`, POST /translate and GET /metrics need one as a Bearer token."""
    try:
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, Response
    except ImportError:
        raise NmtError(INSTALL_HINT) from None
    from contextlib import asynccontextmanager

    state: dict[str, Any] = {}
    metrics = Metrics(state, translator)
    log = AccessLog(access_log)
    translator.limit_cache(int(limits.cache_mb * 2**20))
    body_limit = limits.body_limit()
    beam, lenpen = translator.search_settings()
    defaults = {**DEFAULTS, "beam": beam, "lenpen": lenpen}  # the model file's own, where it has them

    @asynccontextmanager
    async def lifespan(app):
        state["batcher"] = batcher = Batcher(translator, limits, executor, metrics)
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()
        batcher._executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="nmt", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def error(status: int, message: str, **headers: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status, headers=headers or None)

    def refused(request: Request) -> JSONResponse | None:
        if api_keys and not authorized(request.headers.get("authorization"), api_keys):
            return error(401, "a valid API key is needed: Authorization: Bearer <key>",
                         **{"WWW-Authenticate": "Bearer"})
        return None

    @app.get("/health")
    async def health() -> dict:
        batcher: Batcher = state["batcher"]
        return {"status": "ok", "engine": engine, "source_lang": translator.source_lang,
                "target_lang": translator.target_lang, "beam": defaults["beam"], "lenpen": defaults["lenpen"],
                "queued_sentences": batcher.queued_sentences,
                "translated_sentences": batcher.translated_sentences, "batches": batcher.batches,
                "translate_seconds": round(batcher.translate_seconds, 6)}

    @app.get("/metrics")
    async def prometheus(request: Request) -> Any:
        denied = refused(request)
        if denied is not None:
            return denied
        content, media_type = metrics.exposition()
        return Response(content, media_type=media_type)

    @app.post("/translate")
    async def translate(request: Request) -> Any:
        start = time.perf_counter()
        response, sentences = await translate_request(request)
        status = response.status_code if isinstance(response, Response) else 200
        seconds = time.perf_counter() - start
        metrics.requests.labels(str(status)).inc()
        if status == 200:
            metrics.latency.observe(seconds)
        log.write("POST", "/translate", status, sentences, seconds)
        return response

    async def translate_request(request: Request) -> tuple[Any, int]:
        denied = refused(request)
        if denied is not None:
            return denied, 0
        try:
            parsed = parse_request(await read_body(request, body_limit), limits, translator.max_positions,
                                   hasattr(translator, "align"), defaults)
        except HTTPError as e:
            return error(e.status, e.message), 0
        batcher: Batcher = state["batcher"]
        try:
            job = batcher.submit(parsed.sentences, parsed.options)
        except QueueFull:
            return error(503, f"the queue is full ({limits.max_queue} sentences); retry later",
                         **{"Retry-After": "1"}), 0
        disconnected = asyncio.create_task(_wait_for_disconnect(request))
        try:
            await asyncio.wait({job.future, disconnected}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnected.cancel()
        if not job.future.done():  # the client went away first: skip its work if its batch has not started
            batcher.cancel(job)
            return error(499, "client closed the request"), 0
        try:
            results, warnings, alignments = job.future.result()
        except NmtError as e:
            return error(422, str(e)), 0
        except Exception as e:  # noqa: BLE001 - one failed batch must not stop the server
            return error(500, f"translation failed: {type(e).__name__}: {e}"), 0
        return answer(results, parsed, dict(parsed.options)["nbest"], warnings, alignments), len(parsed.sentences)

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return error(404, f"no such endpoint: {request.method} {request.url.path} "
                          "(use POST /translate, GET /health, GET /metrics)")

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


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serve(translator: TextTranslator, host: str, port: int, limits: ServeLimits, engine: str,
          on_ready: Any = None, executor: ThreadPoolExecutor | None = None, api_keys: tuple[str, ...] = (),
          access_log: str = "plain") -> None:
    """Run the HTTP server until SIGTERM or Ctrl-C; batches run on `executor` (the thread that loaded
    `translator`, see `translator_thread`). SIGTERM stops accepting connections, answers what is queued (for
    up to `limits.shutdown_seconds`) and returns, so the process exits 0."""
    try:
        import uvicorn
    except ImportError:
        raise NmtError(INSTALL_HINT) from None
    app = create_app(translator, limits, engine, executor, api_keys, access_log)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=limits.shutdown_seconds)
    server = uvicorn.Server(config)
    if host not in LOOPBACK and not api_keys:
        print(f"nmt serve: warning: listening on {host} without API keys: anyone who can reach port {port} can "
              "use it (--api-key-file FILE or NMT_API_KEYS)", file=sys.stderr, flush=True)
    if on_ready:
        on_ready()
    # uvicorn re-raises the signal that stopped it once it has shut down gracefully: handled (ignored) here, it
    # ends the process normally (exit 0) instead of killing it.
    main_thread = threading.current_thread() is threading.main_thread()  # signals are set there only
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if main_thread else None
    try:
        server.run()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
