"""What `nmt serve` tells its operators: Prometheus metrics (GET /metrics) and the access log."""

from __future__ import annotations

import json
import sys
import time

from nmt_cli.decode.pipeline import TextTranslator
from nmt_cli.errors import NmtError

INSTALL_HINT = "nmt serve needs FastAPI and uvicorn; install them with: pip install -e '.[serve]'"


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


