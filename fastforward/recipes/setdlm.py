"""`fastforward recipe setdlm`: Set Diffusion on the user's own prompts.

The method's stage (`fastforward.recipes.pipeline` has the rest): the `setdlm` objective (every target
predicted once, as a singleton set, from the tokens revealed before it, plus NTP on the clean copy) as a
LoRA adapter over the start, on the targets. Along the curve the dev split measures `setdlm` with the first
token of each step from the next-token head (`--first-token-from-ntp`, the paper's "AR mode kept" reading);
at the end also `setdlm` without it, for accuracy and speed. `setdlm` is lossy, so the model's default
stays a lossless decoder (`ar` or `lookup`, whichever pays); the rows say what `--decoder setdlm` gives.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastforward.options import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, option
from fastforward.recipes.options import Decoders, RecipeOptions
from fastforward.recipes.pipeline import Recipe, register
from fastforward.training.objectives import make_objective
from fastforward.training.objectives.base import Objective


@dataclass(frozen=True)
class SetDLMOptions(RecipeOptions):
    evaluation_only = RecipeOptions.evaluation_only | {"window", "threshold"}

    set_size: float = option(4.0, "desired tokens per reveal set in training", POSITIVE)
    max_set: float = option(8.0, "reveal window width s_max in training", AT_LEAST_ONE)
    window: int = option(4, "masked positions the dev split's setdlm rows decode at once", AT_LEAST_ONE)
    threshold: float = option(0.9, "probability above which those rows accept a candidate", NON_NEGATIVE)


@register("setdlm")
class SetDLMRecipe(Recipe):
    summary = "SFT, Set Diffusion, a dev-split evaluation (its rows against ar) and a preset folder"
    stage = "setdlm"
    method = "a Set Diffusion LoRA adapter"
    options_class = SetDLMOptions
    options: SetDLMOptions

    def objective(self) -> Objective:
        return make_objective("setdlm", set_size=self.options.set_size, max_set=self.options.max_set)

    def curve_decoders(self) -> Decoders:
        return {"ar": ("ar", {}), "setdlm ntp-first": ("setdlm", self._setdlm(first_token_from_ntp=True))}

    def final_decoders(self) -> Decoders:
        return {
            "ar": ("ar", {}),
            "lookup": ("lookup", {}),
            "setdlm ntp-first": ("setdlm", self._setdlm(first_token_from_ntp=True)),
            "setdlm": ("setdlm", self._setdlm(first_token_from_ntp=False)),
        }

    def _setdlm(self, first_token_from_ntp: bool) -> dict:
        o = self.options
        return {"window": o.window, "threshold": o.threshold, "first_token_from_ntp": first_token_from_ntp}
