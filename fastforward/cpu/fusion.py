"""int8 projections that read the same input run as one matmul, without touching a modeling file.

A decoder layer reads one normalised hidden state into its query, key and value projections, and
another into its gate and up projections: seven matmuls per layer where three calls would do. On a
CPU decoding one token at a time each call has a fixed cost, and the int8 and native int4 paths
quantize the input again for every one. Fusing made eager int8 steps and compiled native int4
steps faster, and eager native int4 steps no faster (docs/notes/2026-11-smoothing-and-fused-projections.md,
docs/notes/2026-11-avx2-kernels.md), so `load_model` fuses int8 layers in eager steps and native int4
layers in compiled ones. PyTorch's int4 kernel's layers are never fused (no faster either way).

`shared_input_groups` finds the groups by running a three-token forward and noting which linear
layers receive the very same input tensor. `fuse` quantizes a group's concatenated weights as one
layer (`quantize.quantize` does both) and makes every member a view of it: the first member called
with an input computes the whole group's output, and the others take their slice as long as they
are called with that same tensor (another input is computed afresh, so a model that calls them
differently stays correct). Rows of a weight matrix are quantized independently and the kernels
compute each output column from its own row, so the fused layers give the same bits as the
separate ones (tested). Compiled, every member's trace calls the fused layer and
`compiled.MergeRepeatedCalls` leaves one call of its kernel in the graph.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn


class SharedInput:
    """A group's fused layer and, per thread, the input it last ran on and its outputs per member."""

    def __init__(self, fused: nn.Module, widths: list[int]):
        self.fused, self.widths = fused, widths
        self._last = threading.local()

    def __getstate__(self) -> dict:  # pickled (`model.store`) without the per-thread last output
        return {"fused": self.fused, "widths": self.widths}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["fused"], state["widths"])

    def output(self, x: torch.Tensor, member: int) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a graph holds no state; compiled.MergeRepeatedCalls merges the calls
            return self.fused(x).split(self.widths, dim=-1)[member]
        last = self._last
        if getattr(last, "input", None) is not x:  # holding `x` keeps its identity from being reused
            last.input, last.outputs = x, [part.contiguous() for part in self.fused(x).split(self.widths, dim=-1)]
        return last.outputs[member]


class FusedMember(nn.Module):
    """One projection of a group: its slice of the group's output."""

    def __init__(self, group: SharedInput, member: int, in_features: int, out_features: int):
        super().__init__()
        if member == 0:
            self.fused = group.fused  # registered once, so parameters and `.to()` see it once
        self.group, self.member = group, member
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.member)


def fuse(hf: nn.Module, members: list[str], build: Callable[[nn.Linear], nn.Module]) -> None:
    """Replace the linear layers `members` of `hf` by views of one layer, `build` of their
    concatenation (a quantized layer: its rows are quantized as they would be apart)."""
    layers = [hf.get_submodule(name) for name in members]
    weight = torch.cat([layer.weight.detach() for layer in layers])
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=any(layer.bias is not None for layer in layers))
    with torch.no_grad():
        linear.weight.copy_(weight)
        if linear.bias is not None:
            biases = [torch.zeros(m.out_features) if m.bias is None else m.bias.detach() for m in layers]
            linear.bias.copy_(torch.cat(biases))
    group = SharedInput(build(linear), [layer.out_features for layer in layers])
    for index, (name, layer) in enumerate(zip(members, layers, strict=True)):
        parent, _, attribute = name.rpartition(".")
        setattr(hf.get_submodule(parent), attribute, FusedMember(group, index, layer.in_features, layer.out_features))


def shared_input_groups(hf: nn.Module) -> list[list[str]]:
    """Names of the linear layers that a three-token forward calls with the very same tensor, in
    groups of two or more."""
    names = {module: name for name, module in hf.named_modules() if isinstance(module, nn.Linear)}
    seen: dict[int, tuple[torch.Tensor, list[str]]] = {}  # id(input) -> (input, layer names)

    def note(module: nn.Module, args: tuple) -> None:
        # the input is held until the forward ends, so its id cannot be reused meanwhile
        seen.setdefault(id(args[0]), (args[0], []))[1].append(names[module])

    hooks = [module.register_forward_pre_hook(note) for module in names]
    try:
        with torch.inference_mode():
            hf(input_ids=torch.tensor([[1, 2, 3]], device=next(hf.parameters()).device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    groups = [list(dict.fromkeys(members)) for _, members in seen.values()]
    return [members for members in groups if len(members) > 1]
