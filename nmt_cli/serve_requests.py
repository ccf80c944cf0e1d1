"""`nmt serve`'s requests and answers: a POST /translate body checked and bounded (sentences, characters,
options, decoder work) before it takes memory, and the JSON answer."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from .errors import NmtError
from .pipeline import TextTranslator
from .serve_batching import ServeLimits

OPTIONS = {"beam": int, "lenpen": (int, float), "greedy": bool, "max_len_a": (int, float), "max_len_b": int,
           "nbest": int, "alignments": bool}
DEFAULTS = {"beam": 4, "lenpen": 0.6, "greedy": False, "max_len_a": 1.0, "max_len_b": 50, "nbest": 1,
            "alignments": False}
RANGES = {"beam": (1, 64), "nbest": (1, 64), "lenpen": (0, 100), "max_len_a": (0, 100), "max_len_b": (0, 100_000)}
FLAGS = {"return_scores": bool}  # shape the answer only: requests with other values still share a batch


@dataclass(frozen=True)
class ParsedRequest:
    """A valid POST /translate body."""

    sentences: list[str]
    options: tuple  # the search options, sorted (name, value) pairs: requests with equal ones share a batch
    single: bool  # "text" was one string: so is the answer
    return_scores: bool


def parse_request(body: bytes, limits: ServeLimits, max_positions: int = 1024,
                  can_align: bool = True, defaults: dict | None = None) -> ParsedRequest:
    """The sentences and search options of a POST /translate body; HTTPError on anything else. `can_align`:
    whether the engine can give word alignments; `defaults`: options a request does not give (DEFAULTS, with
    the model file's own beam and length penalty)."""
    try:
        payload = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise HTTPError(400, f"the body is not UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise HTTPError(400, f"the body is not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise HTTPError(400, "the body is not a request: JSON nested too deeply") from None
    if not isinstance(payload, dict):
        raise HTTPError(422, "the body must be a JSON object with a \"text\" list")
    unknown = sorted(set(payload) - set(OPTIONS) - set(FLAGS) - {"text"})
    if unknown:
        raise HTTPError(422, f"unknown field(s): {', '.join(unknown)} (known: text, {', '.join([*OPTIONS, *FLAGS])})")
    text = payload.get("text")
    single = isinstance(text, str)
    if single:
        text = [text]
    if not isinstance(text, list) or not all(isinstance(s, str) for s in text):
        raise HTTPError(422, "\"text\" must be a string or a list of strings")
    if not text:
        raise HTTPError(422, "\"text\" is empty")
    if len(text) > limits.max_sentences:
        raise HTTPError(413, f"{len(text)} sentences; at most {limits.max_sentences} per request")
    for i, sentence in enumerate(text):
        if len(sentence) > limits.max_chars:
            raise HTTPError(413, f"text[{i}] has {len(sentence)} characters; at most {limits.max_chars}")
        if "\n" in sentence or "\r" in sentence:
            raise HTTPError(422, f"text[{i}] holds a line break; send one sentence per list item")
    options = dict(defaults or DEFAULTS)
    for name, kind in {**OPTIONS, **FLAGS}.items():
        if name in payload:
            value = payload[name]
            if isinstance(value, bool) and kind is not bool:
                raise HTTPError(422, f"\"{name}\" must be a number")
            if not isinstance(value, kind):
                raise HTTPError(422, f"\"{name}\" must be {'true or false' if kind is bool else 'a number'}")
            if isinstance(value, float) and not math.isfinite(value):
                raise HTTPError(422, f"\"{name}\" must be a finite number (got {value})")
            low, high = RANGES.get(name, (None, None))
            if low is not None and not low <= value <= high:
                raise HTTPError(422, f"\"{name}\" must be between {low} and {high:,} (got {value})")
            options[name] = value
    return_scores = bool(options.pop("return_scores", False))
    try:
        TextTranslator.check_options(options["beam"], options["lenpen"], options["max_len_a"],
                                     options["max_len_b"], 1, None, options["greedy"], options["nbest"])
    except NmtError as e:
        raise HTTPError(422, str(e).replace("--", "").replace("-", "_")) from None
    if options["alignments"] and options["nbest"] > 1:
        raise HTTPError(422, "\"alignments\" are given for the best translation only: drop \"nbest\"")
    if options["alignments"] and not can_align:
        raise HTTPError(422, "\"alignments\" read nmt's own attention: this server runs CTranslate2")
    work = decoder_work(text, options, max_positions)
    if work > limits.max_work:
        raise HTTPError(413, f"the request may decode {work:,} tokens (sentences x beam x length limit); at most "
                             f"{limits.max_work:,} per request: send fewer or shorter sentences, or a smaller beam")
    return ParsedRequest(text, tuple(sorted(options.items())), single, return_scores)


def token_bound(sentence: str) -> int:
    """At least as many tokens as any of nmt's tokenizers makes of `sentence`: its UTF-8 bytes, plus one.
    A Moses + BPE token is at most a piece per character; SentencePiece's byte fallback spells a character
    outside its vocabulary (an emoji, a rare CJK character) in one piece per UTF-8 byte, after a word-start
    piece."""
    return len(sentence.encode("utf-8", "surrogatepass")) + 1


def decoder_work(sentences: list[str], options: dict, max_positions: int) -> int:
    """An upper bound on the decoder tokens a request can cost: for each sentence, hypotheses (the beam, 1 when
    greedy) x its length limit a x length + b, with `token_bound` as its length, and no limit beyond the
    model's positions."""
    hypotheses = 1 if options["greedy"] else options["beam"]
    cap = max_positions - 1
    return sum(hypotheses * min(int(options["max_len_a"] * token_bound(s) + options["max_len_b"]) + 1, cap)
               for s in sentences)


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def answer(results: list[list[tuple[str, float]]], request: ParsedRequest, nbest: int, warnings: list[str],
           alignments: list[str] | None = None) -> dict:
    """The response body: the translations (a list, or one string for a single "text" string; n-best lists
    when nbest > 1), their scores and word alignments ("i-j ..." strings) on request, and the request's
    warnings."""
    def shape(items: list) -> Any:
        return items[0] if request.single else items

    if nbest == 1:
        body: dict[str, Any] = {"translations": shape([r[0][0] for r in results])}
        scores = shape([r[0][1] for r in results])
    else:
        body = {"translations": shape([[text for text, _ in r] for r in results])}
        scores = shape([[score for _, score in r] for r in results])
    if request.return_scores:
        body["scores"] = scores
    if alignments is not None:
        body["alignments"] = shape(alignments)
    if warnings:
        body["warnings"] = warnings
    return body


async def read_body(request: Any, limit: int) -> bytes:
    """The request body, read chunk by chunk and refused (413) once it passes `limit` bytes: a declared
    Content-Length over it is refused before reading, a chunked upload as soon as it grows past it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPError(413, f"the body has {int(declared):,} bytes; at most {limit:,}")
    from starlette.requests import ClientDisconnect

    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, f"the body passed {limit:,} bytes; at most {limit:,}")
            chunks.append(chunk)
    except ClientDisconnect:  # gone before its body arrived: nobody to answer, nothing to log as an error
        raise HTTPError(499, "client closed the request") from None
    return b"".join(chunks)
