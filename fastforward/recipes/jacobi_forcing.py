"""`fastforward recipe jacobi-forcing`: a model made fast on the user's own prompts, lossless.

The method's stage (`fastforward.recipes.pipeline` has the rest): `jacobi_forcing` with random-tail states
(a block of the target with its last tokens replaced by earlier ones, nothing to roll out) as a LoRA
adapter over the start, at `ar_weight` (CLLM's AR : consistency ratio is 10 : 1). On the dev split it
measures `jacobi` at the training block size along the curve, and `lookup` and `jacobi` at each of
`blocks` at the end; `jacobi` gives `ar`'s tokens, so the fastest one that pays becomes the default.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastforward.model import Model
from fastforward.options import AT_LEAST_ONE, NON_NEGATIVE, option
from fastforward.recipes.options import Decoders, RecipeOptions
from fastforward.recipes.pipeline import Recipe, register
from fastforward.training.data import Example
from fastforward.training.objectives import JacobiForcing
from fastforward.training.objectives.jacobi_forcing import SCHEDULES
from fastforward.training.trajectories.dataset import TrajectoryData, from_examples


@dataclass(frozen=True)
class JacobiForcingOptions(RecipeOptions):
    block_size: int = option(16, "training block size (and the noise window)", AT_LEAST_ONE)
    ar_weight: float = option(10.0, "weight of the AR loss beside the consistency loss (CLLM: 10)", NON_NEGATIVE)
    noise_schedule: str = option("random", "noise within a window", None, SCHEDULES)


@register("jacobi-forcing")
class JacobiForcingRecipe(Recipe):
    summary = "SFT, Jacobi Forcing, a dev-split evaluation and a preset folder that decodes it losslessly"
    stage = "jf"
    method = "a Jacobi Forcing LoRA adapter"
    options_class = JacobiForcingOptions
    options: JacobiForcingOptions

    def objective(self) -> JacobiForcing:
        o = self.options
        return JacobiForcing(
            noise_schedule=o.noise_schedule, noise_window=o.block_size, ar_weight=o.ar_weight,
            states="random-tail", block_size=o.block_size,
        )  # fmt: skip

    def rows(self, examples: list[Example], model: Model) -> TrajectoryData:
        return TrajectoryData(
            from_examples(examples, self.options.block_size, model.pad_token_id), self.options.seq_len
        )

    def row_tokens(self, rows: TrajectoryData) -> float:
        """A row holds the prompt, then a noisy and a clean copy of each block."""
        n = self.options.block_size
        return sum(len(t.prompt_ids) + 2 * n * len(t.blocks) for t in rows.examples) / len(rows)

    def curve_decoders(self) -> Decoders:
        return {"ar": ("ar", {}), "jacobi": ("jacobi", {"block_size": self.options.block_size})}

    def final_decoders(self) -> Decoders:
        jacobi = {f"jacobi-{b}": ("jacobi", {"block_size": b}) for b in self.options.blocks}
        return {"ar": ("ar", {}), "lookup": ("lookup", {}), **jacobi}
