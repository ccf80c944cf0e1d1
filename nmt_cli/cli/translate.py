"""`nmt translate`, `score` and `attention`: a model run on text, its output scored, its attention drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from nmt_cli.errors import NmtError

from .commandline import collect_after_loading, err, handle_errors, run_on_allocator, start_up_done
from .config import ConfigFlag, PrintConfigFlag
from .flags import (
    P_DEVICE,
    P_IO,
    P_SEARCH,
    P_STEER,
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
def translate_cmd(
    model: ModelsFlag,
    input: Annotated[Optional[Path], typer.Option(
        "--input", "-i", rich_help_panel=P_IO, help="Raw text (default stdin).")] = None,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", rich_help_panel=P_IO, help="Output file (default stdout).")] = None,
    beam: Annotated[Optional[int], typer.Option(rich_help_panel=P_SEARCH, help=(
        "Beam size (default: the model file's, else 4)."), show_default=False)] = None,
    lenpen: Annotated[Optional[float], typer.Option(rich_help_panel=P_SEARCH, help=(
        "GNMT length penalty alpha (default: the model file's, else 0.6)."), show_default=False)] = None,
    max_len_a: Annotated[float, typer.Option(
        rich_help_panel=P_SEARCH, help="Max output length = a * source length + b.")] = 1.0,
    max_len_b: Annotated[int, typer.Option(rich_help_panel=P_SEARCH, help="See --max-len-a.")] = 50,
    batch_size: Annotated[int, typer.Option(rich_help_panel=P_DEVICE, help="Sentences per batch.")] = 64,
    max_tokens: Annotated[Optional[int], typer.Option(
        rich_help_panel=P_DEVICE, help="Source tokens per batch (instead of --batch-size).")] = None,
    nbest: Annotated[int, typer.Option(
        rich_help_panel=P_SEARCH, help=(
            "Hypotheses per input; >1 prints LINE<TAB>SCORE<TAB>TEXT lines. SCORE is the log-probability divided by "
            "the engine's length penalty: GNMT's ((5+|Y|)/6)^lenpen for a checkpoint, |Y|^lenpen for an exported "
            "folder (CTranslate2), so the two rank alike but print different numbers."))] = 1,
    greedy: Annotated[bool, typer.Option(
        rich_help_panel=P_SEARCH, help="Greedy decoding (no beam machinery).")] = False,
    device: DeviceFlag = None,
    precision: InferencePrecisionFlag = Precision.fp32,
    threads: ThreadsFlag = 0,
    parallel_batches: Annotated[int, typer.Option(rich_help_panel=P_DEVICE, help=(
        "Batches translated at once, each on its share of the threads (0: 2 on a CPU with 2+ threads, "
        "else 1)."))] = 0,
    engine: EngineFlag = Engine.auto,
    cpu_allocator: CpuAllocatorFlag = CpuAllocator.auto,
    alignments: Annotated[bool, typer.Option(rich_help_panel=P_IO, help=(
        "Append TAB and source-target word alignments (i-j over whitespace-separated words; characters for "
        "Chinese, Japanese, Thai; from the encoder-decoder attention: approximate) to each line."))] = False,
    alignments_out: Annotated[Optional[Path], typer.Option(rich_help_panel=P_IO, help=(
        "Write the alignments to this file instead, one line per input line."))] = None,
    alignment_layer: Annotated[Optional[int], typer.Option(rich_help_panel=P_SEARCH, help=(
        "Decoder layer whose encoder-decoder attention gives the alignments (1-based; default: the second to "
        "last, or the last of 1-2 layers)."))] = None,
    quiet: Annotated[bool, typer.Option(rich_help_panel=P_IO, help="No progress bar.")] = False,
    sampling: Annotated[bool, typer.Option(rich_help_panel=P_STEER, help=(
        "Draw each token from the model's distribution instead of searching (back-translation); --nbest N "
        "draws N outputs per line."))] = False,
    topk: Annotated[Optional[int], typer.Option(rich_help_panel=P_STEER, help=(
        "Sample from the K most probable tokens only (default 0: all)."), show_default=False)] = None,
    topp: Annotated[Optional[float], typer.Option(rich_help_panel=P_STEER, help=(
        "Sample from the smallest set of tokens whose probability reaches P, in (0, 1] (default 1: all)."),
        show_default=False)] = None,
    temperature: Annotated[Optional[float], typer.Option(rich_help_panel=P_STEER, help=(
        "Divide the log-probabilities by T before sampling: below 1 sharper, above flatter (default 1)."),
        show_default=False)] = None,
    seed: Annotated[Optional[int], typer.Option(rich_help_panel=P_STEER, help=(
        "Seed of the draws (default 0; nmt train's --seed, default 1, seeds training, not these draws): a line "
        "samples alike alone or in any batch (nmt's engine; CTranslate2's draws do not repeat)."),
        show_default=False)] = None,
    no_repeat_ngram: Annotated[int, typer.Option(rich_help_panel=P_STEER, help=(
        "No N-gram of output tokens twice in an output (0: off)."))] = 0,
    prefix: Annotated[Optional[Path], typer.Option(rich_help_panel=P_STEER, help=(
        "Raw target text each output starts with, one line per input line (empty: none); needs --input."))] = None,
    constraints: Annotated[Optional[Path], typer.Option(rich_help_panel=P_STEER, help=(
        "Target phrases each output must contain, tab-separated, one line per input line (empty: none); beam "
        "search with nmt's engine; needs --input."))] = None,
    config: ConfigFlag = None,
    print_config: PrintConfigFlag = False,
) -> None:
    """Translate raw text; output is detokenized, one line per input line, in input order."""
    run_on_allocator(cpu_allocator.value, device.value if device else None)  # may run this command again
    from nmt_cli.decode.pipeline import TextTranslator
    from nmt_cli.decode.streaming import check_alignment_request, read_steering, sampling_of, translate_lines
    from nmt_cli.export.engines import load_translator

    if parallel_batches < 0:
        raise NmtError(f"--parallel-batches must be 0 (automatic) or more (got {parallel_batches})")
    check_alignment_request(nbest, alignments, alignments_out)
    draws = sampling_of(sampling, beam, topk, topp, temperature, seed)
    steering = read_steering(input, prefix, constraints)
    options = dict(max_len_a=max_len_a, max_len_b=max_len_b, batch_size=batch_size, max_tokens=max_tokens,
                   greedy=greedy, nbest=nbest)
    extras = dict(sampling=draws, no_repeat_ngram=no_repeat_ngram)
    # before anything is loaded or printed (the model's own beam is checked against --nbest once it is loaded)
    TextTranslator.check_options(beam or max(4, nbest), 0.6 if lenpen is None else lenpen, **options, **extras,
                                 constraints=constraints is not None)
    translator = load_translator(model, device=device.value if device else None, precision=precision.value,
                                 threads=threads, engine=engine.value, workers=parallel_batches)
    if constraints is not None and translator.constraints_refusal:
        raise NmtError(translator.constraints_refusal)
    options["beam"], options["lenpen"] = translator.search_settings(beam, lenpen)
    TextTranslator.check_options(**options, **extras)
    if draws is not None:
        del options["beam"]
    elif not greedy and (note := translator.settings_note(beam, lenpen)) is not None:
        err.print(f"nmt translate: {note}", markup=False, highlight=False)
    start_up_done()
    translate_lines(translator, {**options, **extras, **steering}, input, output, err, alignments, alignments_out,
                    alignment_layer, quiet)


@handle_errors
def score_cmd(
    ref: Annotated[list[Path], typer.Option("--ref", "-r", help="Reference file; repeat for several.")],
    hyp: Annotated[Optional[Path], typer.Option("--input", "-i", help="Hypotheses (default stdin).")] = None,
    metrics: Annotated[str, typer.Option(help=(
        "Comma-separated: bleu,chrf,ter, and lc-bleu (BLEU on lowercased, Moses-tokenized text: the multimodal-MT "
        "literature's Multi30k metric; needs --lang or -m)."))] = "bleu,chrf,ter",
    tokenized_bleu: Annotated[Optional[str], typer.Option(
        help="Also report the paper-era tokenized, compound-split BLEU (give the target language, e.g. de).")] = None,
    lang: Annotated[Optional[str], typer.Option(
        "--lang", "-l", help="Target language: chooses BLEU's tokenizer (zh: zh; ja, ko: ja-mecab, ko-mecab, or "
                             "char with a warning without MeCab; else 13a) and TER's Asian support.")] = None,
    model: Annotated[Optional[Path], typer.Option(
        "--model", "-m", help="Take the target language from this checkpoint, exported folder or data dir.")] = None,
    tokenize: Annotated[Optional[str], typer.Option(
        help="BLEU's tokenizer: 13a, intl, zh, char, ja-mecab, ko-mecab or none [default: by the target "
             "language]", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    config: ConfigFlag = None,
    print_config: PrintConfigFlag = False,
) -> None:
    """Score detokenized hypotheses against references with sacreBLEU (scores and signatures)."""
    from nmt_cli.decode.score import print_scores, score_files

    results, warning = score_files(hyp, ref, [m.strip() for m in metrics.split(",") if m.strip()], tokenized_bleu,
                                   tokenize, lang, model)
    if warning:
        err.print(f"nmt score: warning: {warning}", markup=False, highlight=False)
    print_scores(results, as_json)


@handle_errors
def attention_cmd(
    sentence: Annotated[str, typer.Argument(help="A source sentence (raw text).")],
    model: Annotated[Path, typer.Option("--model", "-m", help="Checkpoint (or averaged model).")],
    reference: Annotated[Optional[str], typer.Option(
        help="Target text to force (raw); default: the model's own beam-search translation.")] = None,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", help="Picture to write (.png, .svg, .pdf); default attention.png, none with --json alone.")
    ] = None,
    layer: Annotated[Optional[list[int]], typer.Option(
        help="Layer to draw, 1-based (repeatable; default all).")] = None,
    head: Annotated[Optional[list[int]], typer.Option(help="Head to draw, 1-based (repeatable; default all, and "
                                                           "their mean).")] = None,
    format: Annotated[Optional[str], typer.Option(help="png, svg or pdf (default: from --output).")] = None,
    as_json: Annotated[Optional[Path], typer.Option(
        "--json", help="Write the raw weights (layer x head x query x key) and labels to this file.")] = None,
) -> None:
    """Draw what the model attends to for one sentence: encoder self-attention, decoder self-attention and
    encoder-decoder attention, per layer and head (the paper's Figures 3-5)."""
    from nmt_cli.decode.translate import Translator
    from nmt_cli.model.attention import FORMATS, attention_maps, plot_attention, write_json

    if output is None and as_json is None:
        output = Path("attention.png")
    fmt = (format or (output.suffix.lstrip(".") if output else "") or "png").lower()
    if fmt not in FORMATS:
        raise NmtError(f"{output}: unknown picture format {fmt!r} (use --format png, svg or pdf)")
    translator = Translator.from_checkpoint(model, device="cpu")
    net = translator.ensemble.models[0]
    for flag, values, most in (("--layer", layer, net.config.layers), ("--head", head, net.config.heads)):
        for v in values or ():
            if not 1 <= v <= most:
                raise NmtError(f"{flag} {v}: the model has {most} (1 to {most})")
    source, target = translator.attention_pair(sentence, reference)
    vocab = translator.vocab
    maps = attention_maps(net, source, target, vocab.symbols, vocab.bos, vocab.eos, translator.target_vocab.symbols)
    if output is not None:
        plot_attention(maps, output, [v - 1 for v in layer or ()], [v - 1 for v in head or ()], fmt)
    if as_json is not None:
        write_json(maps, as_json)
    written = " and ".join(str(p) for p in (output, as_json) if p is not None)
    err.print(f"wrote {written} ({len(maps.source)} source and "
              f"{len(maps.target_out)} target tokens; target: {translator.decode(target)})", highlight=False,
              markup=False)
