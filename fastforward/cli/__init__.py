"""The `fastforward` command: one module per subcommand, each exposing `register(subparsers)`."""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastforward.errors import FastForwardError

if TYPE_CHECKING:  # the model package imports torch: a command imports it only when it loads a model
    from fastforward.model import Precision

# Every subcommand: its module in this package and its one-line help. `fastforward --help` lists them
# from here, and a command line imports only the module of the command it names (with what that module
# needs): `generate` never loads training, evaluation, the server or lm-eval.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "every method on the shipped checkpoints (about two minutes on 2 CPU cores); --retrain, --quick"),
    "generate": ("generate", "generate text for one or more prompts"),
    "infill": (
        "infill",
        "fill the middle between a prefix and a suffix (setdlm; ar continues the prefix alone, the baseline)",
    ),
    "serve": ("serve", "serve a model over an OpenAI-compatible HTTP API"),
    "engine": ("engine", "start, check or stop a warm local engine that answers `generate` (start|status|stop)"),
    "train": ("train", "train a model with an objective (resumes an unfinished run in --out)"),
    "eval": ("eval", "accuracy, NFE, TPF, TPS and speedup of a decoder on a task (AR baseline in the same run)"),
    "roofline": ("roofline", "roofline slowdown/speedup tables (SBD paper Tables 3-4) and measured block costs"),
    "trajectories": ("trajectories", "write Jacobi trajectories of a model over prompts (JSONL, resumable)"),
    "jacobi-forcing": (
        "jacobi_forcing",
        "progressive Jacobi Forcing: rounds of trajectory collection and training (resumable)",
    ),
    "recipe": (
        "recipe",
        "a whole recipe on your own data: SFT, Jacobi Forcing, a dev-split evaluation, a preset (resumable)",
    ),
    "lm-eval-tasks": ("lm_eval_tasks", "write lm-eval task YAMLs over local files (use with --include_path)"),
    "decoders": ("decoding", "list the decoders and their options (a markdown table)"),
    "models": ("models", "list the models that load by name, each with its default decoder"),
}


# What `fastforward --help` opens with: for the user, who may have only this command and no README.
DESCRIPTION = (
    "Run a Hugging Face causal LM as a parallel decoder: several tokens per forward pass, an exact KV "
    "cache, and for the lossless decoders exactly the tokens plain greedy decoding gives. Try "
    "`fastforward demo` (every method on shipped checkpoints, about two minutes on 2 CPU cores), then "
    "`fastforward generate PROMPT`. `fastforward COMMAND --help` gives the options of a command."
)


