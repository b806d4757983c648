"""Compiled decoding steps: `torch.compile` (inductor) over the model's forward against a cache.

On a CPU at a few tokens per forward, a small model spends much of a step on hundreds of small
operations per layer (norms, rotary embeddings, casts, cache appends) rather than on its weights;
inductor fuses them into a few kernels (figures and their command: docs/results.md, "Compiled
steps"). The price is a warm-up: the first forward of each kind (one token, then a block) compiles
a graph, tens of seconds on a 2-core CPU, less when inductor's on-disk cache already holds it.

The prefill stays eager: it runs once per prompt at that prompt's length, and AR and every decoder
share it. Compiled kernels round differently from eager ones, so a compiled model's tokens are its
own (as a dtype's are). With `exact`, attention stays one operation that the compiler does not look
into (the native `fastforward::exact_attention`, or `attention._opaque_attention` without it) and a
token's logits are the same bits in a one-token and in a block forward of the compiled model
(tested), so verifying decoders still give greedy AR's tokens.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from fastforward.cpu import attention
from fastforward.errors import FastForwardError

NO_ASSERTS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}


def compile_forward(hf: torch.nn.Module) -> Callable:
    """The compiled forward; one graph serves every block length and cache length (dynamic shapes).

    The model must not change once compiled: its graphs skip the guards on its modules, parameters
    and configuration (`Model.add_mask_token` compiles again), and keep them apart from any other
    model's graphs."""
    compilers = [os.environ.get("CXX"), "c++", "g++", "clang++"]
    if next(hf.parameters()).device.type == "cpu" and not any(c and shutil.which(c) for c in compilers):
        raise FastForwardError(
            "--compile needs a C++ compiler for torch.compile's CPU kernels and found none (c++, g++, clang++, "
            "$CXX): install one (e.g. apt install g++) or leave out --compile"
        )
    # Past the recompile limit torch.compile would silently run eager forwards beside compiled ones,
    # whose logits round differently: fail loudly instead.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    # Graphs differ by kind, not by length: one token or a block, with or without a dense mask, one row
    # or several, a cache of one entry (a one-token prompt). Far fewer than this limit.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    if hf.config._attn_implementation == attention.NAME:
        # Decided now, not in the first trace: a decision made there changes a global that the graph
        # guards on, so the second step would compile the graph again (about twice the warm-up).
        attention.native_kernel()
    options = {
        # Without these the generated wrapper checks every intermediate's shape and alignment in
        # Python, hundreds of calls per step, for shapes the graph itself fixes.
        **NO_ASSERTS,
        "post_grad_custom_pre_pass": MergeRepeatedCalls(),
        # Checking the guards on every module attribute and parameter (thousands) before each step cost
        # 12-15 % of a one-token int4 step (docs/notes/2026-11-avx2-kernels.md). Graphs of this call are kept
        # apart from other compiled models' (isolate_recompiles), which those guards told apart.
        "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
    }
    return torch.compile(hf, dynamic=True, options=options, isolate_recompiles=True)


class MergeRepeatedCalls(CustomGraphPass):
    """Repeated calls of the native int4 kernel on one input, and the views leading to them, made once.

    A fused layer (`fastforward.cpu.fusion`) is called by each of its members, so a traced step calls its
    kernel two or three times on the very same tensors. Inductor does not merge calls of a custom
    operator; this pass (an inductor post-grad pass) does. The kernel is pure and views alias, so the
    merged graph computes the same bits.
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        targets = {
            torch.ops.aten.view.default,
            torch.ops.aten.reshape.default,
            torch.ops.aten._unsafe_view.default,
            torch.ops.fastforward.w4a8_linear.default,
        }
        first: dict[tuple, torch.fx.Node] = {}
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in targets:
                continue
            key = (node.target, _frozen(node.args), _frozen(node.kwargs))
            if key in first:
                node.replace_all_uses_with(first[key])
                graph.erase_node(node)
            else:
                first[key] = node

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


def _frozen(value: object) -> object:
    """Arguments as a hashable key (lists of sizes become tuples)."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value
