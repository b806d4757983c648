"""The `fastforward` command: one module per subcommand, each exposing `register(subparsers)`."""

from __future__ import annotations

import argparse
import sys

from fastforward.errors import FastForwardError


def build_parser() -> argparse.ArgumentParser:
    from fastforward.cli import decoding, demo, eval, generate, jacobi_forcing, roofline, train, trajectories

    parser = argparse.ArgumentParser(prog="fastforward", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (demo, generate, train, eval, roofline, trajectories, jacobi_forcing, decoding):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except FastForwardError as exc:
        print(f"fastforward {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fastforward {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
