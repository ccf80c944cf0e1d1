"""Split the Tatoeba English-Mandarin pairs (manythings.org's cmn.txt) into train/valid/test, deterministically.

The file is sorted by English length and has no official split, so the pairs are shuffled with a fixed seed:
duplicate pairs are kept once; valid takes the first VALID pairs, test the next TEST pairs that share no
sentence (English or Chinese) with valid; train keeps every other pair that shares no sentence with valid or
test (on either side), so no test or valid sentence is ever seen in training. The attribution column is kept
beside the data (train.attribution etc.), as the licence (CC-BY 2.0 France) asks.

    python recipes/tatoeba_split.py --input cmn.txt.gz --out DIR [--lines N] [--valid 1000 --test 1000]

writes DIR/{train,valid,test}.{en,zh,attribution} and DIR/split.json (counts, seed, the input's SHA-256).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nmt_cli.errors import NmtError  # noqa: E402
from nmt_cli.textio import atomic_path  # noqa: E402

SEED = 1


def read_pairs(path: Path) -> list[tuple[str, str, str]]:
    """(English, Mandarin, attribution) of each line; one-line NmtError naming the line for a malformed one."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise NmtError(f"{path}: no such file") from None
    except OSError as e:  # not gzip
        raise NmtError(f"{path}: cannot read it ({e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise NmtError(f"{path}:{line}: not valid UTF-8") from None
    pairs = []
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split("\t")
        if len(fields) < 2 or not fields[0].strip() or not fields[1].strip():
            raise NmtError(f"{path}:{number}: expected English<TAB>Mandarin<TAB>attribution")
        pairs.append((fields[0].strip(), fields[1].strip(), fields[2].strip() if len(fields) > 2 else ""))
    if not pairs:
        raise NmtError(f"{path}: empty corpus")
    return pairs


def split(pairs: list[tuple[str, str, str]], valid_size: int, test_size: int,
          seed: int = SEED) -> tuple[dict[str, list[tuple[str, str, str]]], dict]:
    """The three splits and a record of what was dropped (see the module's docstring)."""
    unique = list({(en, zh): (en, zh, by) for en, zh, by in pairs}.values())
    random.Random(seed).shuffle(unique)
    held: set[str] = set()  # every sentence, English or Chinese, of valid and test
    splits: dict[str, list[tuple[str, str, str]]] = {"valid": [], "test": [], "train": []}
    dropped = 0
    for pair in unique:
        en, zh, _ = pair
        if len(splits["valid"]) < valid_size:
            name = "valid"
        elif len(splits["test"]) < test_size:
            name = "test"
        else:
            name = "train"
        if en in held or zh in held:
            dropped += 1  # shares a sentence with valid or test (a test pair sharing one with valid included)
            continue
        if name != "train":
            held.update((en, zh))
        splits[name].append(pair)
    record = {"seed": seed, "input_pairs": len(pairs), "duplicate_pairs": len(pairs) - len(unique),
              "dropped_sharing_a_sentence_with_valid_or_test": dropped,
              **{name: len(rows) for name, rows in splits.items()}}
    return splits, record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", type=Path, required=True, help="cmn.txt or cmn.txt.gz")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lines", type=int, default=0, help="use only the first N pairs after shuffling (smoke)")
    parser.add_argument("--valid", type=int, default=1000)
    parser.add_argument("--test", type=int, default=1000)
    args = parser.parse_args()
    try:
        pairs = read_pairs(args.input)
        digest = hashlib.sha256(args.input.read_bytes()).hexdigest()
        if args.lines:
            shuffled = pairs[:]
            random.Random(SEED).shuffle(shuffled)
            pairs = shuffled[: args.lines]
            valid, test = min(args.valid, args.lines // 10), min(args.test, args.lines // 10)
        else:
            valid, test = args.valid, args.test
        splits, record = split(pairs, valid, test)
        if not splits["train"]:
            raise NmtError(f"{args.input}: nothing left to train on ({record})")
    except NmtError as e:
        print(f"tatoeba_split: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        for column, suffix in enumerate(("en", "zh", "attribution")):
            with atomic_path(args.out / f"{name}.{suffix}") as tmp:
                tmp.write_text("".join(row[column] + "\n" for row in rows), encoding="utf-8")
    record.update(input=str(args.input), input_sha256=digest, lines=args.lines or None)
    with atomic_path(args.out / "split.json") as tmp:  # last: its presence says the split is complete
        tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"tatoeba: train {record['train']:,}, valid {record['valid']:,}, test {record['test']:,} pairs "
          f"({record['duplicate_pairs']:,} duplicates, {record['dropped_sharing_a_sentence_with_valid_or_test']:,} "
          "sharing a sentence with valid or test left out)")


if __name__ == "__main__":
    main()
