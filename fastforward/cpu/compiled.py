"""Compiled decoding steps: inductor graphs of the model's forward against a cache, kept on disk.

On a CPU at a few tokens per forward, a small model spends much of a step on hundreds of small
operations per layer (norms, rotary embeddings, casts, cache appends) rather than on its weights;
inductor fuses them into a few kernels (docs/notes/2026-11-compiled-steps.md; today's figures:
docs/results.md, "From a fresh process"). The price is compiling: tracing a 30-layer model and
generating its kernels is slow for every kind of step, and `torch.compile` pays the tracing again in
every process.

So each kind of step (one token or a block; one row or several; with or without a dense mask; at
one torch thread count, which inductor writes into its kernels) is compiled ahead of time with
dynamo's AOT compile (`torch._dynamo.aot_compile`): one graph per kind serves every length (dynamic
shapes), and the graphs are kept as an entry of `fastforward.model.store` (keyed by the model's
files, the setting, this code and the torch version), with inductor's kernels under
$FASTFORWARD_HOME/inductor. A later process reads them back instead of tracing again. On a CPU
the graphs call their kernels from C++ rather than Python (`cpu_wrapper`).
Each graph keeps the guards that tell the kinds apart (the inputs' shapes, dtypes and strides, the
cache's layout), checked before each step; a step no graph accepts compiles a new kind.

The prefill stays eager: it runs once per prompt at that prompt's length, and AR and every decoder
share it. Compiling changes speed, not tokens: inductor's own code for reductions (a norm's mean) and
for trigonometric functions (rotary embeddings) rounds differently from PyTorch's kernels, so those
operations call PyTorch's kernels from the graphs (`eager_rounding`); the fused element-wise code
around them rounds as the separate operations do. A compiled step's logits are then the eager
step's bits (tested for every decoder). With `exact`, attention stays one operation that the compiler
does not look into (the native `fastforward::exact_attention`, or `attention._opaque_attention`
without it), so a token's logits are the same bits in a one-token and in a block forward.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import logging
import os
import re
import shutil
import sys
import time
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch._C._dynamo.guards import GlobalStateGuard
from torch._dynamo.aot_compile import AOTCompiledFunction, aot_compile_fullgraph
from torch._dynamo.guards import CheckFunctionManager
from torch._dynamo.hooks import Hooks
from torch._dynamo.package import load_guard_manager, load_guards_state
from torch._inductor import cpu_vec_isa, decomposition, lowering
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from fastforward.cpu import attention
from fastforward.errors import FastForwardError

NO_ASSERTS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"
# Sizes a graph keeps as constants: heads and head size of the cache's buffers. As symbols, a capacity of
# the same value (64 and 64) would be traced as one with them, and need another graph when it grows.
STATIC_BUFFER_DIMS = (1, 3)
# torch 2.11 has an AOT compile with dynamic shapes, but its graphs fail to load back (missing external
# references) and to trace a marked cache (seen on the GPU check's machine): 2.13 is the first that works.
AOT_COMPILE_WORKS = (
    torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)
    and "dynamic" in inspect.signature(aot_compile_fullgraph).parameters
)


class GraphEntry(Protocol):
    """Where graphs are kept: what compiling needs of a `fastforward.model.store.Store` (this layer
    does not import the model layer)."""

    directory: Path

    def load(self) -> Any: ...

    def save(self, value: Any) -> None: ...


def unavailable(device_type: str) -> str | None:
    """What compiling decoding steps needs and this machine lacks ("needs ..."), or None."""
    compilers = [os.environ.get("CXX"), "c++", "g++", "clang++"]
    if device_type == "cpu" and not any(c and shutil.which(c) for c in compilers):
        return (
            "needs a C++ compiler for torch.compile's CPU kernels and found none (c++, g++, clang++, $CXX): "
            "install one (e.g. apt install g++)"
        )
    if not AOT_COMPILE_WORKS:
        return (
            f"needs dynamo's AOT compile as torch 2.13 has it, and this is torch {torch.__version__}: "
            "install torch 2.13 (pip install torch==2.13.0)"
        )
    return None


def compile_forward(hf: torch.nn.Module, store: GraphEntry | None = None) -> CompiledSteps:
    """The compiled forward of `hf` against a cache; its graphs are read from and kept in `store`."""
    reason = unavailable(next(hf.parameters()).device.type)
    if reason is not None:
        raise FastForwardError(f"--compile {reason}, or leave out --compile")
    eager_rounding()
    logging.getLogger("torch._inductor.ir").addFilter(_NO_SHIM_WARNINGS)
    if hf.config._attn_implementation == attention.NAME:
        # Decided now, not in the first trace: the trace reads the decision as a constant.
        attention.native_kernel()
    if store is not None and os.environ.get(INDUCTOR_CACHE, default_cache_dir()) == default_cache_dir():
        # The kernels a kept graph loads are compiled C++ in inductor's cache, by default in /tmp (where
        # they may be gone: then reading the graphs back compiles those kernels again).
        os.environ[INDUCTOR_CACHE] = str(store.directory.parent / "inductor")
    return CompiledSteps(hf, store)


def inductor_backend(device: torch.device, **overrides: Any) -> Any:
    """The backend steps are compiled with: inductor, dynamic shapes, these options (`overrides` replace
    them: `benchmarks/cpp_wrapper.py` compares wrappers)."""
    options = {
        # Without these the generated wrapper checks every intermediate's shape and alignment,
        # hundreds of calls per step, for shapes the graph itself fixes.
        **NO_ASSERTS,
        "post_grad_custom_pre_pass": MergeRepeatedCalls(),
        **cpu_wrapper(device),
        **overrides,
    }
    return torch._TorchCompileInductorWrapper("default", options, dynamic=True)


def cpu_wrapper(device: torch.device) -> dict[str, bool]:
    """Inductor's options for the code that calls a graph's kernels: on a CPU, C++ (`cpp_wrapper`).
    A step of a 30-layer model calls about 450 kernels and library operations; from the Python
    wrapper each call cost microseconds of interpreter, from C++ next to nothing (SmolLM2-135M int4
    `--exact`, 2 AVX2 cores: compiled `ar` 1.15x, `lookup` 1.12x the tokens/s, the same tokens;
    docs/notes/2026-12-03-cpp-wrapper.md). Its kernels are built apart from the wrapper
    (`cpp_wrapper_build_separate`), in parallel and cached as the Python wrapper's are: built as one
    file, one kind of step took 232 s to compile instead of 45 s; apart, 55 s. GPUs keep the Python
    wrapper (not measured there)."""
    on_cpu = device.type == "cpu"
    return {"cpp_wrapper": on_cpu, "cpp_wrapper_build_separate": on_cpu}


class _NoShimWarnings(logging.Filter):
    """Drops inductor's warning that an operation without a C shim (the eager-rounding `mean`) is called
    through its proxy executor: said once per layer of every graph compiled, and nothing to act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "missing a c-shim implementation" not in record.getMessage()


