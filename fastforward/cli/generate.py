"""`fastforward generate`: decode prompts with any decoder and print text or JSON."""

from __future__ import annotations

import argparse
from typing import Any

from fastforward.api import build_decoder
from fastforward.cli import (
    DECODING_DEFAULTS,
    DEFAULT_DECODER,
    add_command,
    add_compile_flag,
    add_precision_flags,
    add_threads_flag,
    positive_int,
    precision,
)
from fastforward.cli.decoding import add_decoder_flags, chosen_decoder, decoder_knobs
from fastforward.cli.generate_io import NO_PROMPTS, print_report, read_prompts, say_interrupted
from fastforward.decoding.decoders import Generation
from fastforward.decoding.engine_core import in_order
from fastforward.decoding.runtime import GenerationInterrupted
from fastforward.errors import FastForwardError
from fastforward.model import check_device, load_model


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "generate")
    p.add_argument("prompts", nargs="*", help="prompts (default: read one per line from stdin)")
    p.add_argument("--model", default="smollm2-135m", help="preset, model directory or .gguf file")
    add_decoder_flags(
        p,
        default=None,
        default_help=f"the model's own, from its decoding.json (`fastforward models` lists them), else "
        f"{DEFAULT_DECODER}: lossless, and it samples too, with --temperature",
    )
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate at most per prompt")
    add_precision_flags(p, **DECODING_DEFAULTS)
    add_compile_flag(p)
    p.add_argument("--device", default=None, help="torch device (default: cpu)")
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=1,
        help="prompts decoded together at most; a waiting prompt joins as soon as one finishes",
    )
    p.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="end the text before this string (repeatable)"
    )
    p.add_argument("--no-chat-template", action="store_true", help="send prompts as raw text")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument(
        "--no-engine",
        action="store_true",
        help="decode in this process even when a warm engine (`fastforward engine start`) could answer",
    )
    add_threads_flag(p)
    p.set_defaults(run=run, printed=0)  # printed: the prompts a warm engine that died had printed


def run(args: argparse.Namespace) -> int:
    check_device(args.device)
    args.decoder, knobs = chosen_decoder(args, decoder_knobs(args), DEFAULT_DECODER)  # named in each report
    decoder = build_decoder(args.decoder, **knobs)
    prompts = args.prompts or read_prompts()
    if not prompts:
        raise FastForwardError(NO_PROMPTS)
    model = load_model(args.model, device=args.device, precision=precision(args))
    encoded = [model.encode_prompt(p, chat_template=not args.no_chat_template) for p in prompts]
    # After a warm engine that died, the prompts it printed are not decoded or printed again.
    done = args.printed  # prompts reported
    try:
        for gen in in_order(model, decoder, encoded[done:], args.max_new_tokens, args.batch_size, args.stop):
            report(args, prompts[done], gen)
            done += 1
    except KeyboardInterrupt as interrupt:  # print what the prompts in flight had so far, then stop
        partial = interrupt.generations if isinstance(interrupt, GenerationInterrupted) else []
        for prompt, gen in zip(prompts[done:], partial, strict=False):
            if gen.token_ids or gen.finish_reason != "interrupted":  # it had started
                report(args, prompt, gen)
        say_interrupted(done, len(prompts))
        raise
    return 0


def report(args: argparse.Namespace, prompt: str, gen: Generation) -> None:
    """Print one prompt's generation (text, or a JSON record) and its figures or warnings on stderr."""
    print_report(
        record(prompt, args.decoder, gen), summary(args.decoder, gen), warning(gen, args.max_new_tokens), args.json
    )


def record(prompt: str, decoder: str, gen: Generation) -> dict[str, Any]:
    """What `--json` prints of one prompt's generation (the decoder: the one chosen, maybe the model's own)."""
    return {
        "prompt": prompt,
        "decoder": decoder,
        "text": gen.text,
        "token_ids": gen.token_ids,
        "finish_reason": gen.finish_reason,
        "stats": gen.stats.as_dict(),
    }


def summary(decoder: str, gen: Generation) -> str:
    """The figures line printed on stderr after a generation's text."""
    s = gen.stats
    ended = "" if gen.finish_reason != "interrupted" else ", interrupted"
    return (
        f"[{decoder}: {s.tokens} tokens, {s.nfe} forwards, {s.tpf:.2f} tokens/forward, "
        f"{s.queries_per_token:.2f} queries/token, {s.tps:.1f} tokens/s{ended}]"
    )


def warning(gen: Generation, max_new_tokens: int) -> str | None:
    """Said when the model's context, not --max-new-tokens, ended the output."""
    if gen.finish_reason != "context":
        return None
    return (
        f"fastforward generate: warning: the model's context cut a prompt's output at {len(gen.token_ids)} "
        f"tokens (asked for {max_new_tokens}); shorten the prompt for more"
    )
