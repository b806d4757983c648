"""What a recipe's command line sets (`RecipeOptions`, every method's options add their own fields), where its
records come from (`Data`), its dev-split rows (`Decoders`), and the command that reruns it (`command_line`,
which a shipped model's provenance gives)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from fastforward.errors import FastForwardError
from fastforward.options import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, PROPER_FRACTION, Bound, check_options, option
from fastforward.recipes.records import DataFile, TaskData, parse_budget
from fastforward.recipes.targets import TARGETS

BLOCK_SIZES = Bound("block sizes of at least 1", lambda sizes: bool(sizes) and min(sizes) >= 1)


@dataclass(frozen=True)
class RecipeOptions:
    """What every recipe's command line sets, declared as every option is (`fastforward.options`); a method's
    options add its own fields. `evaluation_only`: the options that change only the dev-split evaluation, and
    `run_only`: how the work is run, not what it trains; a rerun in the same work folder may change both (the
    others shape what is trained)."""

    evaluation_only: ClassVar[frozenset[str]] = frozenset({"blocks", "curve_n", "final_n", "max_new_tokens"})
    run_only: ClassVar[frozenset[str]] = frozenset({"micro_batch"})
    flags: ClassVar[dict[str, str]] = {"from_adapter": "--from"}  # fields whose flag is not their name

    @classmethod
    def flag(cls, name: str) -> str:
        """The command-line flag of the field `name`."""
        return cls.flags.get(name, "--" + name.replace("_", "-"))

    model: str = option("smollm2-135m", "the base: preset, model directory or .gguf file")
    from_adapter: str = option(
        "",
        "continue a shipped model's training: a preset or folder this recipe's method made over --model; its "
        "adapter's weights, a fresh optimizer with a short warm-up, no SFT stage; the curve counts on from its tokens",
    )
    start: str = option(
        "",
        "the model the method trains from, in place of an SFT stage: an adapter over --model (a shared SFT start, "
        "or another recipe's --ship-to folder), a preset name or folder",
    )
    budget: str = option(
        "1h",
        "training tokens (3M, 500k) or time (90min, 3h: each training stage's share, at the rate its own "
        "first steps run at here)",
    )
    dev: int = option(100, "records held out as the dev split", AT_LEAST_ONE)
    seed: int = option(0, "seed of the dev split and of training", NON_NEGATIVE)
    sft: bool = option(True, "an SFT stage on the records' completions first (when every record has one)")
    sft_share: float = option(0.25, "share of the budget for SFT", PROPER_FRACTION)
    targets: str = option(
        "self", "train toward the start model's own greedy answers (self) or the records' completions", None, TARGETS
    )
    answers: int = option(
        0, "train prompts the start model answers for --targets self (0: one epoch's worth)", NON_NEGATIVE
    )
    answer_tokens: int = option(
        256, "new tokens at most in each of those answers (longer ones are left out)", AT_LEAST_ONE
    )
    lora_rank: int = option(16, "LoRA rank of each stage", AT_LEAST_ONE)
    lora_layers: int = option(0, "LoRA on the top N decoder layers only (0: every layer)", NON_NEGATIVE)
    lr: float = option(1e-3, "peak learning rate", POSITIVE)
    seq_len: int = option(512, "tokens per training row", AT_LEAST_ONE)
    batch_size: int = option(8, "rows per step", AT_LEAST_ONE)
    micro_batch: int = option(
        0, "rows per forward pass (0: all of --batch-size); fewer take less memory for the same steps", NON_NEGATIVE
    )
    curve: int = option(4, "points of the learning curve", AT_LEAST_ONE)
    control: bool = option(False, "also train an NTP control (the same start, data and steps) and measure it")
    blocks: tuple[int, ...] = option((8, 12, 16), "block sizes measured on the dev split", BLOCK_SIZES)
    curve_n: int = option(30, "dev records at each curve point", AT_LEAST_ONE)
    final_n: int = option(
        0, "dev records for the final table and the choice of defaults (0: all; fewer to fit the time)", NON_NEGATIVE
    )
    max_new_tokens: int = option(256, "new tokens per dev answer at most", AT_LEAST_ONE)

    def __post_init__(self) -> None:
        """Refuse values outside their rules, however the options are made (the CLI or Python)."""
        check_options(self)
        parse_budget(self.budget)
        if self.start and self.from_adapter:
            raise FastForwardError("--from continues a shipped model, which holds its start already: leave out --start")
        if self.micro_batch and self.batch_size % self.micro_batch:
            raise FastForwardError(f"--micro-batch {self.micro_batch} must divide --batch-size {self.batch_size}")

    def training(self) -> dict[str, Any]:
        """The options that shape training, by name."""
        kept = lambda name: name not in self.evaluation_only | self.run_only  # noqa: E731
        return {f.name: getattr(self, f.name) for f in fields(self) if kept(f.name)}


Data = DataFile | TaskData  # where a recipe's records come from

# A dev-split row: a decoder and its options, by label.
Decoders = dict[str, tuple[str, dict[str, Any]]]


def command_line(name: str, options: RecipeOptions, data: Data, work: Path, ship_to: Path | None = None) -> str:
    """The command that runs recipe `name` with `options`, every option that shapes training spelled out
    (what a provenance.json gives to rebuild a model from a fresh work folder)."""
    words = ["fastforward", "recipe", name, *data.words(), "--work", str(work)]
    for field_name, value in options.training().items():
        flag = options.flag(field_name)
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + flag[2:])
        elif value != "":  # an unset path (no --from): nothing to spell out
            words += [flag, str(value)]
    words += ["--blocks", *map(str, options.blocks)]
    if ship_to is not None:
        words += ["--ship-to", str(ship_to)]
    return shlex.join(words)
