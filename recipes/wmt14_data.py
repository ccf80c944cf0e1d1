"""WMT14 raw data for `make wmt14-base` / `wmt14-big` (en-de) and `wmt14-en-fr-base` / `-big` (en-fr), as fairseq's
prepare-wmt14en2de.sh and prepare-wmt14en2fr.sh gather it.

    python recipes/wmt14_data.py --out RAW [--pair en-de|en-fr] [--archives DIR] [--test-data DIR] [--test-lines 3003]

en-de: Europarl v7, Common Crawl and News Commentary v9 (about 4.5M pairs); en-fr: Europarl v7, Common Crawl, UN,
News Commentary v9 and the 10^9 French-English corpus (giga-fren, gzipped inside its tar; about 36M pairs), read
straight from the statmt.org archives (from --archives, or downloaded into RAW/orig). Valid is newstest2013, test
the full newstest2014 (3003 segments, SGML in test-full.tgz), or both from --test-data as plain text. Writes each
corpus apart (RAW/train-CORPUS.{en,xx}), RAW/{valid,test}.{en,xx} and RAW/.done last; every file goes to a
temporary name first. Bad input (a missing archive or member, a test set of the wrong size) is one line on stderr
and exit code 2.
"""

from __future__ import annotations

import argparse
import gzip
import html
import os
import re
import shutil
import socket
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

# The two halves of the paper's Table 2, as fairseq's prepare-wmt14en2de.sh and prepare-wmt14en2fr.sh gather them.
# Per pair: archive -> URL; archive -> the training corpus's member prefix (members PREFIX.en, PREFIX.xx; ".gz"
# where the archive holds them gzipped) and its name under RAW; dev; test (SGML in test-full.tgz).
PAIRS = {
    "en-de": {
        "archives": {
            "training-parallel-europarl-v7.tgz": "http://statmt.org/wmt13/training-parallel-europarl-v7.tgz",
            "training-parallel-commoncrawl.tgz": "http://statmt.org/wmt13/training-parallel-commoncrawl.tgz",
            "training-parallel-nc-v9.tgz": "http://statmt.org/wmt14/training-parallel-nc-v9.tgz",
            "dev.tgz": "http://statmt.org/wmt14/dev.tgz",
            "test-full.tgz": "http://statmt.org/wmt14/test-full.tgz"},
        "train": {
            "training-parallel-europarl-v7.tgz": ("training/europarl-v7.de-en", "", "train-europarl"),
            "training-parallel-commoncrawl.tgz": ("commoncrawl.de-en", "", "train-commoncrawl"),
            "training-parallel-nc-v9.tgz": ("training/news-commentary-v9.de-en", "", "train-news-commentary")},
        "valid": ("dev.tgz", "dev/newstest2013"),
        "test": {"en": "test-full/newstest2014-deen-src.en.sgm", "de": "test-full/newstest2014-deen-ref.de.sgm"},
    },
    "en-fr": {
        "archives": {
            "training-parallel-europarl-v7.tgz": "http://statmt.org/wmt13/training-parallel-europarl-v7.tgz",
            "training-parallel-commoncrawl.tgz": "http://statmt.org/wmt13/training-parallel-commoncrawl.tgz",
            "training-parallel-un.tgz": "http://statmt.org/wmt13/training-parallel-un.tgz",
            "training-parallel-nc-v9.tgz": "http://statmt.org/wmt14/training-parallel-nc-v9.tgz",
            "training-giga-fren.tar": "http://statmt.org/wmt10/training-giga-fren.tar",
            "dev.tgz": "http://statmt.org/wmt14/dev.tgz",
            "test-full.tgz": "http://statmt.org/wmt14/test-full.tgz"},
        "train": {
            "training-parallel-europarl-v7.tgz": ("training/europarl-v7.fr-en", "", "train-europarl"),
            "training-parallel-commoncrawl.tgz": ("commoncrawl.fr-en", "", "train-commoncrawl"),
            "training-parallel-un.tgz": ("un/undoc.2000.fr-en", "", "train-un"),
            "training-parallel-nc-v9.tgz": ("training/news-commentary-v9.fr-en", "", "train-news-commentary"),
            "training-giga-fren.tar": ("giga-fren.release2.fixed", ".gz", "train-giga-fren")},
        "valid": ("dev.tgz", "dev/newstest2013"),
        "test": {"en": "test-full/newstest2014-fren-src.en.sgm", "fr": "test-full/newstest2014-fren-ref.fr.sgm"},
    },
}
# en-de's tables under their earlier names
ARCHIVES = PAIRS["en-de"]["archives"]
TRAIN_MEMBERS = {archive: prefix for archive, (prefix, _, _) in PAIRS["en-de"]["train"].items()}
VALID_MEMBER = PAIRS["en-de"]["valid"]
TEST_MEMBERS = PAIRS["en-de"]["test"]
SEGMENT = re.compile(r"<seg[^>]*>(.*)</seg>")


