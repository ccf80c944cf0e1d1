"""`nmt serve`'s requests and answers: a POST /translate body checked and bounded (sentences, characters,
options, decoder work) before it takes memory, and the JSON answer."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from nmt_cli.decode.pipeline import TextTranslator
from nmt_cli.decode.sampling import Sampling
from nmt_cli.errors import NmtError

from .batching import ServeLimits

OPTIONS = {"beam": int, "lenpen": (int, float), "greedy": bool, "max_len_a": (int, float), "max_len_b": int,
           "nbest": int, "alignments": bool, "no_repeat_ngram": int}
SAMPLING = {"sampling": bool, "topk": int, "topp": (int, float), "temperature": (int, float), "seed": int}
DEFAULTS = {"beam": 4, "lenpen": 0.6, "greedy": False, "max_len_a": 1.0, "max_len_b": 50, "nbest": 1,
            "alignments": False, "no_repeat_ngram": 0}
RANGES = {"beam": (1, 64), "nbest": (1, 64), "lenpen": (0, 100), "max_len_a": (0, 100), "max_len_b": (0, 100_000),
          "no_repeat_ngram": (0, 1000), "topk": (0, 1_000_000), "topp": (0, 1), "temperature": (0, 100),
          "seed": (0, 2**63 - 1)}
FLAGS = {"return_scores": bool}  # shape the answer only: requests with other values still share a batch
STEERING = ("prefix", "constraints")  # per sentence: requests with them still share a batch
MAX_CONSTRAINTS = 16  # phrases per sentence


@dataclass(frozen=True)
class ParsedRequest:
    """A valid POST /translate body."""

    sentences: list[str]
    options: tuple  # the search options, sorted (name, value) pairs: requests with equal ones share a batch
    single: bool  # "text" was one string: so is the answer
    return_scores: bool
    prefixes: list[str] | None = None  # per sentence ("" for none)
    constraints: list[list[str]] | None = None  # per sentence


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
    known = [*OPTIONS, *SAMPLING, *STEERING, *FLAGS]
    unknown = sorted(set(payload) - set(known) - {"text"})
    if unknown:
        raise HTTPError(422, f"unknown field(s): {', '.join(unknown)} (known: text, {', '.join(known)})")
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
    if payload.get("sampling") is True and "beam" in payload:
        raise HTTPError(422, "\"sampling\" draws without a beam: drop \"beam\" (\"nbest\" sets the samples)")
    for name, kind in {**OPTIONS, **SAMPLING, **FLAGS}.items():
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
    sampling = None
    if options.pop("sampling", False):
        sampling = Sampling(options.pop("topk", 0), options.pop("topp", 1.0), options.pop("temperature", 1.0),
                            options.pop("seed", 0))
        options["sampling"] = sampling
    elif given := [name for name in ("topk", "topp", "temperature", "seed") if name in options]:
        raise HTTPError(422, f"\"{given[0]}\" shapes what \"sampling\" draws from: add \"sampling\": true")
    prefixes, constraints = steering_fields(payload, text, single, limits.max_chars)
    try:
        TextTranslator.check_options(options["beam"], options["lenpen"], options["max_len_a"],
                                     options["max_len_b"], 1, None, options["greedy"], options["nbest"], sampling,
                                     options["no_repeat_ngram"], constraints is not None)
    except NmtError as e:
        raise HTTPError(422, str(e).replace("--", "").replace("-", "_")) from None
    if options["alignments"] and options["nbest"] > 1:
        raise HTTPError(422, "\"alignments\" are given for the best translation only: drop \"nbest\"")
    if options["alignments"] and not can_align:
        raise HTTPError(422, "\"alignments\" read nmt's own attention: this server runs CTranslate2")
    if sampling is not None:
        options["beam"] = options["nbest"]  # the rows a sentence decodes, for the work bound
    work = decoder_work(text, options, max_positions, prefixes)
    if work > limits.max_work:
        raise HTTPError(413, f"the request may decode {work:,} tokens (sentences x beam x length limit); at most "
                             f"{limits.max_work:,} per request: send fewer or shorter sentences, or a smaller beam")
    if sampling is not None:
        del options["beam"]
    return ParsedRequest(text, tuple(sorted(options.items())), single, return_scores, prefixes, constraints)


def steering_fields(payload: dict, text: list[str], single: bool,
                    max_chars: int) -> tuple[list[str] | None, list[list[str]] | None]:
    """The "prefix" (a string per sentence) and "constraints" (a list of phrases per sentence) of a body, one
    per "text" item (for a single "text" string, one string and one list), each bounded like a sentence."""
    def strings(value: Any, where: str) -> list[str]:
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise HTTPError(422, f"{where} must be a list of strings")
        return value

    prefixes = constraints = None
    if "prefix" in payload:
        value = payload["prefix"]
        prefixes = [value] if single and isinstance(value, str) else strings(value, "\"prefix\"")
    if "constraints" in payload:
        value = payload["constraints"]
        if single:
            constraints = [strings(value, "\"constraints\" (for one \"text\" string)")]
        elif not isinstance(value, list):
            raise HTTPError(422, "\"constraints\" must be a list (one list of phrases per \"text\" item)")
        else:
            constraints = [strings(v, f"\"constraints\"[{i}]") for i, v in enumerate(value)]
    for name, items in (("prefix", prefixes), ("constraints", constraints)):
        if items is not None and len(items) != len(text):
            raise HTTPError(422, f"\"{name}\" has {len(items)} items for {len(text)} sentences: one per sentence")
    for i, sentence_prefix in enumerate(prefixes or []):
        if len(sentence_prefix) > max_chars or "\n" in sentence_prefix or "\r" in sentence_prefix:
            raise HTTPError(413 if len(sentence_prefix) > max_chars else 422,
                            f"prefix[{i}] must be one line of at most {max_chars} characters")
    for i, phrases in enumerate(constraints or []):
        if len(phrases) > MAX_CONSTRAINTS:
            raise HTTPError(413, f"constraints[{i}] has {len(phrases)} phrases; at most {MAX_CONSTRAINTS}")
        for j, phrase in enumerate(phrases):
            if not phrase.strip():
                raise HTTPError(422, f"constraints[{i}][{j}] is empty")
            if len(phrase) > max_chars or "\n" in phrase or "\r" in phrase or "\t" in phrase:
                raise HTTPError(413 if len(phrase) > max_chars else 422,
                                f"constraints[{i}][{j}] must be one phrase of at most {max_chars} characters")
    return prefixes, constraints


def token_bound(sentence: str) -> int:
    """At least as many tokens as any of nmt's tokenizers makes of `sentence`: its UTF-8 bytes, plus one.
    A Moses + BPE token is at most a piece per character; SentencePiece's byte fallback spells a character
    outside its vocabulary (an emoji, a rare CJK character) in one piece per UTF-8 byte, after a word-start
    piece."""
    return len(sentence.encode("utf-8", "surrogatepass")) + 1


def decoder_work(sentences: list[str], options: dict, max_positions: int, prefixes: list[str] | None = None) -> int:
    """An upper bound on the decoder tokens a request can cost: for each sentence, hypotheses (the beam or
    samples, 1 when greedy) x its length limit a x length + b (at least its prefix's), with `token_bound` as
    a length, and no limit beyond the model's positions."""
    hypotheses = 1 if options["greedy"] else options["beam"]
    cap = max_positions - 1
    prefixes = prefixes or [""] * len(sentences)
    return sum(hypotheses * min(max(int(options["max_len_a"] * token_bound(s) + options["max_len_b"]),
                                    token_bound(p) if p else 0) + 1, cap)
               for s, p in zip(sentences, prefixes))


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
