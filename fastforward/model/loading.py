"""`load_model`: a model name (`presets.resolve_model_path`) and a `Precision` → a `Model` ready to run
layouts, its quantized weights and compiled steps kept in stores so later loads skip that work."""

from __future__ import annotations

import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from fastforward.cpu import attention as exact_attention
from fastforward.cpu import row_chunks, smoothing
from fastforward.cpu.low_rank import LowRank, add_update
from fastforward.cpu.quantize import keeps_adapters_apart, uses_int8
from fastforward.cpu.quantize import quantize as quantize_linears
from fastforward.errors import FastForwardError
from fastforward.model import adapters, flex, softcap
from fastforward.model.core import MASK_CONFIG_KEY, MASK_TOKEN, Model, grow_embeddings
from fastforward.model.precision import Precision
from fastforward.model.presets import fastforward_home, load_gguf, resolve_model_path
from fastforward.model.saving import quiet_progress
from fastforward.model.store import PACKAGE, Store


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


def _load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    try:
        if path.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, struct.error) as exc:  # truncated files, unsupported architectures
        where = f"the GGUF file {path}" if path.suffix == ".gguf" else path
        raise FastForwardError(f"could not load a causal LM from {where}: {exc}") from exc


def _load_hf(
    path: Path, tokenizer: PreTrainedTokenizerBase, precision: Precision, device: str | None, merged: list[Path]
) -> PreTrainedModel:
    """The model from `path` with the adapters `merged` into its weights, on `device`, at `precision`: its
    dtype, the attention it asks for, its linear layers quantized."""
    dtype, exact = precision.torch_dtype, precision.exact
    if path.suffix == ".gguf":
        hf, _ = load_gguf(path)
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
    updates: dict[str, LowRank] = {}  # linear layers' adapter updates kept beside int4 weights
    for adapter in merged:  # before quantizing: the merged weights are what gets quantized
        hf, apart = adapters.split(hf, adapter, keep_apart=keeps_adapters_apart(precision.quantize))
        for name, update in apart.items():
            add_update(updates, name, update)
    hf.to(dtype=dtype)
    # SDPA or FlexAttention (`precision.attention`), or row-invariant attention for --exact; soft-capped attention
    # (Gemma 2) needs its own
    plain = exact_attention.NAME if exact else flex.implementation(precision.attention)
    hf.config._attn_implementation = softcap.attention_for(hf.config, exact) or plain
    if device:
        hf.to(device)
    hf.eval()
    calibration = smoothing.calibration_ids(tokenizer) if uses_int8(hf, precision.quantize) else None
    quantize_linears(hf, precision.quantize, fuse=precision.fuse, calibration=calibration, low_rank=updates)
    return hf


def load_model(
    name_or_path: str, *, device: str | None = None, precision: Precision | None = None, **options: Any
) -> Model:
    """Load a preset, a Hugging Face model directory or a GGUF file, ready to run layouts.

    precision: how it computes (`Precision`: dtype, quantization, attention, compiled steps, CUDA graphs,
    an adapter); `options` set fields of it by name, so `load_model(path, dtype="bfloat16")` is
    `load_model(path, precision=Precision(dtype="bfloat16"))`. A `name_or_path` that is itself an adapter
    directory loads the base it names with it merged.
    """
    precision = replace(precision or Precision(), **options)  # checked here, before the load takes seconds
    check_device(device)
    path, merged = adapters.resolve_chain(resolve_model_path(name_or_path), resolve_model_path)
    if precision.adapter is not None:
        merged.append(adapters.check_adapter(Path(precision.adapter).expanduser()))
    tokenizer = _load_tokenizer(next((a for a in reversed(merged) if adapters.has_tokenizer(a)), path))
    quantize, exact = precision.quantize, precision.exact
    setting = {"dtype": precision.torch_dtype, "scheme": quantize, "exact": exact, "fuse": precision.fuse}
    if merged:
        setting["adapters"] = adapters.digest(merged)
    store = None
    if quantize != "none" and device in (None, "cpu") and precision.attention != "flex":
        store = Store(fastforward_home(), "quantized", path, **setting)
    hf = store.load() if store is not None else None
    if hf is None:
        hf = _load_hf(path, tokenizer, precision, device, merged)
        if store is not None:
            store.save(hf)  # quantized once: the next load at this setting reads it back
    if exact:
        row_chunks.chunk_rows(hf)  # bfloat16 GEMMs round by row count
    model = Model(hf, tokenizer, name=name_or_path)
    model.adapter = precision.adapter
    if precision.compile:  # kept per model and setting; the graphs trace fastforward's model code too (the cache)
        code = (PACKAGE / "cpu", PACKAGE / "model")
        setting.update(device=device or "cpu", attention=hf.config._attn_implementation)
        model.compile_steps(Store(fastforward_home(), "compiled", path, code, "compiling again", **setting))
    on_gpu = model.device.type == "cuda"
    cuda_graphs = precision.cuda_graphs
    if cuda_graphs is None:
        cuda_graphs = on_gpu and not precision.compile and model.fits_step_graphs
    if cuda_graphs:
        if not on_gpu:
            raise FastForwardError("CUDA graphs need a CUDA --device; leave out --cuda-graphs on this one")
        model.use_step_graphs()
    return model
