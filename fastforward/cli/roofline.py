"""`fastforward roofline`: the SBD paper's roofline tables (slowdown, wall-clock speedup) and measured block costs."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from fastforward.cli import add_command, add_compile_flag, add_precision_flags, precision
from fastforward.errors import FastForwardError
from fastforward.evaluation import roofline

H100 = roofline.Hardware()
LLAMA_8B = roofline.Transformer()


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "roofline",
        description="Print the SBD paper's roofline Table 3 (time(k)/time(1)) and Table 4 (eq. 16 wall-clock "
        "speedups) for a hardware and transformer shape; --measure times block forwards of a real model.",
    )
    grid = p.add_argument_group("grid")
    grid.add_argument("--batch", type=int, nargs="+", help="batch sizes (default: 1 4 8 16 for Table 3, 1 4 8 for 4)")
    grid.add_argument("--kv", type=int, nargs="+", default=list(roofline.PAPER_KV_LENS), help="KV cache lengths")
    grid.add_argument("--blocks", type=int, nargs="+", default=list(roofline.PAPER_BLOCKS), help="Table 3 block sizes")
    grid.add_argument(
        "--speedup-blocks", type=int, nargs="+", default=list(roofline.PAPER_SPEEDUP_BLOCKS), help="Table 4 block sizes"
    )
    grid.add_argument(
        "--nfe", type=float, nargs="+", default=list(roofline.PAPER_NFE_SPEEDUPS), help="NFE speedups k/l (Table 4)"
    )
    grid.add_argument("--table", choices=("3", "4", "both", "none"), default="both", help="which tables to print")

    hw = p.add_argument_group("hardware (default: H100, FP8 weights)")
    hw.add_argument("--peak-flops", type=float, default=H100.peak_flops, help="linear-layer FLOP/s")
    hw.add_argument("--attention-flops", type=float, default=H100.attention_flops, help="attention FLOP/s")
    hw.add_argument("--bandwidth", type=float, default=H100.bandwidth, help="memory bandwidth, bytes/s")
    hw.add_argument("--weight-bytes", type=float, default=H100.bytes_per_weight, help="bytes per weight/activation")
    hw.add_argument("--kv-bytes", type=float, default=H100.bytes_per_kv, help="bytes per KV-cache element")
    hw.add_argument("--hardware-name", default=None, help="label for the hardware in titles")

    tf = p.add_argument_group("transformer (default: 8B, 32 layers)")
    tf.add_argument("--hidden", type=int, default=LLAMA_8B.hidden, help="hidden size")
    tf.add_argument("--ffn-mult", type=float, default=LLAMA_8B.ffn_mult, help="FFN width / hidden")
    tf.add_argument("--heads", type=int, default=LLAMA_8B.heads, help="attention heads")
    tf.add_argument("--head-dim", type=int, default=None, help="head size (default: hidden / heads)")
    tf.add_argument("--kv-heads", type=int, default=LLAMA_8B.kv_heads, help="key-value heads")
    tf.add_argument("--layers", type=int, default=LLAMA_8B.layers, help="scales absolute times only")
    tf.add_argument(
        "--corrected",
        action="store_true",
        help="use real K/V and FFN widths and a gated FFN instead of the paper code's (see roofline.Transformer)",
    )

    m = p.add_argument_group("measured block cost")
    m.add_argument("--measure", action="store_true", help="time block forwards of --model on this machine")
    m.add_argument("--model", default="smollm2-135m", help="preset, model directory or .gguf file")
    add_precision_flags(m, dtype="float32", quantize="int4", exact=True)
    add_compile_flag(m)
    m.add_argument("--device", default=None, help="torch device (default: cpu)")
    m.add_argument("--cache-len", type=int, default=256, help="tokens in the cache")
    m.add_argument(
        "--measure-blocks", type=int, nargs="+", default=list(roofline.PAPER_BLOCKS), help="block sizes to time"
    )
    m.add_argument("--repeats", type=int, default=10, help="timed forwards per block size (median)")
    m.add_argument(
        "--causal",
        action="store_true",
        help="time causal blocks (what lookup, jacobi and the other verifying decoders run) instead of SBD steps "
        "(a block of masks beside a committed one, under a dense mask)",
    )
    m.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")

    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write every figure to PATH as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        hardware = roofline.Hardware(
            name=args.hardware_name or ("H100 (FP8)" if _is_default_hw(args) else "custom hardware"),
            bytes_per_weight=args.weight_bytes,
            peak_flops=args.peak_flops,
            attention_flops=args.attention_flops,
            bandwidth=args.bandwidth,
            bytes_per_kv=args.kv_bytes,
        )
        shape = roofline.Transformer(
            hidden=args.hidden,
            ffn_mult=args.ffn_mult,
            heads=args.heads,
            head_dim=args.head_dim,
            kv_heads=args.kv_heads,
            layers=args.layers,
            paper_quirks=not args.corrected,
        )
    except ValueError as exc:
        raise FastForwardError(str(exc)) from exc
    for name in ("batch", "kv", "blocks", "speedup_blocks", "measure_blocks"):
        values = getattr(args, name) or []
        if any(v < (0 if name == "kv" else 1) for v in values):
            raise FastForwardError(f"--{name.replace('_', '-')} values must be positive, got {values}")
    if any(n <= 0 for n in args.nfe):
        raise FastForwardError(f"--nfe values must be positive, got {args.nfe}")

    record: dict = {"hardware": asdict(hardware), "transformer": asdict(shape)}
    printed = False
    if args.table in ("3", "both"):
        tables = roofline.slowdown_table(
            args.batch or roofline.PAPER_SLOWDOWN_BATCHES, args.kv, args.blocks, hardware, shape
        )
        record["slowdown"] = [t.as_dict() for t in tables]
        for t in tables:
            print(("\n" if printed else "") + t.format())
            printed = True
    if args.table in ("4", "both"):
        tables = roofline.speedup_table(
            args.nfe, args.batch or roofline.PAPER_SPEEDUP_BATCHES, args.kv, args.speedup_blocks, hardware, shape
        )
        record["speedup"] = [t.as_dict() for t in tables]
        for t in tables:
            print(("\n" if printed else "") + t.format())
            printed = True
    if args.measure:
        cost = _measure(args)
        record["measured"] = cost.as_dict() | {
            "model": args.model,
            "speedups": {f"{nfe:g}": row for nfe, row in cost.speedups(args.nfe).items()},
        }
        print(("\n" if printed else "") + f"[{args.model}] " + roofline.format_block_cost(cost, args.nfe))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}")
    return 0


def _is_default_hw(args: argparse.Namespace) -> bool:
    return (args.peak_flops, args.attention_flops, args.bandwidth, args.weight_bytes, args.kv_bytes) == (
        H100.peak_flops,
        H100.attention_flops,
        H100.bandwidth,
        H100.bytes_per_weight,
        H100.bytes_per_kv,
    )


def _measure(args: argparse.Namespace) -> roofline.BlockCost:
    import torch

    from fastforward.model import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, device=args.device, precision=precision(args))
    try:
        return roofline.measure_block_cost(
            model, args.measure_blocks, args.cache_len, args.repeats, dense_mask=not args.causal
        )
    except ValueError as exc:
        raise FastForwardError(str(exc)) from exc
