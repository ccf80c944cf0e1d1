"""`nmt serve` on loopback: concurrent clients get their own translations, bad requests get a JSON 4xx and
do not disturb good ones, the queue bound holds, and a client that leaves costs no translation."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from nmt_cli.decode.translate import Translator
from nmt_cli.serve.app import create_app
from nmt_cli.serve.batching import ServeLimits, translator_thread
from nmt_cli.torch_env import find_allocator

from .conftest import expect_error, mapped_allocator, require_extra, run_cli, threshold

uvicorn = require_extra("uvicorn")  # an optional extra: skipped without it, except under CI


class Server:
    """An nmt server in a background thread, on a free loopback port."""

    def __init__(self, translator, limits: ServeLimits, executor: ThreadPoolExecutor | None = None,
                 api_keys: tuple[str, ...] = (), page: bool = True) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(create_app(translator, limits, executor=executor, api_keys=api_keys, page=page),
                                host="127.0.0.1", port=self.port, log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        wait_until(lambda: self.server.started)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def post(self, body: bytes | dict, path: str = "/translate", key: str | None = None) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def get(self, path: str, key: str | None = None) -> tuple[int, dict | str]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                         headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                raw = response.read()
                text = response.headers.get_content_type() != "application/json"
                return response.status, raw.decode() if text else json.loads(raw)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def translator(toy_model) -> Translator:
    return Translator.from_checkpoint(toy_model)


@pytest.fixture(scope="module")
def sentences(toy_data) -> list[str]:
    return (toy_data.parent / "raw" / "valid.en").read_text().splitlines()[:48]


def test_concurrent_clients_get_their_own_translations_batched_together(translator, sentences):
    expected = translator.translate(sentences, beam=4)
    expected_greedy = translator.translate(sentences, greedy=True)
    with Server(translator, ServeLimits(max_batch=16, batch_wait_ms=20)) as server:
        began = time.perf_counter()

        def one(i: int) -> tuple[int, dict, str]:
            greedy = i % 3 == 0  # requests with other options are never mixed into the same batch
            return (i, *server.post({"text": [sentences[i]], "greedy": greedy} if greedy else
                                    {"text": [sentences[i]]}))

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(one, range(len(sentences))))
        for i, status, body in answers:
            assert status == 200, body
            assert body["translations"] == [(expected_greedy if i % 3 == 0 else expected)[i]]
        status, health = server.get("/health")
        assert status == 200 and health["status"] == "ok" and health["translated_sentences"] == len(sentences)
        assert health["batches"] < len(sentences)  # requests arriving together shared batches
        assert 0 < health["translate_seconds"] < time.perf_counter() - began  # one batch at a time
        status, body = server.post({"text": sentences[:5], "beam": 2})  # several sentences, in order
        assert body["translations"] == translator.translate(sentences[:5], beam=2)


def test_a_batch_waits_only_until_the_last_batchs_clients_are_back(translator, sentences):
    """Clients that send again when answered: the first batch waits the whole --batch-wait-ms for company,
    later ones only until as many sentences are queued as the last batch answered; one client alone is not
    kept waiting."""
    wait = 1.5
    with Server(translator, ServeLimits(max_batch=16, batch_wait_ms=wait * 1000)) as server:
        def client(i: int) -> list[float]:
            times = []
            for round_ in range(3):
                start = time.perf_counter()
                status, body = server.post({"text": [sentences[4 * round_ + i]], "greedy": True})
                assert status == 200 and body["translations"] == translator.translate(
                    [sentences[4 * round_ + i]], greedy=True)
                times.append(time.perf_counter() - start)
            return times

        with ThreadPoolExecutor(4) as pool:
            times = list(pool.map(client, range(4)))
        assert all(t[0] >= wait for t in times)  # no history yet: the first batch waited for company
        # then only until the 4 clients were back
        threshold("slowest later request, seconds", max(max(t[1:]) for t in times), high=wait / 2)
        health = server.get("/health")[1]
        assert health["translated_sentences"] == 12 and health["batches"] == 3
    with Server(translator, ServeLimits(max_batch=16, batch_wait_ms=wait * 1000)) as server:
        timed = []
        for sentence in sentences[:3]:
            start = time.perf_counter()
            assert server.post({"text": [sentence]})[0] == 200
            timed.append(time.perf_counter() - start)
        assert timed[0] >= wait, timed
        threshold("slowest later request of one client, seconds", max(timed[1:]), high=wait / 2)


@pytest.mark.parametrize("body,status,fragment", [
    (b"{not json", 400, "not JSON"),
    (b'{"text": ["caf\xe9"]}', 400, "not UTF-8"),
    (b"[1, 2]", 422, "JSON object"),
    ({"text": {"a": 1}}, 422, "string or a list of strings"),
    ({"text": [1, 2]}, 422, "list of strings"),
    (b"[" * 6000 + b"]" * 6000, 400, "nested too deeply"),  # within the body limit, deeper than Python's stack
    (b"[" * 100_000 + b"]" * 100_000, 413, "at most 13,760"),
    (b'{"text": ["a"], "max_len_a": NaN}', 422, "\"max_len_a\" must be a finite number"),
    (b'{"text": ["a"], "lenpen": Infinity}', 422, "\"lenpen\" must be a finite number"),
    (b'{"text": ["a"], "max_len_b": 100000000000000000000}', 422, "\"max_len_b\" must be between 0 and 100,000"),
    ({"text": ["a"], "nbest": 5, "beam": 4}, 422, "nbest 5 is larger than beam 4"),
    ({"text": ["a"], "return_scores": 1}, 422, "\"return_scores\" must be true or false"),
    ({"text": []}, 422, "empty"),
    ({"text": ["a"] * 9}, 413, "at most 8"),
    ({"text": ["a" * 101]}, 413, "at most 100"),
    ({"text": ["a\nb"]}, 422, "line break"),
    ({"text": ["a"], "beem": 4}, 422, "unknown field"),
    ({"text": ["a"], "beam": "4"}, 422, "\"beam\""),
    ({"text": ["a"], "beam": 0}, 422, "\"beam\""),
    ({"text": ["a"], "greedy": 1}, 422, "\"greedy\""),
    ({"text": ["a"], "lenpen": -1}, 422, "lenpen"),
])
def test_bad_requests_get_a_json_4xx_and_the_server_keeps_serving(translator, sentences, body, status, fragment):
    with Server(translator, ServeLimits(max_sentences=8, max_chars=100)) as server:
        got, answer = server.post(body)
        assert got == status and fragment in answer["error"], answer
        got, answer = server.post({"text": sentences[:2]})
        assert got == 200 and answer["translations"] == translator.translate(sentences[:2])
        assert server.get("/nowhere")[0] == 404 and server.get("/translate")[0] == 405


def wait_until(condition, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class SlowTranslator:
    """Wraps a translator; each batch waits until released, to fill the queue deterministically."""

    def __init__(self, translator: Translator) -> None:
        self.inner, self.release, self.calls = translator, threading.Event(), []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def translate_nbest(self, sentences, **options):
        self.calls.append(list(sentences))
        self.release.wait(30)
        return self.inner.translate_nbest(sentences, **options)


def test_the_queue_bound_holds_and_a_client_that_left_costs_nothing(translator, sentences):
    slow = SlowTranslator(translator)
    with Server(slow, ServeLimits(max_batch=2, max_queue=4, batch_wait_ms=0)) as server:
        with ThreadPoolExecutor(8) as pool:
            first = pool.submit(server.post, {"text": sentences[0:2]})  # taken at once: the batch in progress
            wait_until(lambda: slow.calls)
            queued = [pool.submit(server.post, {"text": [s]}) for s in sentences[2:6]]  # fill the 4 places
            wait_until(lambda: server.get("/health")[1]["queued_sentences"] == 4)
            status, answer = server.post({"text": [sentences[6]]})
            assert status == 503 and "queue is full" in answer["error"]
            # A client that gives up while queued: its sentence is never translated.
            leaver = socket.create_connection(("127.0.0.1", server.port))
            body = json.dumps({"text": [sentences[7]], "greedy": True}).encode()
            leaver.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            time.sleep(0.3)
            leaver.close()
            time.sleep(0.3)
            slow.release.set()
            assert first.result()[0] == 200
            for i, future in enumerate(queued, start=2):
                status, answer = future.result()
                assert status == 200 and answer["translations"] == translator.translate([sentences[i]])
        time.sleep(0.2)
        assert [sentences[7]] not in slow.calls
        assert server.get("/health")[1]["queued_sentences"] == 0


def test_serve_bad_command_line(toy_model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        expect_error(run_cli("serve", "-m", toy_model, "--port", busy), f"127.0.0.1:{busy}", "cannot listen")
    expect_error(run_cli("serve", "-m", toy_model, "--batch-size", "0"), "--batch-size")
    expect_error(run_cli("serve", "-m", toy_model, "--port", "70000"), "--port", "70000")
    expect_error(run_cli("serve", "-m", toy_model, "--max-sentences", "10", "--max-queue", "5"), "--max-queue")
    expect_error(run_cli("serve", "-m", "/nonexistent.pt", "--port", "0"), "nonexistent.pt")


def test_batches_run_on_the_thread_that_loaded_the_model(toy_model, sentences):
    """`nmt serve` loads the model on the thread that later runs every batch, so PyTorch's OpenMP runtime keeps
    one worker pool (two pools on few cores made decoding ~30% slower)."""
    executor = translator_thread()
    loader = executor.submit(threading.current_thread).result()
    translator = executor.submit(Translator.from_checkpoint, toy_model).result()
    threads = set()
    translate = translator.translate_nbest

    def recording(*args, **kwargs):
        threads.add(threading.current_thread())
        return translate(*args, **kwargs)

    translator.translate_nbest = recording
    with Server(translator, ServeLimits(), executor) as server:
        for sentence in sentences[:3]:
            assert server.post({"text": [sentence]})[0] == 200
    assert threads == {loader}


def test_one_string_in_one_string_out_and_nbest_with_the_scores_of_nmt_translate(translator, sentences):
    with Server(translator, ServeLimits()) as server:
        status, body = server.post({"text": sentences[0]})
        assert status == 200 and body == {"translations": translator.translate([sentences[0]])[0]}
        expected = translator.translate_nbest(sentences[:3], beam=4, nbest=3)
        status, body = server.post({"text": sentences[:3], "nbest": 3, "return_scores": True})
        assert status == 200 and body["translations"] == [[t for t, _ in hyps] for hyps in expected]
        assert body["scores"] == [[score for _, score in hyps] for hyps in expected]
        status, body = server.post({"text": sentences[1], "return_scores": True, "greedy": True})
        (text, score), = translator.translate_nbest([sentences[1]], greedy=True)[0]
        assert body == {"translations": text, "scores": score}


def test_request_limits_are_checked_before_the_work_is_queued(translator, sentences):
    """A chunked body is refused once it passes the limit; a request over the decoder-work budget (sentences x
    beam x length limit) gets 413 naming the budget, and the translator never sees it."""
    slow = SlowTranslator(translator)
    slow.release.set()
    limits = ServeLimits(max_sentences=64, max_chars=100, max_work=64 * 4 * 60)
    with Server(slow, limits) as server:
        chunk = b'{"text": [' + b'"aaaa",' * 2000
        raw = socket.create_connection(("127.0.0.1", server.port))
        raw.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(20):  # 20 x 14 KB chunks, never finished: refused after the first two
            try:
                raw.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:
                break
        raw.settimeout(10)
        reply = ""
        while not reply.endswith("}"):
            part = raw.recv(4096).decode()
            if not part:
                break
            reply += part
        raw.close()
        assert reply.startswith("HTTP/1.1 413") and f"at most {limits.body_limit():,}" in reply
        big = {"text": [sentences[0]] * 64, "beam": 64}
        status, body = server.post(big)
        assert status == 413 and "at most 15,360 per request" in body["error"] and "tokens" in body["error"]
        assert not slow.calls
        status, body = server.post({"text": sentences[:4]})  # within the budget: served
        assert status == 200 and body["translations"] == translator.translate(sentences[:4])


def test_truncation_warnings_belong_to_their_request_and_never_pile_up(translator, sentences):
    long_sentence = " ".join(f"w{i % 24}" for i in range(1100)).capitalize() + "."  # > the model's 1,022 tokens
    with Server(translator, ServeLimits(max_chars=10_000, max_work=10**7)) as server:
        status, body = server.post({"text": [sentences[0], long_sentence], "greedy": True, "max_len_b": 5})
        assert status == 200 and len(body["translations"]) == 2
        assert len(body["warnings"]) == 1 and body["warnings"][0].startswith("text[1]: ")
        assert "translated truncated" in body["warnings"][0]
        status, body = server.post({"text": [sentences[1]]})
        assert status == 200 and "warnings" not in body
    assert translator.warnings == [] and translator.truncated == []


def test_the_decoder_cache_kept_between_requests_stays_under_its_ceiling(toy_model, sentences):
    own = Translator.from_checkpoint(toy_model)
    with Server(own, ServeLimits(max_work=10**7)) as server:  # the default ceiling: 256 MB
        assert server.post({"text": sentences[:32], "beam": 16})[0] == 200
        assert 0 < own.cache_bytes() <= 256 * 2**20
    own = Translator.from_checkpoint(toy_model)
    with Server(own, ServeLimits(max_work=10**7, cache_mb=0.05)) as server:
        assert server.post({"text": sentences[:32], "beam": 16})[0] == 200
        assert own.cache_bytes() <= 0.05 * 2**20
        assert server.post({"text": sentences[:2]})[0] == 200  # and it still serves


def test_api_keys_and_metrics(translator, sentences):
    from prometheus_client.parser import text_string_to_metric_families

    with Server(translator, ServeLimits(), api_keys=("k-one", "k-two")) as server:
        assert server.post({"text": sentences[:2]})[0] == 401
        status, body = server.post({"text": sentences[:2]}, key="k-wrong")
        assert status == 401 and "Bearer" in body["error"]
        assert server.get("/metrics")[0] == 401
        assert server.get("/health")[0] == 200  # a load balancer's probe needs no key
        for key in ("k-one", "k-two"):
            status, body = server.post({"text": sentences[:2]}, key=key)
            assert status == 200 and body["translations"] == translator.translate(sentences[:2])
        server.post({"text": []}, key="k-one")
        status, text = server.get("/metrics", key="k-two")
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(text)}
        requests = {s.labels["status"]: s.value for s in families["nmt_requests"].samples
                    if s.name == "nmt_requests_total"}
        assert requests == {"200": 2, "401": 2, "422": 1}
        sentences_total = next(s.value for s in families["nmt_sentences"].samples if s.name == "nmt_sentences_total")
        assert sentences_total == 4
        assert next(s.value for s in families["nmt_generated_tokens"].samples
                    if s.name == "nmt_generated_tokens_total") > 4
        assert next(s.value for s in families["nmt_request_seconds"].samples
                    if s.name == "nmt_request_seconds_count") == 2
        assert "nmt_queue_sentences" in families and "nmt_decoder_cache_bytes" in families


def test_api_key_file_and_its_errors(toy_model, tmp_path):
    from nmt_cli.serve.keys import authorized, read_api_keys

    keys = tmp_path / "keys"
    keys.write_text("# team keys\nalpha\n\n beta \n")
    assert read_api_keys(str(keys), "gamma, delta") == ("alpha", "beta", "gamma", "delta")
    assert authorized("Bearer beta", ("alpha", "beta")) and not authorized("Bearer bet", ("alpha", "beta"))
    assert not authorized("Basic alpha", ("alpha",)) and not authorized(None, ("alpha",))
    (tmp_path / "empty").write_text("# none\n")
    expect_error(run_cli("serve", "-m", toy_model, "--api-key-file", tmp_path / "empty"), "empty", "no API keys")
    expect_error(run_cli("serve", "-m", toy_model, "--api-key-file", tmp_path / "nope"), "nope", "no such file")
    expect_error(run_cli("serve", "-m", toy_model, "--access-log", "xml"), "--access-log")
    expect_error(run_cli("serve", "-m", toy_model, "--max-work", "0"), "--max-work")
    expect_error(run_cli("serve", "-m", toy_model, "--cache-mb", "nan"), "--cache-mb")


def test_sigterm_answers_queued_work_then_exits_0(toy_model, sentences):
    """`nmt serve` on all interfaces without keys warns at start, and runs on tcmalloc where it is installed;
    SIGTERM while requests wait for their batch: every one is answered, then the process exits 0. The access log
    has one line per request, no text."""
    import os
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "nmt_cli", "serve", "-m", str(toy_model), "--host", "0.0.0.0",
                             "--port", str(port), "--batch-wait-ms", "1500", "--batch-size", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        probe = Server.__new__(Server)
        probe.port = port
        wait_until(lambda: _listening(port), timeout=60)
        if find_allocator("tcmalloc") is not None or os.environ.get("CI"):  # nmt serve runs on it where installed
            assert mapped_allocator(proc.pid).startswith("libtcmalloc")
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(probe.post, {"text": [sentences[i]]}) for i in range(4)]
            wait_until(lambda: probe.get("/health")[1]["queued_sentences"] == 4)
            proc.send_signal(signal.SIGTERM)
            answers = [f.result() for f in futures]
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert [a[0] for a in answers] == [200] * 4
    assert [a[1]["translations"][0] for a in answers] == Translator.from_checkpoint(toy_model).translate(
        sentences[:4])
    assert "warning: listening on 0.0.0.0 without API keys" in err
    lines = [x for x in err.splitlines() if " POST /translate 200 1 sentences " in x]
    assert len(lines) == 4 and not any(sentences[0] in x for x in err.splitlines())
    assert "Traceback" not in err


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_freed_heap_is_handed_back_between_batches(translator, sentences, monkeypatch):
    """After a batch, with the queue empty, the server releases its allocator's free memory (at most once a
    second)."""
    import nmt_cli.serve.batching as serve_module
    from nmt_cli.serve.batching import release_free_heap

    release_free_heap()  # callable in this process, whatever it runs on
    calls = []
    monkeypatch.setattr(serve_module, "release_free_heap", lambda: calls.append(time.monotonic()))
    with Server(translator, ServeLimits(trim_seconds=5.0)) as server:
        for i in range(3):
            assert server.post({"text": sentences[i : i + 2]})[0] == 200
            time.sleep(0.6)
    assert 1 <= len(calls) <= 2  # three idle moments within ~2 seconds: at most one trim a second
    assert all(b - a >= 1 for a, b in zip(calls, calls[1:]))
    calls.clear()
    with Server(translator, ServeLimits(trim_seconds=0)) as server:
        assert server.post({"text": sentences[:2]})[0] == 200
    assert not calls


RELEASE_SCRIPT = """
from nmt_cli.serve.batching import release_free_heap
def rss():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) / 1024
blocks = [bytearray(64 * 1024) for _ in range(4000)]  # 250 MB in blocks of 64 KB, every page touched
for block in blocks:
    block[::4096] = b"x" * len(block[::4096])
