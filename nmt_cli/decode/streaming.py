"""`nmt translate`'s line handling around any engine: a file in one pass with a progress bar, or stdin as lines
arrive; n-best lines, word alignments beside the output or in their own file, warnings naming the input line."""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

from rich.console import Console

from nmt_cli.errors import NmtError
from nmt_cli.textio import atomic_path, read_lines, stdin_lines

from .pipeline import TextTranslator
from .sampling import Sampling


def stdin_batches(max_lines: int) -> Iterator[list[tuple[int, str]]]:
    """(line number, line) from stdin in batches: wait for one line, then take whatever else has already
    arrived, up to `max_lines` (a reader thread keeps reading while a batch is translated)."""
    q: queue.Queue = queue.Queue(maxsize=4 * max_lines)
    done = object()

    def reader() -> None:
        try:
            for item in enumerate(stdin_lines(), start=1):
                q.put(item)
        except NmtError as e:
            q.put(e)
        finally:
            q.put(done)

    threading.Thread(target=reader, daemon=True).start()
    finished = False
    while not finished:
        batch = []
        item = q.get()
        while True:
            if item is done:
                finished = True
                break
            if isinstance(item, NmtError):
                if batch:
                    yield batch
                raise item
            batch.append(item)
            if len(batch) >= max_lines:
                break
            try:
                item = q.get_nowait()
            except queue.Empty:
                break
        if batch:
            yield batch


def check_alignment_request(nbest: int, alignments: bool, alignments_out: Path | None) -> None:
    """One line for alignment flags that cannot go together, before anything is loaded."""
    if (alignments or alignments_out is not None) and nbest > 1:
        raise NmtError("--alignments prints one translation per line: drop --nbest")
    if alignments and alignments_out is not None:
        raise NmtError("--alignments appends them to each line, --alignments-out writes them apart: choose one")


def sampling_of(sampling: bool, beam: int | None, topk: int | None, topp: float | None,
                temperature: float | None, seed: int | None) -> Sampling | None:
    """translate's sampling flags as one `Sampling` (None without --sampling); one line for flags that do not
    go together."""
    given = [flag for flag, value in (("--topk", topk), ("--topp", topp), ("--temperature", temperature),
                                      ("--seed", seed)) if value is not None]
    if not sampling:
        if given:
            raise NmtError(f"{given[0]} shapes what --sampling draws from: add --sampling")
        return None
    if beam is not None:
        raise NmtError("--sampling draws without a beam: drop --beam (--nbest sets the samples per line)")
    draws = Sampling(topk=topk or 0, topp=1.0 if topp is None else topp,
                     temperature=1.0 if temperature is None else temperature, seed=seed or 0)
    draws.check()
    return draws


def read_steering(input: Path | None, prefix: Path | None, constraints: Path | None) -> dict:
    """translate's `prefixes` and `constraints` options from their files (one line per input line;
    constraints tab-separated), checked against --input's line count."""
    steering: dict = {}
    if prefix is None and constraints is None:
        return steering
    if input is None:
        raise NmtError(f"{'--prefix' if prefix is not None else '--constraints'} pairs its lines with the input's: "
                       "give --input FILE")
    count = len(read_lines(input))
    for flag, path in (("prefixes", prefix), ("constraints", constraints)):
        if path is None:
            continue
        lines = read_lines(path)
        if len(lines) != count:
            raise NmtError(f"{path}: {len(lines):,} lines, but {input} has {count:,}: give one line per input line "
                           "(an empty one for none)")
        steering[flag] = lines if flag == "prefixes" else [line.split("\t") if line.strip() else [] for line in lines]
    steering["where"] = (str(prefix), str(constraints))
    return steering


def translate_lines(translator: TextTranslator, options: dict, input: Path | None, output: Path | None,
                    console: Console, alignments: bool = False, alignments_out: Path | None = None,
                    alignment_layer: int | None = None, quiet: bool = False) -> None:
    """Translate `input` (a file; None: stdin, batch by batch as lines arrive) to `output` (None: stdout),
    searching with `options` (beam, lenpen, nbest, ... as `translate_nbest` takes them). Files are written under
    a temporary name and renamed when complete."""
    nbest = options.get("nbest", 1)
    aligning = alignments or alignments_out is not None
    if aligning:
        if not hasattr(translator, "align"):
            raise NmtError("--alignments reads nmt's own attention: give the checkpoint (.pt), not an exported "
                           "folder or --engine ctranslate2")
        translator.alignment_layer(alignment_layer)  # a layer out of range: one line before any work
    aligned: list[str] = []  # alignment lines (--alignments-out)

    def translate(lines: list[str], **kwargs) -> list[list[tuple[str, float]]]:
        if not aligning:
            return translator.translate_nbest(lines, **kwargs, **options)
        from nmt_cli.model.attention import (
            format_alignments,  # torch: only when aligning (an exported model runs without it)
        )

        ids: list = []
        results = translator.translate_nbest(lines, ids_out=ids, **kwargs, **options)
        pairs = translator.align(lines, [r[0][0] for r in results], ids, alignment_layer)
        if alignments_out is not None:
            aligned.extend(format_alignments(p) for p in pairs)
            return results
        return [[(f"{r[0][0]}\t{format_alignments(p)}", r[0][1])] for r, p in zip(results, pairs)]

    def flush_warnings() -> None:
        for w in translator.warnings:
            console.print(f"nmt translate: warning: {input or '<stdin>'}:{w.removeprefix('line ')}", markup=False,
                          highlight=False)
        translator.warnings.clear()
        translator.truncated.clear()

    def format_results(results, first_line: int) -> list[str]:
        if nbest == 1:
            return [r[0][0] for r in results]
        return [f"{first_line + k}\t{score:.4f}\t{hyp}" for k, r in enumerate(results) for hyp, score in r]

    if input is not None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        lines = read_lines(input)
        with Progress(TextColumn("translate"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                      console=console, disable=quiet or output is None or not console.is_terminal) as progress:
            task = progress.add_task("translate", total=len(lines), rate="")

            def advance(n: int) -> None:
                progress.advance(task, n)
                t = progress.tasks[0]
                if t.elapsed:
                    progress.update(task, rate=f"{t.completed / t.elapsed:.1f} sent/s")

            results = translate(lines, on_batch=advance)
        flush_warnings()
        out_lines = format_results(results, 1)
        if output is None:
            sys.stdout.write("".join(line + "\n" for line in out_lines))
        else:
            with atomic_path(output) as tmp:
                tmp.write_text("".join(line + "\n" for line in out_lines), encoding="utf-8")
    else:
        with atomic_path(output) if output else nullcontext() as tmp:
            sink = open(tmp, "w", encoding="utf-8") if tmp else sys.stdout
            try:
                # What has arrived, up to 4 batches per worker: sorted by length into batches and searched
                # `workers` at a time, as a file is (piped text ~1.4x faster than batch by batch in arrival order).
                for batch in stdin_batches(options.get("batch_size", 64) * translator.workers * 4):
                    results = translate([t for _, t in batch], first_line=batch[0][0])
                    flush_warnings()
                    sink.write("".join(line + "\n" for line in format_results(results, batch[0][0])))
                    sink.flush()
            finally:
                if tmp:
                    sink.close()
    if alignments_out is not None:
        with atomic_path(alignments_out) as tmp:
            tmp.write_text("".join(line + "\n" for line in aligned), encoding="utf-8")
