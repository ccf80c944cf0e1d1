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

from nmt_cli.serve import ServeLimits, create_app, translator_thread
from nmt_cli.translate import Translator

from .conftest import expect_error, require_extra, run_cli, threshold

uvicorn = require_extra("uvicorn")  # an optional extra: skipped without it, except under CI


class Server:
    """An nmt server in a background thread, on a free loopback port."""

    def __init__(self, translator, limits: ServeLimits, executor: ThreadPoolExecutor | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(create_app(translator, limits, executor=executor), host="127.0.0.1", port=self.port,
                                log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        wait_until(lambda: self.server.started)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def post(self, body: bytes | dict, path: str = "/translate") -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def get(self, path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=60) as response:
                return response.status, json.loads(response.read())
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
    ({"text": "one string"}, 422, "list of strings"),
    ({"text": [1, 2]}, 422, "list of strings"),
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
        self.source_lang, self.target_lang = translator.source_lang, translator.target_lang

    def translate(self, sentences, **options):
        self.calls.append(list(sentences))
        self.release.wait(30)
        return self.inner.translate(sentences, **options)


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
    expect_error(run_cli("serve", "-m", toy_model, "--max-batch", "0"), "--max-batch")
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
    translate = translator.translate

    def recording(*args, **kwargs):
        threads.add(threading.current_thread())
        return translate(*args, **kwargs)

    translator.translate = recording
    with Server(translator, ServeLimits(), executor) as server:
        for sentence in sentences[:3]:
            assert server.post({"text": [sentence]})[0] == 200
    assert threads == {loader}