class DefaultsShown(argparse.HelpFormatter):
    """Every option's help ends with its default, unless its help already says it (options whose
    default is None, off or empty have nothing to show)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or not shows_default(action):
            return text
        return text if "default" in text else f"{text} (default: %(default)s)"


def shows_default(action: argparse.Action) -> bool:
    """Whether an option has a default to show: not None, off, empty or suppressed (0 is shown)."""
    default = action.default
    if default is None or default is False or default is argparse.SUPPRESS:
        return False
    return default not in ("", [])


def build_parser(
    command: str | None = None, parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser
) -> argparse.ArgumentParser:
    """The `fastforward` parser: every subcommand in full, or only `command` in full (the others by name
    and help only, so that nothing else is imported). parser_class: the class of it and its subparsers
    (the engine parses `generate`'s arguments with one that raises instead of exiting)."""
    parser = parser_class(prog="fastforward", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, summary) in COMMANDS.items():
        if command is None or command == name:
            importlib.import_module(f"fastforward.cli.{module}").register(sub)
        else:
            sub.add_parser(name, help=summary)
    return parser


def add_command(sub: argparse._SubParsersAction, name: str, **options) -> argparse.ArgumentParser:
    """The subparser of command `name`, with its help from `COMMANDS`, showing each option's default."""
    return sub.add_parser(name, help=COMMANDS[name][1], formatter_class=DefaultsShown, **options)


def named_command(argv: list[str]) -> str:
    """The command an argument list names: its first word that is a command ('' when none is)."""
    return next((word for word in argv if word in COMMANDS), "")


def positive_int(text: str) -> int:
    """argparse type for counts that must be at least 1 (0 or less is an error, never a silent 1)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


# The precision a command that decodes on a CPU defaults to (generate, serve, the engine): float32 weights
# quantized to int4, row-invariant attention.
DECODING_DEFAULTS: dict[str, Any] = {"dtype": "float32", "quantize": "int4", "exact": True}
# The decoder `generate` (and the engine that answers it) gives a model without decoding.json: `lookup`,
# lossless (greedy, or AR's own samples with --temperature), and measured as fast as `ar` on chat prompts
# and faster on code (docs/results.md).
DEFAULT_DECODER = "lookup"


def add_threads_flag(p: argparse.ArgumentParser) -> None:
    """--threads, for every command that runs a model (main() applies it before the command runs)."""
    p.add_argument(
        "--threads", type=positive_int, default=None, help="torch threads (default: the cores not busy right now)"
    )


def add_precision_flags(p: argparse.ArgumentParser, attention_flag: bool = True, **defaults: Any) -> None:
    """The flags of `fastforward.model.Precision` that every command loading a model to decode takes: --dtype,
    --quantize, --exact / --no-exact, --adapter and (`attention_flag`) --attention. defaults: the command's
    own defaults on a CPU, as Precision fields (the rest are Precision's); `precision(args)` reads them back."""
    from fastforward.cpu.quantize import QUANTIZATIONS
    from fastforward.model import DTYPES, Precision, flex

    cpu = Precision(**defaults)
    # A command run with a CUDA --device gets ON_GPU's dtype, quantization and --exact (`resolve_precision`).
    p.set_defaults(cpu_precision=cpu)
    p.add_argument("--dtype", choices=sorted(DTYPES), help=f"weight dtype (default: {cpu.dtype}; bfloat16 on a GPU)")
    p.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        help=f"quantized linear layers on the CPU (default: {cpu.quantize}; none on a GPU); see docs/precision.md",
    )
    p.add_argument(
        "--exact",
        action=argparse.BooleanOptionalAction,
        help="row-invariant attention on the CPU: verifying decoders give greedy AR's tokens bit for bit "
        f"(with int8, int4 or bfloat16 weights; default: {'on' if cpu.exact else 'off'}; off on a GPU)",
    )
    add_adapter_flag(p)
    if not attention_flag:
        return
    p.add_argument(
        "--attention",
        choices=flex.CHOICES,
        default=cpu.attention,
        help="sdpa, or flex (FlexAttention: a new BlockMask each step, slower to decode; see docs/precision.md)",
    )


def add_dtype_flag(p: argparse.ArgumentParser) -> None:
    """--dtype at `Precision`'s default, for the commands that train or collect on any device."""
    from fastforward.model import DTYPES, Precision

    p.add_argument("--dtype", choices=sorted(DTYPES), default=Precision().dtype, help="weight dtype")


def add_adapter_flag(p: argparse.ArgumentParser) -> None:
    """--adapter, for every command that loads a model (`load_model(adapter=...)`)."""
    p.add_argument(
        "--adapter",
        default=None,
        help="a PEFT (LoRA) adapter directory, merged into --model's weights before quantizing (default: none; "
        "an adapter directory that names its base also works as --model)",
    )


def add_compile_flag(p: argparse.ArgumentParser, compile: bool = False) -> None:
    """--compile / --no-compile and --cuda-graphs, for the commands whose model is loaded through
    `precision`. compile: the command's default on a CPU where steps can be compiled (`resolve_precision`)."""
    p.set_defaults(cpu_compile=compile)
    default = "on on a CPU where torch can keep compiled steps (2.13 and a C++ compiler)" if compile else "off"
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="compile the decoding steps (inductor): faster steps, the same tokens; each kind of step compiles "
        f"once (about a minute) and is kept in $FASTFORWARD_HOME/compiled (default: {default}; see docs/precision.md)",
    )
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        help="replay decoding steps as CUDA graphs (default: on with a CUDA --device, where the model allows; "
        "see docs/results.md, GPU)",
    )


