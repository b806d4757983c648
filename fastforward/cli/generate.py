"""`fastforward generate`: decode prompts with any decoder and print text or JSON."""

from __future__ import annotations

import argparse
import json
import sys

from fastforward.api import DECODERS, build_decoder
from fastforward.model import DTYPES, load_model

DECODER_KNOBS = (
    "block_size",
    "policy",
    "gamma",
    "first_token_from_ntp",
    "draft_init",
    "max_blocks",
    "spawn_ratio",
    "verify",
    "ngram",
    "temperature",
    "top_p",
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts")
    p.add_argument("prompts", nargs="*", help="prompts (default: read one per line from stdin)")
    p.add_argument("--model", default="smollm2-135m", help="preset, model directory or .gguf file")
    p.add_argument("--decoder", choices=sorted(DECODERS), default="ar")
    add_decoder_flags(p)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--device", default=None, help="torch device (default: cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (left padding)")
    p.add_argument("--no-chat-template", action="store_true", help="send prompts as raw text")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(run=run)


def add_decoder_flags(p: argparse.ArgumentParser) -> None:
    """Every decoder's knobs (see `decoder_knobs`); commands that decode share them."""
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (sbd) or drafts per block (jacobi)")
    p.add_argument("--policy", default="entropy", help="reveal policy: entropy, confidence, factor, threshold")
    p.add_argument("--gamma", type=float, default=0.35, help="the policy's bound: γ, factor f or threshold τ")
    p.add_argument(
        "--first-token-from-ntp",
        action="store_true",
        help="take each block's first token from the next-token prediction (sbd)",
    )
    p.add_argument("--draft-init", default="repeat", help="jacobi: fill fresh drafts by 'repeat' or 'random'")
    p.add_argument("--max-blocks", type=int, default=2, help="jacobi-mr: blocks refined at once (K)")
    p.add_argument("--spawn-ratio", type=float, default=0.85, help="jacobi-mr: spawn a block at ⌈r·n⌉ confirmed")
    p.add_argument("--verify", type=int, default=2, help="jacobi-mr: recycled n-gram candidates per forward")
    p.add_argument("--ngram", type=int, default=0, help="jacobi-mr: candidate length (default: block size)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)


def decoder_knobs(args: argparse.Namespace) -> dict:
    """The `build_decoder` keyword arguments given by `add_decoder_flags` flags."""
    return {name: getattr(args, name) for name in DECODER_KNOBS}


def run(args: argparse.Namespace) -> int:
    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    decoder = build_decoder(args.decoder, seed=args.seed, **decoder_knobs(args))
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
