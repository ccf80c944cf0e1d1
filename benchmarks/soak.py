"""`python benchmarks/serve.py --soak MINUTES`: `nmt serve` under a mix of good and bad requests for MINUTES.

Eight clients on loopback, each sending, until the time is up, good requests (beam 4 or greedy, 1-64 sentences
of Multi30k test_2016_flickr, one in ten a single sentence of ~1,900 characters, at the character limit) and
bad ones (every refused case of issue 24: body not JSON / not UTF-8 / nested 6,000 deep / over the size limit,
NaN and 1e20 numbers, wrong types, an empty list, an unknown field, too many sentences or characters, over the
decoder-work budget, no or a wrong API key, and a client that disconnects mid-body). Every good answer is
compared with the translation `nmt translate` gives the same sentences with the same options; every bad one
must get its own 4xx. Prints requests by status, the latency percentiles of the good ones, and the server's
RSS at the start (after a warm-up), after the first minute, at its peak and at the end.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from common import ServeProcess, flickr_test_sources, machine, print_table

KEY = "soak-key"
CLIENTS = 8


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def good_requests(sentences: list[str], rng: random.Random, count: int) -> list[dict]:
    """`count` distinct good request bodies."""
    out = []
    for i in range(count):
        if i % 10 == 9:  # one sentence at the character limit
            long, j = "", rng.randrange(len(sentences))
            while len(long) < 1850:
                long += sentences[j % len(sentences)] + " "
                j += 1
            out.append({"text": [long.strip()[:1990]], "greedy": True})
            continue
        n = rng.choice([1, 1, 2, 4, 8, 16, 32, 64])
        start = rng.randrange(len(sentences) - n)
        body: dict = {"text": sentences[start : start + n]}
        if i % 2:
            body["greedy"] = True
        out.append(body)
    return out


BAD = [  # (body, expected status); bodies are bytes, sent with the key unless said otherwise
    (b"{not json", 400), (b'{"text": ["caf\xe9"]}', 400), (b"[" * 6000 + b"]" * 6000, 400),
    (b'{"text": ["a"], "max_len_a": NaN}', 422), (b'{"text": ["a"], "max_len_b": 100000000000000000000}', 422),
    (b'{"text": [1, 2]}', 422), (b'{"text": []}', 422), (b'{"text": ["a"], "beem": 4}', 422),
    (b'{"text": ["a"], "beam": "4"}', 422), (json.dumps({"text": ["a"] * 65}).encode(), 413),
    (json.dumps({"text": ["a" * 2001]}).encode(), 413), (b'{"text": ["' + b"a" * 900_000 + b'"]}', 413),
    (json.dumps({"text": ["A man rides a bike down the street."] * 64, "beam": 64}).encode(), 413),
]


def post(port: int, body: bytes, key: str | None) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        connection.request("POST", "/translate", body=body, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def disconnect_mid_body(port: int) -> None:
    raw = socket.create_connection(("127.0.0.1", port))
    raw.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                b"\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n{\"text\": [\"A man")
    time.sleep(0.05)
    raw.close()


def soak(model: str, minutes: float, precision: str = "fp32", engine: str = "auto", allocator: str = "auto") -> dict:
    """Run the soak against `nmt serve --precision PRECISION --engine ENGINE --cpu-allocator ALLOCATOR`; return its
    record (also printed as a table). Good answers are checked against the same translator's in this process."""
    from nmt_cli.export.engines import load_translator

    sentences = flickr_test_sources()
    rng = random.Random(1)
    goods = good_requests(sentences, rng, 60)
    translator = load_translator([model], device="cpu", precision=precision, engine=engine)
    expected = [translator.translate(g["text"], greedy=g.get("greedy", False)) for g in goods]
    del translator
    with tempfile.NamedTemporaryFile("w", suffix=".keys", delete=False) as keys:
        keys.write(KEY + "\n")
    counts: Counter = Counter()
    wrong: list[str] = []
    latencies: list[float] = []
    lock = threading.Lock()
    rss: list[tuple[float, float]] = []
    with ServeProcess(model, "--api-key-file", keys.name, "--access-log", "off", "--precision", precision,
                      "--engine", engine, "--cpu-allocator", allocator) as server:
        port = server.port
        for g in goods[:5]:
            post(port, json.dumps(g).encode(), KEY)  # warm-up
        began = time.monotonic()
        end = began + minutes * 60
        rss.append((0.0, rss_mb(server.proc.pid)))

        def client(seed: int) -> None:
            local = random.Random(seed)
            while time.monotonic() < end:
                roll = local.random()
                if roll < 0.7:
                    i = local.randrange(len(goods))
                    start = time.perf_counter()
                    status, answer = post(port, json.dumps(goods[i]).encode(), KEY)
                    seconds = time.perf_counter() - start
                    with lock:
                        counts[f"good {status}"] += 1
                        if status == 200 and answer["translations"] == expected[i]:
                            latencies.append(seconds)
                        else:
                            wrong.append(f"good request {i}: {status} {str(answer)[:120]}")
                elif roll < 0.95:
                    body, want = local.choice(BAD)
                    status, answer = post(port, body, KEY)
                    with lock:
                        counts[f"bad {status}"] += 1
                        if status != want or "error" not in answer:
                            wrong.append(f"bad request {body[:40]!r}: {status}, expected {want}")
                elif roll < 0.98:
                    status, answer = post(port, json.dumps(goods[0]).encode(), local.choice([None, "wrong"]))
                    with lock:
                        counts[f"bad {status}"] += 1
                        if status != 401:
                            wrong.append(f"request without a valid key: {status}")
                else:
                    disconnect_mid_body(port)
                    with lock:
                        counts["disconnected mid-body"] += 1

        threads = [threading.Thread(target=client, args=(seed,)) for seed in range(CLIENTS)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(1.0)
            rss.append((time.monotonic() - began, rss_mb(server.proc.pid)))
        for t in threads:
            t.join()
        rss.append((time.monotonic() - began, rss_mb(server.proc.pid)))
    server_log = server.log()
    after_first_minute = next((mb for t, mb in rss if t >= 60), rss[-1][1])
    q = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else [0.0] * 99
    record = {"minutes": minutes, "precision": precision, "engine": engine, "allocator": allocator,
              "counts": dict(counts), "wrong": wrong[:20], "wrong_count": len(wrong),
              "five_hundreds": sum(v for k, v in counts.items() if k.endswith(" 500")),
              "p50_ms": 1000 * q[49], "p95_ms": 1000 * q[94], "p99_ms": 1000 * q[98],
              "rss_start_mb": rss[0][1], "rss_after_first_minute_mb": after_first_minute,
              "rss_peak_mb": max(mb for _, mb in rss), "rss_end_mb": rss[-1][1], "exit_code": server.proc.returncode,
              "server_tracebacks": server_log.count("Traceback"),
              "rss_each_minute_mb": [round(mb) for t, mb in rss if int(t) % 60 == 0 or t == rss[-1][0]]}
    record["rss_end_vs_first_minute"] = record["rss_end_mb"] / after_first_minute - 1
    rows = [[k, v] for k, v in sorted(counts.items())]
    rows += [["good answers that differ from nmt translate, bad ones without their 4xx", len(wrong)],
             ["responses of 500", record["five_hundreds"]],
             ["latency of good requests p50 / p95 / p99 (ms)",
              f"{record['p50_ms']:.0f} / {record['p95_ms']:.0f} / {record['p99_ms']:.0f}"],
             ["server RSS MB: start / after 1 min / peak / end",
              f"{record['rss_start_mb']:.0f} / {after_first_minute:.0f} / {record['rss_peak_mb']:.0f} / "
              f"{record['rss_end_mb']:.0f} ({100 * record['rss_end_vs_first_minute']:+.1f}% vs after 1 min)"],
             ["server exit code after SIGTERM", server.proc.returncode],
             ["tracebacks in the server's log", record["server_tracebacks"]]]
    print_table(f"serve soak: {minutes:g} minutes, {CLIENTS} clients, {Path(model).name}, {precision}, engine "
                f"{engine}, allocator {allocator} ({machine()})",
                ["what", "count / figure"], rows)
    for line in wrong[:10]:
        print(line)
    return record
