"""`nmt serve`'s page, driven in headless Chromium: what it shows equals what `nmt translate` prints and what
the JSON API answers (translations, n-best with scores, word alignments), and the server's 4xx messages
appear as text in it."""

from __future__ import annotations

import os

import pytest

from nmt_cli.decode.translate import Translator
from nmt_cli.serve.batching import ServeLimits

from .browser import BrowserMissing, headless_chromium, page_text
from .conftest import require_extra, run_cli
from .test_serve import Server

require_extra("uvicorn")
KEY = "page-test-key"


@pytest.fixture(scope="module")
def browser():
    """Chromium through selenium; without them the tests skip, except under CI, where they fail."""
    try:
        driver = headless_chromium(width=400, height=900)  # the narrowest width the page is made for
    except Exception as e:  # noqa: BLE001 - BrowserMissing, or selenium's own error when Chromium cannot start
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        if os.environ.get("CI"):
            pytest.fail(f"the browser tests need headless Chromium: {message}")
        pytest.skip(message if isinstance(e, BrowserMissing) else f"Chromium did not start: {message}")
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server(toy_model):
    with Server(Translator.from_checkpoint(toy_model), ServeLimits(max_chars=80), api_keys=(KEY,)) as running:
        yield running


@pytest.fixture(scope="module")
def lines(toy_data) -> list[str]:
    return (toy_data.parent / "raw" / "valid.en").read_text(encoding="utf-8").splitlines()[:5]


def linked(pair, side: str) -> set[int]:
    """The indices of the words the page highlights as linked on one side of a sentence pair."""
    return {int(w.get_attribute("data-index")) for w in pair.find_elements("css selector", f".{side} .w.linked")}


def submit(browser, text: str, key: str | None, nbest: int = 1, by_keyboard: bool = False) -> None:
    """Fill the page's fields (the API key's unless None) and translate; returns once the page shows an
    answer or an error."""
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    browser.execute_script("document.getElementById('results').replaceChildren();"
                           "document.getElementById('error').textContent = '';")
    for field, value in ((("key", key),) if key is not None else ()) + (("source", text), ("nbest", str(nbest))):
        element = browser.find_element("id", field)
        element.clear()
        element.send_keys(value)  # in the textarea, "\n" is Enter: a line break (Ctrl+Enter translates)
    if by_keyboard:
        browser.find_element("id", "source").send_keys(Keys.CONTROL, Keys.ENTER)
    else:
        browser.find_element("id", "go").click()
    WebDriverWait(browser, 60).until(lambda b: page_text(b, ".pair .target") or page_text(b, "#error")[0])


