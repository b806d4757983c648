"""The `fastforward` command: one module per subcommand, each exposing `register(subparsers)`."""

from __future__ import annotations

import argparse
import sys

from fastforward.errors import FastForwardError


def build_parser() -> argparse.ArgumentParser:
    from fastforward.cli import (
        decoding,
        demo,
        eval,
        generate,
        infill,
        jacobi_forcing,
        lm_eval_tasks,
        roofline,
        serve,
        train,
        trajectories,
    )

    parser = argparse.ArgumentParser(prog="fastforward", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    commands = (demo, generate, infill, serve, train, eval, roofline, trajectories, jacobi_forcing, lm_eval_tasks)
    commands += (decoding,)
    for module in commands:
        module.register(sub)
    return parser


def positive_int(text: str) -> int:
    """argparse type for counts that must be at least 1 (0 or less used to run silently as 1)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_threads_flag(p: argparse.ArgumentParser) -> None:
    """--threads, for every command that runs a model (main() applies it before the command runs)."""
    p.add_argument(
        "--threads", type=positive_int, default=None, help="torch threads (default: the cores not busy right now)"
    )


def add_precision_flags(
    p: argparse.ArgumentParser, dtype: str = "float32", quantize: str = "none", exact: bool = False
) -> None:
    """--dtype, --quantize and --exact / --no-exact, for every command that loads a model to decode."""
    from fastforward.cpu.quantize import QUANTIZATIONS
    from fastforward.model import DTYPES

    p.add_argument("--dtype", choices=sorted(DTYPES), default=dtype, help=f"weight dtype (default: {dtype})")
    p.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        default=quantize,
        help=f"quantized linear layers on the CPU (default: {quantize}); see README, Precision",
    )
    p.add_argument(
        "--exact",
        action=argparse.BooleanOptionalAction,
        default=exact,
        help="row-invariant attention: verifying decoders give greedy AR's tokens bit for bit "
        f"(with int8, int4 or bfloat16 weights; default: {'on' if exact else 'off'})",
    )


def add_compile_flag(p: argparse.ArgumentParser) -> None:
    """--compile, for the commands whose model is loaded through `precision`."""
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the decoding steps with torch.compile: faster steps after a warm-up of tens of "
        "seconds (see README, Precision)",
    )


def precision(args: argparse.Namespace) -> dict:
    """load_model's arguments from the flags of `add_precision_flags` and `add_compile_flag`."""
    return {"dtype": args.dtype, "quantize": args.quantize, "exact": args.exact, "compile": args.compile}


def main(argv: list[str] | None = None) -> int:
    command = "fastforward"
    try:
        # Building the parser imports torch and transformers (seconds): Ctrl-C there is an interrupt too.
        args = build_parser().parse_args(argv)
        command = f"fastforward {args.command}"
        if "threads" in vars(args):
            from fastforward.cpu.threads import use_threads

            use_threads(args.threads)
        return args.run(args) or 0
    except FastForwardError as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
