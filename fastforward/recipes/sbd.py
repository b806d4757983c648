"""`fastforward recipe sbd`: Set Block Decoding on the user's own prompts.

The method's stage (`fastforward.recipes.pipeline` has the rest): the `sbd` objective (NTP on the clean
copy plus masked-token prediction on a block-masked copy, block sizes drawn up to `max_block`) as a LoRA
adapter over the start, on the targets. Along the curve the dev split measures `sbd-verified` (γ = ∞:
SBD's drafts, each token verified by the next-token head, so the output is `ar`'s); at the end also
`sbd-verified` at each of `blocks`, and the lossy `sbd` (the paper's entropy-bounded sampler) and
`sbd-slide` at `gamma`, for their accuracy and speed. Only a lossless row can become the default.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastforward.options import NON_NEGATIVE, at_least, option
from fastforward.recipes.options import Decoders, RecipeOptions
from fastforward.recipes.pipeline import Recipe, register
from fastforward.training.objectives import make_objective
from fastforward.training.objectives.base import Objective


@dataclass(frozen=True)
class SBDOptions(RecipeOptions):
    evaluation_only = RecipeOptions.evaluation_only | {"gamma"}

    max_block: int = option(16, "largest SBD block drawn in training (the smallest: 2)", at_least(2))
    gamma: float = option(0.35, "entropy bound of the lossy sbd and sbd-slide rows on dev", NON_NEGATIVE)


@register("sbd")
class SBDRecipe(Recipe):
    summary = "SFT, Set Block Decoding, a dev-split evaluation (lossless and lossy rows) and a preset folder"
    stage = "sbd"
    method = "a Set Block Decoding LoRA adapter"
    options_class = SBDOptions
    options: SBDOptions

    def objective(self) -> Objective:
        return make_objective("sbd", max_block=self.options.max_block)

    def curve_decoders(self) -> Decoders:
        return {"ar": ("ar", {}), "sbd-verified": ("sbd-verified", self._verified(self.options.max_block))}

    def final_decoders(self) -> Decoders:
        verified = {f"sbd-verified-{b}": ("sbd-verified", self._verified(b)) for b in self.options.blocks}
        lossy = {
            f"{name} gamma {self.options.gamma:g}": (
                name,
                {"block_size": self.options.max_block, "gamma": self.options.gamma},
            )
            for name in ("sbd", "sbd-slide")
        }
        return {"ar": ("ar", {}), "lookup": ("lookup", {}), **verified, **lossy}

    @staticmethod
    def _verified(block: int) -> dict:
        return {"block_size": block, "gamma": float("inf")}
