"""`fastforward recipe multitf`: Multi-Block Diffusion post-training (MultiTF) of an SBD model.

MultiTF starts where `fastforward recipe sbd` ended: `--start` names that model's adapter over `--model`
(the preset folder an sbd recipe's `--ship-to` wrote, whose provenance the new one then carries, or its
WORK/shipped), and no SFT stage runs. Give the same data and seed as the SBD run, so the dev split is the
one SBD was measured on. The method's stage
(`fastforward.recipes.pipeline` has the rest): the `multitf` objective (SBD's dual stream with noise-groups
of consecutive blocks, the `fresh-tail` mask ratios by default) as a LoRA adapter over the start.

The dev split measures, at every curve point (step 0 is the SBD model, training-free): `mbd` (a buffer of
`buffer` blocks, accept threshold τ) and SingleBD (`sbd` with the threshold policy at τ, one block at a
time), the paper's comparison; at the end also `sbd-verified` (lossless, a default candidate) and `lookup`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastforward.errors import FastForwardError
from fastforward.options import AT_LEAST_ONE, FRACTION, POSITIVE, option
from fastforward.recipes.options import Decoders, RecipeOptions
from fastforward.recipes.pipeline import Recipe, register
from fastforward.training.objectives import make_objective
from fastforward.training.objectives.base import Objective
from fastforward.training.objectives.multitf import SCHEDULES


@dataclass(frozen=True)
class MultiTFOptions(RecipeOptions):
    evaluation_only = RecipeOptions.evaluation_only | {"block", "buffer", "accept"}

    sft: bool = option(False, "MultiTF post-trains --start: no SFT stage")
    lr: float = option(1e-4, "peak learning rate (the demo's MultiTF: 1e-4)", POSITIVE)
    max_block: int = option(16, "largest block drawn in training (the smallest: 2)", AT_LEAST_ONE)
    max_group: int = option(3, "most blocks in a noise-group", AT_LEAST_ONE)
    schedule: str = option("fresh-tail", "mask ratios within a noise-group", None, SCHEDULES)
    block: int = option(8, "block size of the dev split's mbd, SingleBD and sbd-verified rows", AT_LEAST_ONE)
    buffer: int = option(3, "blocks mbd decodes at once on the dev split", AT_LEAST_ONE)
    accept: float = option(0.9, "accept threshold τ of mbd and SingleBD on the dev split", FRACTION)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.start and not self.from_adapter:  # a first version names its SBD model, a later one its own
            raise FastForwardError(
                "--start: name the SBD model MultiTF post-trains (an sbd recipe's --ship-to folder), or --from a "
                "MultiTF version to continue"
            )
        if self.sft:
            raise FastForwardError("MultiTF post-trains --start as it is: leave out --sft")


@register("multitf")
class MultiTFRecipe(Recipe):
    summary = "MultiTF post-training of an SBD model (--start), mbd against SingleBD on the dev split, a preset"
    stage = "multitf"
    method = "a MultiTF LoRA adapter (SBD, then Multi-Block Diffusion post-training)"
    options_class = MultiTFOptions
    options: MultiTFOptions

    def objective(self) -> Objective:
        o = self.options
        return make_objective("multitf", max_block=o.max_block, max_group=o.max_group, schedule=o.schedule)

    def curve_decoders(self) -> Decoders:
        o = self.options
        return {
            "ar": ("ar", {}),
            "SingleBD": ("sbd", {"block_size": o.block, "policy": "threshold", "gamma": o.accept}),
            "mbd": ("mbd", {"block_size": o.block, "buffer_size": o.buffer, "accept_threshold": o.accept}),
        }

    def final_decoders(self) -> Decoders:
        verified = ("sbd-verified", {"block_size": self.options.block, "gamma": float("inf")})
        return {**self.curve_decoders(), "lookup": ("lookup", {}), "sbd-verified": verified}
