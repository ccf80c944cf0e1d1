"""`nmt serve`: an HTTP JSON API over one translator, with requests that arrive together batched together.

    POST /translate  {"text": ["...", ...] or "...", "beam": 4, "lenpen": 0.6, "greedy": false, "nbest": 1,
                      "return_scores": false}
                     -> {"translations": [...] (or one string), "scores": [...], "warnings": [...]}
    GET  /health     -> {"status": "ok", "engine": ..., "queued_sentences": N, "translate_seconds": S, ...}
    GET  /metrics    -> Prometheus text format (prometheus_client)
    GET  /info       -> the model: languages, size, default decoding, what a request may ask (the page reads it)
    GET  /           -> a page to try the model in a browser (nmt_cli/serve/page.html; off with `page=False`)

Every request is bounded before it takes memory: the body (`max_body_bytes`, counted while it is read), the
sentences and characters, and the decoder work (sentences x beam x length limit, `max_work`). Errors are JSON
`{"error": "..."}` with a 4xx status (400 malformed, 401 no or a wrong API key, 413 over a limit, 422 invalid
fields, 503 queue full); the server keeps serving.
"""

import asyncio
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from nmt_cli.decode.pipeline import TextTranslator
from nmt_cli.errors import NmtError

from .batching import Batcher, QueueFull, ServeLimits
from .keys import authorized
from .metrics import INSTALL_HINT, AccessLog, Metrics
from .requests import DEFAULTS, HTTPError, answer, parse_request, read_body


def create_app(translator: TextTranslator, limits: ServeLimits = ServeLimits(), engine: str = "nmt",
               executor: ThreadPoolExecutor | None = None, api_keys: tuple[str, ...] = (),
               access_log: str = "off", page: bool = True) -> Any:
    """The FastAPI application serving `translator`, translating on `executor` (one thread; by default a new
    `translator_thread`). With `api_keys`, POST /translate and GET /metrics need one as a Bearer token; the
    page (GET /, unless `page` is False) loads without one."""
    try:
        from fastapi import FastAPI, Request
        from fastapi.responses import HTMLResponse, JSONResponse, Response
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

    about = model_info(translator, engine, limits, bool(api_keys))

    @app.get("/info")
    async def info() -> dict:
        return about

    if page:
        html = page_html()

        @app.get("/")
        async def try_page() -> HTMLResponse:
            return HTMLResponse(html)

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
            job = batcher.submit(parsed.sentences, parsed.options, parsed.prefixes, parsed.constraints)
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
                          f"(use POST /translate, GET /health, GET /info, GET /metrics{', GET /' if page else ''})")

    @app.exception_handler(405)
    async def wrong_method(request: Request, exc: Exception) -> JSONResponse:
        return error(405, f"{request.method} not allowed on {request.url.path}")

    return app


def model_info(translator: TextTranslator, engine: str, limits: ServeLimits, keys_required: bool) -> dict:
    """GET /info: the model (`TextTranslator.describe`), the engine, how each side's words are counted in
    alignments and which way it is written, the request limits, and whether an API key is needed."""
    from nmt_cli.text.languages import is_right_to_left, is_unspaced

    described = translator.describe()
    sides = {f"{side}_{key}": value for side in ("source", "target") for key, value in (
        ("units", "characters" if is_unspaced(described[f"{side}_lang"]) else "words"),
        ("direction", "rtl" if is_right_to_left(described[f"{side}_lang"]) else "ltr"))}
    return {"engine": engine, **described, **sides, "alignments": hasattr(translator, "align"),
            "max_sentences": limits.max_sentences, "max_chars": limits.max_chars, "api_key": keys_required}


def page_html() -> str:
    """The page GET / serves: one file, its style and script inline, nothing fetched from elsewhere."""
    from importlib.resources import files

    return files(__package__).joinpath("page.html").read_text(encoding="utf-8")


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
          access_log: str = "plain", page: bool = True) -> None:
    """Run the HTTP server until SIGTERM or Ctrl-C; batches run on `executor` (the thread that loaded
    `translator`, see `translator_thread`). SIGTERM stops accepting connections, answers what is queued (for
    up to `limits.shutdown_seconds`) and returns, so the process exits 0."""
    try:
        import uvicorn
    except ImportError:
        raise NmtError(INSTALL_HINT) from None
    app = create_app(translator, limits, engine, executor, api_keys, access_log, page)
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


def serve_model(models: list[Path], host: str, port: int, limits: ServeLimits, device: str | None,
                precision: str, threads: int, engine: str, api_key_file: Path | None, access_log: str,
                console: Any, on_loaded: Any = None, page: bool = True) -> None:
    """`nmt serve`: check every option (one line for a bad one, before the model loads), load the model on
    the translator thread and serve it until SIGTERM or Ctrl-C."""
    import os

    from nmt_cli.export.ct2 import CTranslate2Translator
    from nmt_cli.export.engines import load_translator

    from .batching import translator_thread
    from .keys import read_api_keys

    if not 0 <= port <= 65535:
        raise NmtError(f"--port must be between 0 and 65535 (got {port})")
    limits.check()
    AccessLog(access_log)  # checks the style
    api_keys = read_api_keys(str(api_key_file) if api_key_file else None, os.environ.get("NMT_API_KEYS"))
    check_port(host, port)
    from nmt_cli.torch_env import SERVING_KERNEL_CACHE, size_kernel_cache

    size_kernel_cache(SERVING_KERNEL_CACHE)  # before any kernel: bounded memory over many request shapes
    executor = translator_thread()  # loads the model and runs every batch: one thread for all PyTorch work
    translator = executor.submit(load_translator, models, device=device, precision=precision, threads=threads,
                                 engine=engine).result()
    if on_loaded is not None:
        on_loaded()
    runs_on = "ctranslate2" if isinstance(translator, CTranslate2Translator) else "nmt"
    serve(translator, host, port, limits, runs_on, on_ready=lambda: console.print(
        f"serving {models[0]} ({runs_on}) on http://{host}:{port} ({'a page to try it at /; ' if page else ''}"
        f"POST /translate, GET /health, GET /info, GET /metrics{'; API keys required' if api_keys else ''})",
        markup=False, highlight=False), executor=executor, api_keys=api_keys, access_log=access_log, page=page)