def test_the_page_shows_what_nmt_translate_prints_and_the_apis_alignments(browser, server, toy_model, lines,
                                                                          tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains

    (tmp_path / "in.en").write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = run_cli("translate", "-m", toy_model, "-i", tmp_path / "in.en")
    assert result.exit_code == 0, result.output
    printed = result.stdout.splitlines()
    assert server.get("/")[0] == 200  # the page itself loads without a key; the API behind it needs one
    assert server.post({"text": lines[:1]})[0] == 401

    browser.get(f"http://127.0.0.1:{server.port}/")
    about = browser.find_element("id", "about").text
    assert "en → de" in about and "beam 4, length penalty 0.6" in about and "parameters" in about
    assert browser.find_element("id", "key").is_displayed()
    submit(browser, "\n".join(lines), KEY, by_keyboard=True)
    assert page_text(browser, ".pair .target") == printed
    assert page_text(browser, ".pair .source") == lines
    width = browser.execute_script("return [document.documentElement.scrollWidth, window.innerWidth]")
    assert width[0] <= width[1]  # readable at 400 px: nothing runs off the side

    status, answer = server.post({"text": lines, "alignments": True}, key=KEY)
    assert status == 200 and answer["translations"] == printed
    pairs = browser.find_elements("css selector", ".pair")
    checked = 0
    for pair, links in zip(pairs, answer["alignments"]):
        links = [tuple(map(int, link.split("-"))) for link in links.split()]
        for word in pair.find_elements("css selector", ".source .w"):
            ActionChains(browser).move_to_element(word).perform()
            i = int(word.get_attribute("data-index"))
            shown = linked(pair, "target")
            assert shown == {t for s, t in links if s == i}, (pair.text, i, links)
            checked += bool(shown)
        target = pair.find_elements("css selector", ".target .w")[0]  # and from the target side, by keyboard focus
        browser.execute_script("arguments[0].focus()", target)
        assert linked(pair, "source") == {s for s, t in links if t == 0}
    assert checked >= len(lines)  # the words hovered had links to show, not only empty sets

    submit(browser, lines[0], KEY, nbest=3)
    status, nbest = server.post({"text": lines[:1], "nbest": 3, "return_scores": True}, key=KEY)
    shown = page_text(browser, ".pair ol.nbest li")
    assert shown == [f"{t}  (score {s:.4f})" for t, s in zip(nbest["translations"][0], nbest["scores"][0])]


def test_the_servers_4xx_messages_show_in_the_page(browser, server, lines):
    browser.get(f"http://127.0.0.1:{server.port}/")
    long_line = " ".join(lines * 10)[:120]
    submit(browser, long_line, KEY)
    status, answer = server.post({"text": [long_line]}, key=KEY)
    assert status == 413
    assert page_text(browser, "#error") == [f"413: {answer['error']}"]
    assert not page_text(browser, ".pair")

    submit(browser, lines[0], "not-the-key")
    status, answer = server.post({"text": lines[:1]}, key="not-the-key")
    assert status == 401
    assert page_text(browser, "#error") == [f"401: {answer['error']}"]

    submit(browser, lines[0], KEY)  # the error goes once a request succeeds
    assert page_text(browser, "#error") == [""] and len(page_text(browser, ".pair")) == 1


def test_no_page_and_what_info_tells(toy_model):
    translator = Translator.from_checkpoint(toy_model)
    with Server(translator, ServeLimits(), page=False) as server:
        status, body = server.get("/")
        assert status == 404 and "GET /info" in body["error"] and "GET /," not in body["error"]
        status, info = server.get("/info")
    model = translator.ensemble.models[0]
    padding = (model.config.rows - model.config.vocab_size) * model.config.d_model  # zero rows, not parameters
    assert status == 200 and info["parameters"] == sum(p.numel() for p in model.parameters()) - padding
    assert info["source_lang"] == "en" and info["target_units"] == "words" and info["target_direction"] == "ltr"
    assert info["alignments"] is True and info["api_key"] is False and info["beam"] == 4


def test_a_right_to_left_target_and_a_side_counted_in_characters(browser, toy_model, lines):
    """A model whose target language is written right to left shows its translations with dir="rtl"; a source
    language written without spaces is aligned character by character, and the page counts characters as the
    API does (the toy model's languages relabelled: its text is the same)."""
    from selenium.webdriver.common.action_chains import ActionChains

    translator = Translator.from_checkpoint(toy_model)
    translator.source_lang, translator.target_lang = "zh", "he"
    with Server(translator, ServeLimits()) as server:
        browser.get(f"http://127.0.0.1:{server.port}/")
        assert not browser.find_element("id", "key").is_displayed()  # no keys: no key field
        submit(browser, lines[1], None)
        _, answer = server.post({"text": lines[1:2], "alignments": True})
    pair = browser.find_element("css selector", ".pair")
    assert pair.find_element("css selector", ".target").get_attribute("dir") == "rtl"
    assert pair.find_element("css selector", ".source").get_attribute("dir") == "ltr"
    characters = pair.find_elements("css selector", ".source .w")
    assert [c.text for c in characters] == [c for c in lines[1] if not c.isspace()]
    links = [tuple(map(int, link.split("-"))) for link in answer["alignments"][0].split()]
    assert max(s for s, _ in links) >= len(lines[1].split())  # counted in characters, past the word count
    for character in characters[:6]:
        ActionChains(browser).move_to_element(character).perform()
        i = int(character.get_attribute("data-index"))
        assert linked(pair, "target") == {t for s, t in links if s == i}