class DataError(Exception):
    """Bad input: reported as one line, exit code 2."""


def fetch_archives(archives: Path | None, orig: Path, wanted: dict[str, str] = ARCHIVES) -> dict[str, Path]:
    """The pair's archives (`wanted`: name -> URL): from `archives` (each must be there) or downloaded into `orig`
    (temp name, then rename)."""
    found = {}
    for name, url in wanted.items():
        if archives is not None:
            path = archives / name
            if not path.is_file():
                raise DataError(f"{path}: no such file (WMT14_DATA must hold {', '.join(wanted)})")
        else:
            path = orig / name
            if not path.is_file():
                orig.mkdir(parents=True, exist_ok=True)
                print(f"downloading {url}", file=sys.stderr)
                # host and pid in the name: two nodes (or two runs) never write the same temporary file
                tmp = path.with_name(f".{name}.{os.getpid()}@{socket.gethostname()}.tmp")
                try:
                    with urllib.request.urlopen(url) as response, open(tmp, "wb") as f:
                        shutil.copyfileobj(response, f, 1 << 20)
                except OSError as e:
                    tmp.unlink(missing_ok=True)
                    raise DataError(f"{url}: download failed ({e}); put the archives in a folder and set "
                                    "WMT14_DATA") from None
                os.replace(tmp, path)
        found[name] = path
    return found


def _open_member(archive: tarfile.TarFile, path: Path, member: str):
    """A member `_members` has checked is there, read decompressed where it is gzipped (giga-fren's); a directory
    or link under that name is refused."""
    f = archive.extractfile(member)
    if f is None:
        raise DataError(f"{path}: {member} is not a regular file")
    return gzip.GzipFile(fileobj=f) if member.endswith(".gz") else f


def _members(path: Path, names: list[str]):
    """Open `path` and check that it holds every member in `names`."""
    try:
        archive = tarfile.open(path, "r:*")
        present = set(archive.getnames())
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"{path}: not a readable .tgz archive ({e})") from None
    for name in names:
        if name not in present:
            archive.close()
            raise DataError(f"{path}: no member {name}")
    return archive


