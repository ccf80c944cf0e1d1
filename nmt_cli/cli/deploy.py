"""`nmt serve` and `nmt export`: a model served over HTTP, or written for another inference engine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .commandline import collect_after_loading, err, handle_errors, run_on_allocator, start_up_done
from .config import ConfigFlag, PrintConfigFlag
from .flags import (
    CpuAllocator,
    CpuAllocatorFlag,
    DeviceFlag,
    Engine,
    EngineFlag,
    InferencePrecisionFlag,
    ModelsFlag,
    Precision,
    ThreadsFlag,
)


@handle_errors
@collect_after_loading
def serve_cmd(
    model: ModelsFlag,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    batch_size: Annotated[int, typer.Option(help="Sentences per search batch, gathered across requests.")] = 64,
    max_tokens: Annotated[Optional[int], typer.Option(
        help="Padded source tokens per search batch (instead of --batch-size).")] = None,
    batch_wait_ms: Annotated[float, typer.Option(help="How long a request waits for others to batch with.")] = 5.0,
    max_queue: Annotated[int, typer.Option(help="Sentences waiting at most; beyond, requests get 503.")] = 1024,
    max_sentences: Annotated[int, typer.Option(help="Sentences per request at most (else 413).")] = 64,
    max_chars: Annotated[int, typer.Option(help="Characters per sentence at most (else 413).")] = 2000,
    max_body_bytes: Annotated[Optional[int], typer.Option(help=(
        "Request body bytes at most, counted while reading (else 413; default: room for --max-sentences x "
        "--max-chars)."))] = None,
    max_work: Annotated[int, typer.Option(help=(
        "Decoder tokens per request at most: sentences x beam x length limit, a sentence counted as no more "
        "tokens than characters (else 413)."))] = 64 * 4 * 1024,
    cache_mb: Annotated[float, typer.Option(help="Decoder cache kept between requests, at most (MB).")] = 256.0,
    api_key_file: Annotated[Optional[Path], typer.Option(help=(
        "API keys, one per line (also NMT_API_KEYS): POST /translate and GET /metrics then need "
        "'Authorization: Bearer <key>' (else 401)."))] = None,
    access_log: Annotated[str, typer.Option(help="One line per request on stderr: plain, json or off.")] = "plain",
    page: Annotated[bool, typer.Option(help=(
        "Answer GET / with a page to try the model in a browser (translation, n-best, scores, alignments)."))] = True,
    shutdown_seconds: Annotated[float, typer.Option(help=(
        "After SIGTERM: stop accepting, answer what is queued for up to this long, exit 0."))] = 30.0,
    device: DeviceFlag = None,
    precision: InferencePrecisionFlag = Precision.fp32,
    threads: ThreadsFlag = 0,
    engine: EngineFlag = Engine.auto,
    cpu_allocator: CpuAllocatorFlag = CpuAllocator.auto,
    config: ConfigFlag = None,
    print_config: PrintConfigFlag = False,
) -> None:
    """Serve translations over HTTP: POST /translate {"text": [...], "beam": 4}, a page to try them at GET /,
    GET /health, GET /info, GET /metrics."""
    run_on_allocator(cpu_allocator.value, device.value if device else None)  # may run this command again
    from nmt_cli.serve.app import serve_model
    from nmt_cli.serve.batching import ServeLimits

    limits = ServeLimits(batch_size, max_tokens, batch_wait_ms, max_queue, max_sentences, max_chars, max_body_bytes,
                         max_work, cache_mb, shutdown_seconds=shutdown_seconds)
    serve_model(model, host, port, limits, device.value if device else None, precision.value, threads,
                engine.value, api_key_file, access_log, err, on_loaded=start_up_done, page=page)


@handle_errors
def export_ctranslate2_cmd(
    model: Annotated[Path, typer.Option("--model", "-m", help="nmt checkpoint (e.g. an averaged model.pt).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Model folder to write.")],
    quantization: Annotated[str, typer.Option(metavar="<fp32|bf16|fp16|int8|int8_fp32|int8_bf16|int8_fp16>", help=(
        "Weight type, named as --precision names them (CTranslate2's own names work too: float32, int8_float16, "
        "...)."))] = "fp32",
    force: Annotated[bool, typer.Option(
        help="Replace a CTranslate2 export nmt made at --output (nothing else).")] = False,
) -> None:
    """Write a CTranslate2 model folder (weights, vocabulary, BPE codes, tokenizer settings) that
    `nmt translate -m DIR` and `nmt serve -m DIR` run without PyTorch."""
    from nmt_cli.export.ct2 import export_ctranslate2, quantization_name

    export_ctranslate2(model, output, quantization, force)
    err.print(f"exported {model} to {output} ({quantization_name(quantization)})", markup=False, highlight=False)


@handle_errors
def import_transformers_cmd(
    folder: Annotated[str, typer.Argument(
        metavar="DIR", help="MarianMT (OPUS-MT) or FSMT (fairseq WMT19) folder, or a Hugging Face hub id to "
        "download first (needs huggingface_hub and the network).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="nmt model file to write.")] = Path("model.pt"),
    target_token: Annotated[Optional[str], typer.Option(
        help="Token that begins every source line for a model with several target languages (OPUS-MT's "
        "'>>fra<<'); stored in the model, so translate and serve add it.")] = None,
    source_lang: Annotated[Optional[str], typer.Option(
        "--source-lang", "-s", help="Source language, where the folder's files name none.")] = None,
    target_lang: Annotated[Optional[str], typer.Option(
        "--target-lang", "-t", help="Target language, where the folder's files name none.")] = None,
) -> None:
    """Read a Transformers translation model into one nmt model file, to translate, fine-tune (prepare
    --from-model, train --init-from), average and export again."""
    from nmt_cli.export.hf_import import import_transformers, local_folder

    summary = import_transformers(local_folder(folder), output, target_token, source_lang, target_lang)
    embeddings = ("one embedding matrix" if summary["shared_embeddings"] and summary["tied_output"] else
                  "source and target embeddings" + (", an output projection" if not summary["tied_output"] else ""))
    err.print(f"imported {folder} ({summary['kind']}: {summary['layers']} + {summary['layers']} layers, d_model "
              f"{summary['d_model']}, {summary['activation']}, vocabulary {summary['vocab']:,}"
              + (f" / {summary['target_vocab']:,}" if summary["target_vocab"] != summary["vocab"] else "")
              + f", {embeddings}, {summary['parameters']:,} parameters) into {output}", markup=False,
              highlight=False)


@handle_errors
def export_transformers_cmd(
    model: Annotated[Path, typer.Option("--model", "-m", help="nmt checkpoint (e.g. an averaged model.pt).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Model folder to write.")],
    force: Annotated[bool, typer.Option(
        help="Replace a Transformers export nmt made at --output (nothing else).")] = False,
) -> None:
    """Write a Hugging Face Transformers folder that AutoModelForSeq2SeqLM and AutoTokenizer load, with a model
    card: a Marian model for --tokenizer sentencepiece models, an FSMT model for Moses + BPE ones."""
    from nmt_cli.export.hf import export_transformers

    export_transformers(model, output, force)
    err.print(f"exported {model} to {output}", markup=False, highlight=False)
