"""`nmt serve` under load: throughput (sentences/s) and p50/p95 latency when 1, 8 and 32 concurrent clients
each send single sentences of Multi30k test_2016_flickr, against the batch-64 throughput of the same
translator in one process (what `nmt translate` does with a file: with its default workers, the percentages'
reference, and with one). Beam 4, fp32, the `small` model. Also the server's own view (from /health):
sentences per batch, the share of the time its translator thread was busy, and its sentences/s while busy.
Every measurement runs `--rounds` times (default 2: the first also pays oneDNN's kernel creation for shapes
not seen yet) and the best round is reported.

    python benchmarks/serve.py [--model exp/multi30k/model.pt] [--clients 1,8,32] [--sentences 500] [--rounds 2]
                               [--cpu-allocator system]    # the server's allocator
    python benchmarks/serve.py --soak MINUTES [--model ...] [--precision bf16] [--engine ctranslate2]
                                [--cpu-allocator system] [--json FILE]
                                                # good and bad requests (soak.py)
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

from common import REPO, ServeProcess, flickr_test_sources, machine, print_table

from nmt_cli.torch_env import ALLOCATOR_CHOICES


def _post(port: int, sentence: str, connection: http.client.HTTPConnection | None = None) -> list[str]:
    """POST one sentence; over `connection` when given (kept open between requests, as HTTP clients do)."""
    body = json.dumps({"text": [sentence]}).encode()
    own = connection is None
    connection = connection or http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        connection.request("POST", "/translate", body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        payload = response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {payload[:200]!r}")
        return json.loads(payload)["translations"]
    finally:
        if own:
            connection.close()


def _health(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as response:
        return json.loads(response.read())


def _load(port: int, sentences: list[str], clients: int) -> tuple[float, list[float]]:
    """Send every sentence once, from `clients` threads each waiting for its answer before the next, each over
    its own kept-open connection."""
    latencies: list[float] = []
    lock = threading.Lock()
    next_index = [0]

    def client() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        try:
            while True:
                with lock:
                    i = next_index[0]
                    next_index[0] += 1
                if i >= len(sentences):
                    return
                start = time.perf_counter()
                _post(port, sentences[i], connection)
                with lock:
                    latencies.append(time.perf_counter() - start)
        finally:
            connection.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, latencies


def main() -> list[list]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=str(REPO / "exp" / "multi30k" / "model.pt"))
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--sentences", type=int, default=500)
    parser.add_argument("--batch-wait-ms", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs of each measurement (references and each client count); the best is reported")
    parser.add_argument("--soak", type=float, metavar="MINUTES",
                        help="instead: good and bad requests for MINUTES (benchmarks/soak.py)")
    parser.add_argument("--json", type=Path, help="with --soak: also write its record here")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="with --soak: the server's")
    parser.add_argument("--engine", default="auto", choices=("auto", "nmt", "ctranslate2"),
                        help="with --soak: the server's")
    parser.add_argument("--cpu-allocator", default="auto", choices=ALLOCATOR_CHOICES,
                        help="the server's (nmt serve --cpu-allocator)")
    args = parser.parse_args()
    if not Path(args.model).exists():
        sys.exit(f"benchmark: {args.model} not found; run `make multi30k` first or pass --model")
    if args.soak is not None:
        from soak import soak

        record = soak(args.model, args.soak, args.precision, args.engine, args.cpu_allocator)
        if args.json:
            args.json.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        return []
    from nmt_cli.export.engines import load_translator

    sentences = flickr_test_sources()[: args.sentences]
    rounds = max(1, args.rounds)
    rows, batch64 = [], {}
    for workers in (0, 1):  # as `nmt translate` runs (0: its default), then one batch at a time
        translator = load_translator([args.model], device="cpu", workers=workers)
        translator.translate(sentences[:64])  # warm-up
        batch64[workers] = arrival32 = 0.0
        for _ in range(rounds):  # the first round also pays oneDNN's kernel creation for new shapes
            start = time.perf_counter()
            expected = translator.translate(sentences, beam=4, batch_size=64)
            batch64[workers] = max(batch64[workers], len(sentences) / (time.perf_counter() - start))
            if workers == 1:
                # What 32 clients can at best give with one worker: batches of 32 in arrival order (not sorted).
                start = time.perf_counter()
                for i in range(0, len(sentences), 32):
                    translator.translate(sentences[i : i + 32], beam=4, batch_size=32)
                arrival32 = max(arrival32, len(sentences) / (time.perf_counter() - start))
        rows.append([f"nmt translate, batch 64, {translator.workers} worker(s) (one process, no HTTP)", "-",
                     f"{batch64[workers]:.1f}", f"{100 * batch64[workers] / batch64[0]:.0f}%", "-", "-", "64", "-",
                     "-"])
        del translator
    rows.append(["translate() on each 32 sentences in arrival order, 1 worker (no HTTP)", "-", f"{arrival32:.1f}",
                 f"{100 * arrival32 / batch64[0]:.0f}%", "-", "-", "32", "-", "-"])
    rows += _serve_rows(args, sentences, expected, batch64[0])
    print_table(f"serve: Multi30k test_2016_flickr, {len(sentences)} sentences, beam 4, fp32 ({machine()})",
                ["configuration", "clients", "sent/s", "of batch 64", "p50 ms", "p95 ms", "sentences per batch",
                 "translator busy", "sent/s while busy"], rows)
    return rows


def _serve_rows(args, sentences: list[str], expected: list[str], reference: float) -> list[list]:
    """`nmt serve` under each client count."""
    rounds = max(1, args.rounds)

    rows = []
    with ServeProcess(args.model, "--batch-wait-ms", str(args.batch_wait_ms), "--access-log", "off",
                      "--cpu-allocator", args.cpu_allocator) as server:
        port = server.port
        for s in sentences[:64]:
            _post(port, s)  # warm-up
        assert _post(port, sentences[0]) == expected[:1]
        for clients in [int(c) for c in args.clients.split(",")]:
            best = None
            for _ in range(rounds):
                before = _health(port)
                seconds, latencies = _load(port, sentences, clients)
                after = _health(port)
                if best is None or seconds < best[0]:
                    best = seconds, latencies, before, after
            seconds, latencies, before, after = best
            rate = len(sentences) / seconds
            q = statistics.quantiles(latencies, n=20)
            translated = after["translated_sentences"] - before["translated_sentences"]
            per_batch = translated / max(after["batches"] - before["batches"], 1)
            busy = after.get("translate_seconds", 0) - before.get("translate_seconds", 0)  # 0: an older server
            rows.append([f"nmt serve, {clients} client(s), 1 sentence per request", clients, f"{rate:.1f}",
                         f"{100 * rate / reference:.0f}%", f"{1000 * statistics.median(latencies):.0f}",
                         f"{1000 * q[18]:.0f}", f"{per_batch:.1f}", f"{100 * busy / seconds:.0f}%" if busy else "-",
                         f"{translated / busy:.1f}" if busy else "-"])
    return rows


if __name__ == "__main__":
    main()
