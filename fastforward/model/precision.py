"""How a model computes: one value that `load_model` takes and the CLI's precision flags fill, so each
option, its name and its default are declared here only (`fastforward.cli.add_precision_flags`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from fastforward.cpu.quantize import check_scheme
from fastforward.errors import FastForwardError
from fastforward.model import flex

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """The weights' dtype and quantization, the attention, and how decoding steps run; every field is also
    the CLI flag of its name (`--dtype`, `--quantize`, `--exact`, `--attention`, `--compile`, `--cuda-graphs`,
    `--adapter`). Checked when made, before a load that takes seconds.

    quantize: "none", "int8" or "int4" linear layers (`fastforward.cpu.quantize`, CPU). exact: row-invariant
    attention (`fastforward.cpu.attention`), so that a token's logits do not depend on what shares its
    forward; with int8, int4 or bfloat16 weights, verifying decoders then give greedy AR's tokens bit
    for bit. attention: "sdpa" or "flex" (FlexAttention, `fastforward.model.flex`; GPUs train with it).
    compile: compile the decoding steps (`fastforward.cpu.compiled`): faster steps after a warm-up.
    cuda_graphs: replay decoding steps as CUDA graphs (`fastforward.model.step_graphs`); None: on a CUDA
    device where the model allows it (SDPA, no sliding windows, no compile).
    adapter: a PEFT (LoRA) adapter directory merged into the weights before quantizing
    (`fastforward.model.adapters`).
    """

    dtype: str = "float32"
    quantize: str = "none"
    exact: bool = False
    attention: str = "sdpa"
    compile: bool = False
    cuda_graphs: bool | None = None
    adapter: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.dtype, torch.dtype):  # a torch dtype names one of ours: keep the value plain
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if self.dtype not in DTYPES:
            raise FastForwardError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        check_scheme(self.quantize)
        flex.implementation(self.attention)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def fuse(self) -> bool:
        """Whether quantized projections that share an input become one layer: where that measured faster,
        int8 eager and native int4 compiled (docs/notes/2026-11-smoothing-and-fused-projections.md,
        docs/notes/2026-11-avx2-kernels.md)."""
        return self.compile if self.quantize == "int4" else not self.compile


# A CUDA device's defaults for the fields a command leaves unset: bfloat16 weights, without quantization
# (a CPU kernel) or exact attention (a CPU attention).
ON_GPU = Precision(dtype="bfloat16")

FIELDS = tuple(f.name for f in fields(Precision))