# The flags whose default depends on the device: unset (None) until `resolve_precision`.
DEVICE_DEFAULTS = ("dtype", "quantize", "exact")


def resolve_precision(args: argparse.Namespace) -> None:
    """Fill the precision flags left unset: the command's CPU defaults, or on a CUDA --device ON_GPU's
    (bfloat16 weights without quantization, a CPU kernel, or --exact, a CPU attention)."""
    on_gpu = fill_device_defaults(args, device_defaults(args.cpu_precision))
    if "cpu_compile" in vars(args) and args.compile is None:
        args.compile = not on_gpu and args.cpu_compile and _compiles_here(args.command)


def device_defaults(cpu: Precision) -> dict[str, dict[str, Any]]:
    """What the DEVICE_DEFAULTS flags take when left unset: on "cpu" the command's own (`cpu`), on "cuda" ON_GPU's."""
    from fastforward.model import ON_GPU

    return {
        device: {name: getattr(p, name) for name in DEVICE_DEFAULTS} for device, p in (("cpu", cpu), ("cuda", ON_GPU))
    }


def fill_device_defaults(args: argparse.Namespace, defaults: Mapping[str, Mapping[str, Any]]) -> bool:
    """Set the DEVICE_DEFAULTS flags left unset to `defaults` of the --device's kind (`device_defaults`;
    free of torch: the warm engine's client resolves its flags so); whether the device is a CUDA one."""
    on_gpu = str(getattr(args, "device", None) or "").startswith("cuda")
    for name in DEVICE_DEFAULTS:
        if getattr(args, name) is None:
            setattr(args, name, defaults["cuda" if on_gpu else "cpu"][name])
    return on_gpu


def _compiles_here(command: str) -> bool:
    """Whether a command whose default is --compile gets it here; if not, it says why in one line."""
    try:
        from fastforward.cpu.compiled import unavailable
    except ImportError as error:  # a torch without dynamo's AOT compile
        reason = f"needs dynamo's AOT compile ({error})"
    else:
        reason = unavailable("cpu")
    if reason is not None:
        print(f"fastforward {command}: decoding steps run eagerly: compiling them {reason}", file=sys.stderr)
    return reason is None


def precision(args: argparse.Namespace) -> Precision:
    """The `Precision` the flags of `add_precision_flags` and `add_compile_flag` ask for (each flag is the
    field of its name; a field without its flag in this command keeps its default)."""
    from fastforward.model import Precision
    from fastforward.model.precision import FIELDS

    return Precision(**{name: getattr(args, name) for name in FIELDS if name in vars(args)})


def main(argv: list[str] | None = None) -> int:
    from fastforward.cpu.threads import Sample, use_threads

    started = Sample.now()  # the CPU times over the imports below tell how busy the machine is
    command = "fastforward"
    try:
        # Building the parser imports torch and transformers (seconds): Ctrl-C there is an interrupt too.
        the_process = argv is None  # the `fastforward` command itself, not a caller in a longer process
        argv = sys.argv[1:] if argv is None else argv
        resume = None
        if named_command(argv) == "generate":  # a warm engine answers without importing torch here
            from fastforward.cli.warm.client import answer

            command = "fastforward generate"  # the client's errors and Ctrl-C read as in process
            answered = answer(argv)
            if isinstance(answered, int):
                return answered
            resume = answered
            command = "fastforward"
        args = build_parser(named_command(argv)).parse_args(argv)
        if resume is not None:  # the engine died or declined: this process decodes what it had not printed
            args.prompts, args.printed = resume.prompts, resume.printed
        if the_process:
            # The imports' objects (torch, transformers) live as long as the process, yet every full
            # collection walks them again, and loading a tokenizer and a model sets off several: frozen,
            # they are skipped (what that saves: docs/notes/2026-11-28-cpu-speed-and-start-up.md).
            gc.freeze()
        command = f"fastforward {args.command}"
        if "cpu_precision" in vars(args):
            resolve_precision(args)
        if "threads" in vars(args):
            use_threads(args.threads, since=started)
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
