"""`fastforward generate`: decode prompts with any decoder and print text or JSON."""

from __future__ import annotations

import argparse
import json
import sys

from fastforward.api import build_decoder
from fastforward.cli.decoding import add_decoder_flags, decoder_knobs
from fastforward.model import DTYPES, load_model


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts")
    p.add_argument("prompts", nargs="*", help="prompts (default: read one per line from stdin)")
    p.add_argument("--model", default="smollm2-135m", help="preset, model directory or .gguf file")
    add_decoder_flags(p)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--device", default=None, help="torch device (default: cpu)")
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (left padding)")
    p.add_argument("--no-chat-template", action="store_true", help="send prompts as raw text")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    decoder = build_decoder(args.decoder, **decoder_knobs(args))
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    encoded = [model.encode_prompt(p, chat_template=not args.no_chat_template) for p in prompts]
    for start in range(0, len(encoded), max(args.batch_size, 1)):
        batch = encoded[start : start + max(args.batch_size, 1)]
        for prompt, gen in zip(prompts[start:], decoder.generate(model, batch, args.max_new_tokens), strict=False):
            if args.json:
                record = {"prompt": prompt, "text": gen.text, "token_ids": gen.token_ids, "stats": gen.stats.as_dict()}
                print(json.dumps(record), flush=True)
            else:
                print(gen.text, flush=True)
                s = gen.stats
                print(
                    f"[{args.decoder}: {s.tokens} tokens, {s.nfe} forwards, {s.tpf:.2f} tokens/forward, "
                    f"{s.tps:.1f} tokens/s]",
                    file=sys.stderr,
                )
    return 0