held = rss()
del blocks
print(held, rss() if release_free_heap() else held)
"""


@pytest.mark.parametrize("allocator", ["system", "tcmalloc", "jemalloc"])
def test_freed_heap_goes_back_to_the_system_on_each_allocator(allocator):
    """The server's release after a batch hands 250 MB of freed blocks back to the kernel on every allocator nmt
    serve may run on: glibc's malloc_trim alone would leave them all in tcmalloc's and jemalloc's caches."""
    import os
    import subprocess
    import sys

    library = None if allocator == "system" else find_allocator(allocator)
    if allocator != "system" and library is None:
        if allocator == "tcmalloc" and os.environ.get("CI"):
            raise AssertionError("CI installs tcmalloc (.ci/run), and it was not found")
        pytest.skip(f"{allocator} is not installed here")
    env = {**os.environ, "LD_PRELOAD": library or ""}
    out = subprocess.run([sys.executable, "-c", RELEASE_SCRIPT], capture_output=True, text=True, env=env, check=True)
    held, after = map(float, out.stdout.split())
    assert held > 250
    threshold(f"RSS kept after release_free_heap on {allocator}, of 250 MB freed", after / held, high=0.5)


def test_requests_search_with_the_model_files_settings_unless_they_say(toy_model, sentences, tmp_path):
    from nmt_cli.model.checkpoint import load_checkpoint, save_checkpoint, with_decoding

    model = tmp_path / "model.pt"
    save_checkpoint(with_decoding(load_checkpoint(toy_model), 2, 1.5, "chosen on val"), model)
    chosen = Translator.from_checkpoint(model)
    with Server(chosen, ServeLimits()) as server:
        status, health = server.get("/health")
        assert (health["beam"], health["lenpen"]) == (2, 1.5)
        status, body = server.post({"text": sentences[:8]})
        assert status == 200 and body["translations"] == chosen.translate(sentences[:8], beam=2, lenpen=1.5)
        status, body = server.post({"text": sentences[:8], "beam": 4, "lenpen": 0.6})
        assert status == 200 and body["translations"] == chosen.translate(sentences[:8], beam=4, lenpen=0.6)


