"""`fastforward infill`: fill a gap of N tokens between a prefix and a suffix (Set Diffusion)."""

from __future__ import annotations

import argparse
import json
import sys

from fastforward.api import build_decoder, infill
from fastforward.cli import (
    add_command,
    add_compile_flag,
    add_precision_flags,
    add_threads_flag,
    positive_int,
    precision,
)
from fastforward.cli.decoding import add_decoder_flags, decoder_knobs
from fastforward.model import check_device, load_model


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "infill",
        description=__doc__,
    )
    p.add_argument("--model", required=True, help="a model trained with --objective setdlm (directory or preset)")
    p.add_argument("--prefix", required=True, help="text before the gap")
    p.add_argument("--suffix", required=True, help="text after the gap")
    p.add_argument("--middle-tokens", type=positive_int, required=True, help="tokens in the gap")
    add_decoder_flags(p, default="setdlm")
    add_precision_flags(p, dtype="float32", quantize="none", exact=False)
    add_compile_flag(p)
    p.add_argument("--device", default=None, help="torch device (default: cpu)")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    add_threads_flag(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    check_device(args.device)
    decoder = build_decoder(args.decoder, **decoder_knobs(args))
    model = load_model(args.model, device=args.device, precision=precision(args))
    gen = infill(model, args.prefix, args.suffix, args.middle_tokens, decoder)[0]
    if args.json:
        record = {"middle": gen.text, "token_ids": gen.token_ids, "finish_reason": gen.finish_reason}
        print(json.dumps({**record, "stats": gen.stats.as_dict()}), flush=True)
        return 0
    print(gen.text, flush=True)
    s = gen.stats
    print(f"[{args.decoder}: {s.tokens} tokens, {s.nfe} forwards, {s.tpf:.2f} tokens/forward]", file=sys.stderr)
    return 0