_NO_SHIM_WARNINGS = _NoShimWarnings()

# Operations inductor would generate its own code for, whose rounding differs from PyTorch's kernels:
# reductions (their order) and trigonometric and error functions (their approximations).
EAGER_ROUNDING_OPS = ("mean", "sum", "var", "var_mean", "cos", "sin", "tanh", "erf")


@functools.cache
def eager_rounding() -> None:
    """Make inductor call PyTorch's own kernels for `EAGER_ROUNDING_OPS` (for every graph this process
    compiles), and round a fused bfloat16 or float16 operation's intermediates as eager's separate
    kernels do, so compiled steps give eager steps' tokens, at a small cost in speed
    (docs/notes/2026-11-26-kept-compiled-steps.md)."""
    for name in EAGER_ROUNDING_OPS:
        packet = getattr(torch.ops.aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            lowering.lowerings.pop(op, None)
            decomposition.decompositions.pop(op, None)
        lowering.make_fallback(packet, warn=False, override_decomp=True)
    torch._inductor.config.emulate_precision_casts = True


class CompiledSteps:
    """The model's forward (keyword arguments, as `Model.run` calls it) through one compiled graph per
    kind of step, compiled at the first step of its kind unless the store already held it."""

    def __init__(self, hf: torch.nn.Module, store: GraphEntry | None):
        self.hf, self.store = hf, store
        self.forward = type(hf).forward
        # What a kept graph refers to but cannot hold: the model, and the functions that transformers'
        # decorators wrap around its forward (pickled by reference, they do not resolve by name).
        self.external: dict[str, Any] = {"model": hf}
        inner = self.forward
        while hasattr(inner, "__wrapped__"):
            inner = inner.__wrapped__
            self.external[f"function{len(self.external)}"] = inner
        self.backend = inductor_backend(next(hf.parameters()).device)
        self.modules: dict[str, str] = {}  # globals the graphs' code names a module by: name -> module
        self.failed = False  # a compile failed: steps no graph serves run eagerly from then on
        # False once a server has prepared its kinds (`serving.warm_up`): a step of a kind it did
        # not meet runs eagerly (the same tokens) rather than hold every request for a minute's compile.
        self.compile_new_kinds = True
        self.said_eager = False
        self.kinds: list[_Kind] = self._read()

    def __call__(self, **inputs: Any) -> Any:
        signature = _signature(inputs)
        for index, kind in enumerate(self.kinds):
            function = self._function(kind) if kind.signature == signature else None
            if function is not None and function.guard_check(self.hf, **inputs):
                if index:  # the kind of the last step first: steps come in runs of one kind
                    self.kinds.insert(0, self.kinds.pop(index))
                return function.fn(self.hf, **inputs)
        if self.failed:  # said once: the steps no graph serves run eagerly
            return self.forward(self.hf, **inputs)
        if not self.compile_new_kinds:
            if not self.said_eager:
                self.said_eager = True
                print("fastforward: a kind of step the warm-up did not prepare runs eagerly", file=sys.stderr)
            return self.forward(self.hf, **inputs)
        # A server compiles its kinds before its first request (`serving.warm_up`); one compiled
        # later holds every request of the moment, so it is said, with what it is and how long it took.
        print(
            f"fastforward: compiling a new kind of decoding step ({_described(inputs)}; kept for later processes)"
            f"{self._other_threads(signature)}...",
            file=sys.stderr,
            flush=True,
        )
        started = time.perf_counter()
        try:
            compiled = self._compile(inputs)
        except Exception as error:  # a model dynamo cannot trace: slower steps, the same tokens
            self.failed = True
            said = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
            print(f"fastforward: could not compile this step ({said}); it runs eagerly", file=sys.stderr)
            return self.forward(self.hf, **inputs)
        self.kinds.insert(0, _Kind(signature, compiled=compiled))
        self._write()
        print(f"fastforward: compiled it in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        return compiled.fn(self.hf, **inputs)

    def _other_threads(self, signature: tuple) -> str:
        """Where this kind is kept for other thread counts only, the flag that reads it back instead."""
        others = sorted(
            {_threads(kind.signature) for kind in self.kinds if _same_but_threads(kind.signature, signature)}
        )
        if not others:
            return ""
        counts = " and ".join(map(str, others))
        plural = "" if others == [1] else "s"
        return f"; the store holds it for {counts} thread{plural} (`--threads {others[0]}` reads it back)"

    def _function(self, kind: _Kind) -> AOTCompiledFunction | None:
        """A kind's graph, read back now if it was not yet; None (said, and the kind forgotten) if it
        cannot be: its steps compile again."""
        try:
            return kind.function(self.external)
        except Exception as error:
            print(f"fastforward: a kept compiled step is unusable ({error}); compiling it again", file=sys.stderr)
            kind.signature = None  # matches no step; not kept at the next write
            return None

    def _compile(self, inputs: dict[str, Any]) -> AOTCompiledFunction:
        buffers = [t for value in inputs.values() for layer in getattr(value, "layers", ()) for t in _buffers(layer)]
        for tensor in buffers:
            for dim in STATIC_BUFFER_DIMS:
                torch._dynamo.mark_static(tensor, dim)
        try:
            # Floats (attention scales) as constants: a traced float would restart the analysis,
            # which an AOT compile does not do.
            with torch._dynamo.config.patch(specialize_float=True):
                kind = aot_compile_fullgraph(
                    self.forward,
                    ((self.hf,), inputs),
                    hooks=Hooks(guard_filter_fn=_kept_guards),
                    backend=self.backend,
                    dynamic=True,
                )
        finally:
            for tensor in buffers:  # marks only shape the trace; a kept graph's guards never saw them
                del tensor._dynamo_static_indices, tensor._has_dynamo_dim_marking
        scope = self.forward.__globals__
        refs = kind._artifacts.runtime_env.external_refs
        self.modules.update({r: scope[r].__name__ for r in refs if isinstance(scope.get(r), types.ModuleType)})
        return kind

    # ---- the store ----------------------------------------------------------------------------
    def _read(self) -> list[_Kind]:
        entry = self.store.load() if self.store is not None else None
        if entry is None:
            return []
        try:
            trust_vector_isas(entry["vector_isas"])
            self.modules = dict(entry["modules"])
            scope = {name: importlib.import_module(module) for name, module in self.modules.items()}
            return [_Kind(signature, data=data, scope=scope) for signature, data in entry["kinds"]]
        except Exception as error:  # made by code this key did not foresee: compile again
            print(
                f"fastforward: compiled steps in {self.store.directory} unusable ({error}); compiling again",
                file=sys.stderr,
            )
            self.modules = {}
            return []

    def _write(self) -> None:
        if self.store is None:
            return
        try:
            kept = [kind for kind in self.kinds if kind.signature is not None]
            kinds = [(kind.signature, kind.serialized(self.external)) for kind in kept]
        except Exception as error:  # a graph that holds what cannot be pickled: it serves this process only
            print(f"fastforward: could not keep the compiled steps ({error})", file=sys.stderr)
            return
        self.store.save({"kinds": kinds, "modules": self.modules, "vector_isas": vector_isas()})


def _signature(inputs: dict[str, Any]) -> tuple:
    """What a kind's guards certainly tell apart, read cheaply from a step's inputs and torch's state:
    which inputs are None or tensors, their dimensions, and which sizes are 1 (dynamo traces a size of 1
    as a constant); and the global state every graph is guarded on, the thread count among it (inductor
    writes it into its kernels). Without the state in it, a process with another thread count found
    every kept kind refused by its guards and compiled them all again beside them. Kinds of another
    signature are not even read back from the store (reading one back is not free)."""
    shapes = tuple(
        (name, tuple(size == 1 for size in value.shape) if isinstance(value, torch.Tensor) else type(value).__name__)
        for name, value in sorted(inputs.items())
    )
    return (("global_state", GlobalStateGuard().__getstate__()), *shapes)


def _threads(signature: tuple | None) -> int | None:
    """The thread count a signature's global state holds (None: not a signature of this form)."""
    try:
        return json.loads(dict(signature[:1])["global_state"])["num_threads"]
    except (TypeError, KeyError, ValueError):
        return None


def _same_but_threads(kept: tuple | None, signature: tuple) -> bool:
    """Whether two signatures differ in their thread count only."""
    if kept is None or _threads(kept) in (None, _threads(signature)) or kept[1:] != signature[1:]:
        return False
    state = {**json.loads(kept[0][1]), "num_threads": _threads(signature)}
    return state == json.loads(signature[0][1])


def _described(inputs: dict[str, Any]) -> str:
    """A step's kind in words, for the message that it compiles: "a block, 2 rows, 1 thread"."""
    rows, tokens = inputs["input_ids"].shape if "input_ids" in inputs else (0, 0)
    threads = torch.get_num_threads()
    return ", ".join(
        [
            "one token" if tokens == 1 else "a block",
            "one row" if rows == 1 else "several rows",
            f"{threads} thread{'s' if threads > 1 else ''}",
        ]
    )


class _Kind:
    """One kind of step: its signature and its graph, read back from the store when first needed."""

    def __init__(self, signature: tuple, compiled: AOTCompiledFunction | None = None, data: bytes = b"", scope=None):
        self.signature: tuple | None = signature
        self.compiled, self.data, self.scope = compiled, data, scope

    def function(self, external: dict[str, Any]) -> AOTCompiledFunction:
        if self.compiled is None:
            # Inference tensors: the steps run in inference mode, and guards compare dispatch keys.
            with torch.inference_mode():
                self.compiled = _KeptKind.deserialize(self.data, self.scope, external)
        return self.compiled

    def serialized(self, external: dict[str, Any]) -> bytes:
        if self.compiled is None:  # never read back: kept as it was read
            return self.data
        return AOTCompiledFunction.serialize(self.compiled, external).serialized_data


class _KeptKind(AOTCompiledFunction):
    """A graph read back from the store. Its guards are rebuilt without the order of the model's
    module dictionaries, which they would read from a model that is not there yet (the graphs skip
    every guard on the model's modules)."""

    def __post_init__(self) -> None:
        artifacts = self._artifacts
        artifacts.check_compatibility()
        self.fn = artifacts.runtime_env.forward_callable(
            artifacts.backend_id, artifacts.compiled_fn, extra_globals=self._extra_globals
        )
        state = load_guards_state(artifacts.guards_state)
        state.output_graph.guard_on_key_order.clear()
        artifacts.guard_manager = load_guard_manager(state, artifacts.original_code, self.fn.__globals__)


def vector_isas() -> list[str]:
    """The vector instruction sets inductor found it can build and load kernels for here (it compiles and
    loads a probe for each, in every process that loads a graph: start-up worth skipping)."""
    return [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]


def trust_vector_isas(found: list[str]) -> None:
    """Skip inductor's probes when the CPU offers exactly the instruction sets they passed for the entry
    being read (same flags: the same answer; the entry's key already holds the torch version)."""
    flags = cpu_vec_isa.x86_isa_checker()
    offered = [str(isa) for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]
    if offered and offered == found:
        torch._inductor.config.cpp.vec_isa_ok = True


def _kept_guards(entries: Sequence[Any]) -> list[bool]:
    """The guards a kept graph checks: those on the step's inputs (tensors' shapes, dtypes and strides,
    the cache's layout) and on global state (grad mode, ...). Not those on the model's modules and
    parameters (thousands, checked before each step, a large share of a one-token step:
    docs/notes/2026-11-avx2-kernels.md; a graph is used with the model it was compiled for), nor on
    module globals and closures, which cannot be kept across processes (the store's key stands for them)."""
    on_modules = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    unkeepable = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    return [
        keep
        and not entry.is_global
        and entry.guard_type not in unkeepable
        and re.match(r"\w*", entry.name).group(0) in ("args", "kwargs", "")
        for keep, entry in zip(on_modules, entries, strict=True)
    ]


def _buffers(layer: Any) -> list[torch.Tensor]:
    found = [getattr(layer, name, None) for name in ("key_buffer", "value_buffer")]
    return [t for t in found if isinstance(t, torch.Tensor)]


class MergeRepeatedCalls(CustomGraphPass):
    """Repeated calls of the native int4 kernels on one input, and the views leading to them, made once.

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
            torch.ops.fastforward.w4a8_lowrank.default,
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
