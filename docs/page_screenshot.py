"""Remake docs/images/serve-page.png: `nmt serve`'s page with a real model, a few sentences translated and
one word's alignment highlighted.

    python docs/page_screenshot.py --model exp/multi30k/model.pt \
        --input ../shared/data/multi30k/test_2016_flickr.en.gz [--lines 3] [--word 2] [--out docs/images/serve-page.png]

Needs Chromium, ChromeDriver and selenium (as the page's tests do).
"""

from __future__ import annotations

import argparse
import gzip
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.browser import headless_chromium, page_text  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_lines(path: Path, n: int) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [next(f).rstrip("\n") for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint or exported folder to serve")
    parser.add_argument("--input", required=True, type=Path, help="source sentences (text or .gz)")
    parser.add_argument("--lines", type=int, default=3, help="sentences to translate")
    parser.add_argument("--word", type=int, default=2, help="source word (0-based) of the first line to point at")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "serve-page.png")
    args = parser.parse_args()
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.support.ui import WebDriverWait

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "nmt_cli", "serve", "-m", args.model, "--port", str(port)])
    driver = headless_chromium(width=900, height=1000)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("nmt serve did not start") from None
                time.sleep(0.5)
        driver.get(f"http://127.0.0.1:{port}/")
        driver.find_element("id", "source").send_keys("\n".join(first_lines(args.input, args.lines)))
        driver.find_element("id", "scores").click()
        driver.find_element("id", "go").click()
        WebDriverWait(driver, 120).until(lambda d: page_text(d, ".pair .target"))
        word = driver.find_elements("css selector", ".pair .source .w")[args.word]
        ActionChains(driver).move_to_element(word).perform()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(args.out))
        print(f"{args.out}: {len(page_text(driver, '.pair'))} sentences, word {args.word} of the first highlighted")
    finally:
        driver.quit()
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