def test_serve_flags_reach_their_limits(monkeypatch, tmp_path):
    """Each of serve's limit flags lands in its own ServeLimits field (--shutdown-seconds once landed in the heap
    trimming interval, positionally), before anything is loaded."""
    seen = {}
    monkeypatch.setattr("nmt_cli.serve.app.serve_model", lambda models, host, port, limits, *a, **k: seen.update(
        limits=limits, port=port))
    result = run_cli("serve", "-m", tmp_path / "m.pt", "--port", "0", "--batch-size", "8", "--max-tokens", "300",
                     "--batch-wait-ms", "2", "--max-queue", "99", "--max-sentences", "9", "--max-chars", "77",
                     "--max-body-bytes", "5000", "--max-work", "1234", "--cache-mb", "3", "--shutdown-seconds", "7")
    assert result.exit_code == 0, result.output
    limits = seen["limits"]
    assert (limits.max_batch, limits.max_tokens, limits.batch_wait_ms, limits.max_queue, limits.max_sentences,
            limits.max_chars, limits.max_body_bytes, limits.max_work, limits.cache_mb, limits.shutdown_seconds,
            limits.trim_seconds) == (8, 300, 2.0, 99, 9, 77, 5000, 1234, 3.0, 7.0, ServeLimits().trim_seconds)


def test_a_line_that_breaks_the_search_fails_its_own_request_only(translator, sentences):
    """An error other than bad input (here a RuntimeError the search raises on one line) in a batch of several
    requests: that request gets its 500, the others their translations, as if each had come alone."""

    class Breaks:
        """The translator, except that a batch holding the line "boom" raises as a broken search would."""

        def __getattr__(self, name):
            return getattr(translator, name)

        def translate_nbest(self, lines, *args, **kwargs):
            if "boom" in lines:
                raise RuntimeError("index out of range")
            return translator.translate_nbest(lines, *args, **kwargs)

    bodies = [{"text": sentences[:3]}, {"text": ["boom"]}, {"text": sentences[3:5]}]
    with Server(Breaks(), ServeLimits(batch_wait_ms=500)) as server:
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(server.post, bodies))
        assert server.get("/health")[0] == 200
    assert [status for status, _ in answers] == [200, 500, 200], answers
    assert "RuntimeError: index out of range" in answers[1][1]["error"]
    assert answers[0][1]["translations"] == translator.translate(sentences[:3])
    assert answers[2][1]["translations"] == translator.translate(sentences[3:5])