def _write(path: Path, chunks) -> int:
    """Write byte lines to `path` through a temporary file; return the line count."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    lines = 0
    try:
        with os.fdopen(fd, "wb") as f:
            for line in chunks:
                f.write(line if line.endswith(b"\n") else line + b"\n")
                lines += 1
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lines


def write_train(found: dict[str, Path], out: Path, pair: str = "en-de") -> None:
    """out/train-CORPUS.{en,xx}: each corpus of the pair apart, checked for equal line counts per side."""
    langs = pair.split("-")
    corpora = PAIRS[pair]["train"]
    opened = {name: _members(found[name], [f"{prefix}.{lang}{gz}" for lang in langs])
              for name, (prefix, gz, _) in corpora.items()}
    try:
        for name, (prefix, gz, corpus) in corpora.items():
            try:
                counts = {lang: _write(out / f"{corpus}.{lang}", _open_member(opened[name], found[name],
                                                                               f"{prefix}.{lang}{gz}"))
                          for lang in langs}
            except (OSError, EOFError) as e:  # a gzipped member that is not gzip
                raise DataError(f"{found[name]}: {prefix}.*{gz} cannot be read ({e})") from None
            if counts[langs[0]] != counts[langs[1]]:
                raise DataError(f"{found[name]}: {prefix}.{langs[0]}{gz} has {counts[langs[0]]} lines but "
                                f"{prefix}.{langs[1]}{gz} has {counts[langs[1]]}")
    finally:
        for archive in opened.values():
            archive.close()


def sgm_segments(data: bytes, where: str) -> list[bytes]:
    """The text of each <seg> of an SGML test set, entities unescaped, one line each."""
    out = []
    for number, raw in enumerate(data.decode("utf-8", errors="strict").splitlines(), start=1):
        if "<seg" in raw:
            match = SEGMENT.search(raw)
            if match is None:
                raise DataError(f"{where}:{number}: a <seg> without its </seg>")
            out.append(html.unescape(match.group(1)).strip().encode("utf-8"))
    return out


def write_eval(found: dict[str, Path] | None, test_data: Path | None, out: Path, test_lines: int,
               pair: str = "en-de") -> None:
    """out/valid.{en,xx} (newstest2013) and out/test.{en,xx} (newstest2014), checked to have `test_lines` lines."""
    tables = PAIRS[pair]
    for lang in pair.split("-"):
        if test_data is not None:
            for split, name in (("valid", "newstest2013"), ("test", "newstest2014")):
                src = test_data / f"{name}.{lang}"
                if not src.is_file():
                    sides = pair.replace("-", ",")
                    raise DataError(f"{src}: no such file (TEST_DATA must hold newstest2013/2014.{{{sides}}})")
                _write(out / f"{split}.{lang}", src.read_bytes().splitlines())
        else:
            assert found is not None
            name, prefix = tables["valid"]
            with _members(found[name], [f"{prefix}.{lang}"]) as archive:
                valid = _open_member(archive, found[name], f"{prefix}.{lang}").read()
                _write(out / f"valid.{lang}", valid.splitlines())
            member = tables["test"][lang]
            with _members(found["test-full.tgz"], [member]) as archive:
                data = _open_member(archive, found["test-full.tgz"], member).read()
            _write(out / f"test.{lang}", sgm_segments(data, f"{found['test-full.tgz']}:{member}"))
        lines = sum(1 for _ in open(out / f"test.{lang}", "rb"))
        if lines != test_lines:
            where = (test_data / f"newstest2014.{lang}" if test_data
                     else f"{found['test-full.tgz']}:{tables['test'][lang]}")
            (out / f"test.{lang}").unlink()
            raise DataError(f"{where}: newstest2014 has {lines} segments, expected {test_lines}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for train/valid/test.{en,de}")
    parser.add_argument("--archives", type=Path, help="folder holding the five .tgz files (else download)")
    parser.add_argument("--test-data", type=Path, help="folder with plain newstest2013/2014.{en,de}")
    parser.add_argument("--test-lines", type=int, default=3003, help="segments newstest2014 must have")
    parser.add_argument("--pair", choices=sorted(PAIRS), default="en-de", help="the language pair")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / ".done").unlink(missing_ok=True)
    try:
        found = fetch_archives(args.archives or None, args.out / "orig", PAIRS[args.pair]["archives"])
        write_train(found, args.out, args.pair)
        write_eval(found, args.test_data or None, args.out, args.test_lines, args.pair)
    except DataError as e:
        print(f"wmt14 data: error: {e}", file=sys.stderr)
        return 2
    (args.out / ".done").touch()
    corpora = ",".join(c for _, _, c in PAIRS[args.pair]["train"].values())
    print(f"wmt14 data: wrote {args.out}/{{{corpora},valid,test}}.{{{args.pair.replace('-', ',')}}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
