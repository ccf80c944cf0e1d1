"""The wheel carries the whole package: built from the tracked files alone (as a clean clone holds them) and
installed without `-e` into a fresh environment, it runs `nmt --help`, translates with a checkpoint exactly as
the source tree does, and serves its page (package data) at GET /."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from pathlib import Path

from nmt_cli.decode.translate import Translator

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_wheel_installed_without_editing_translates_and_serves_its_page(toy_model, tmp_path):
    source = tmp_path / "source"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes((REPO / name).read_bytes())
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, source], check=True,
                   capture_output=True)
    (wheel,) = wheels.glob("nmt_cli-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    in_tree = {p.relative_to(REPO).as_posix() for p in (REPO / "nmt_cli").rglob("*") if p.suffix in (".py", ".html")}
    assert in_tree <= names, in_tree - names

    # A fresh environment: the wheel installed into it, the dependencies seen through a .pth file (this
    # environment's site-packages, where a .pth such as the editable install's is not processed).
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", env_dir], check=True)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([*pip, "--python", python, "install", "--no-deps", "--no-compile", wheel], check=True,
                   capture_output=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    run = dict(cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    where = subprocess.run([python, "-c", "import nmt_cli.serve.app as a; print(a.__file__)"], **run)
    assert where.stdout.startswith(str(site)), (where.stdout, where.stderr)
    nmt = env_dir / "bin" / "nmt"
    helped = subprocess.run([nmt, "--help"], **run)
    assert helped.returncode == 0 and "translate" in helped.stdout, helped.stderr

    lines = ["A man is riding a bike.", "Two dogs play in the snow."]
    (tmp_path / "in.en").write_text("\n".join(lines) + "\n", encoding="utf-8")
    translated = subprocess.run([nmt, "translate", "-m", toy_model, "-i", tmp_path / "in.en"], **run)
    assert translated.returncode == 0, translated.stderr
    assert translated.stdout.splitlines() == Translator.from_checkpoint(toy_model).translate(lines)

    port = _free_port()
    server = subprocess.Popen([nmt, "serve", "-m", toy_model, "--port", str(port)], cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, page = time.monotonic() + 120, None
        while page is None and time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as response:
                    page = (response.status, response.read().decode("utf-8"))
            except OSError:
                time.sleep(0.3)
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert page is not None, server.stderr.read()
    shipped = (REPO / "nmt_cli" / "serve" / "page.html").read_text(encoding="utf-8")
    assert page == (200, shipped)
