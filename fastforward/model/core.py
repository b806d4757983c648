"""Load any Hugging Face causal LM, give it a mask token, and run layouts against its KV cache.

A *layout* is everything one forward pass needs: tokens, their RoPE positions, a boolean
visibility rule over (query, key) pairs — keys being the cached entries followed by the new
tokens — and the positions whose logits are read. Its new entries all enter the cache; which of
them stay is the caller's choice (`KVCache.keep`, `KVCache.truncate`). Every method in fastforward,
training and decoding, is a way of building layouts.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers.modeling_utils
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fastforward.cpu import attention as exact_attention
from fastforward.cpu.quantize import prefill_kernels
from fastforward.errors import FastForwardError
from fastforward.model import flex, softcap, step_graphs, visibility, windows
from fastforward.model.cache import KVCache
from fastforward.model.head import HeadRows
from fastforward.model.saving import save_atomically
from fastforward.model.step_graphs import StepGraphs
from fastforward.model.store import Store

MASK_TOKEN = "<|mask|>"
MASK_CONFIG_KEY = "fastforward_mask_token_id"
# transformers >= 5.2x takes a [B, T] boolean `logits_to_keep` (each row its own slots, flattened); older ones
# take the positions kept in every row, so a row's slots are then projected wherever any row needs them.
MASKED_KEEP = hasattr(transformers.modeling_utils, "slice_logits_to_keep")
# Config fields of families that change logits after the output layer (Gemma 2/3, Cohere, Granite)
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@dataclass
class Layout:
    """One forward pass: what to feed, where it sits, who sees whom, what to read.

    tokens, positions: [B, T]. visibility: [B, T, P + T] booleans (True = may attend), where P is
    the number of entries already in the cache; None means plain causal over unpadded rows (the
    model's own fast path). read: indices into T whose logits are returned (None: none).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    visibility: torch.Tensor | None
    read: torch.Tensor | None = None


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
        """Execute a layout against `cache`, appending its new entries (a caller that keeps fewer cuts
        them after: `KVCache.keep`, `KVCache.truncate`).

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
        """Last hidden states [B, T, H] of an uncached layout (what losses read: `outputs_at`)."""
        return self.hf.get_decoder()(
            input_ids=layout.tokens,
            position_ids=layout.positions,
            attention_mask=self._masks(layout, None, 0),
            use_cache=False,
        ).last_hidden_state

    @property
    def plain_head(self) -> torch.Tensor | None:
        """The output layer's weight [V, H] when logits are hidden states times it and nothing more (no bias,
        no soft-capping or scale after it), else None: what `outputs_at` may project a chunk at a time."""
        layer = self.hf.get_output_embeddings()
        config = getattr(self.hf.config, "get_text_config", lambda: self.hf.config)()
        changed = any(getattr(config, name, None) not in (None, 1, 1.0) for name in LOGIT_TRANSFORMS)
        if changed or not isinstance(layer, torch.nn.Linear) or layer.bias is not None:
            return None
        # a weight sharded by FSDP is whole only inside its module's forward: those models keep their logits
        weight = layer.weight
        return weight if type(weight.data) is torch.Tensor and weight.dim() == 2 and weight.numel() else None

    def outputs_at(self, layout: Layout, *slots: tuple[torch.Tensor, torch.Tensor]) -> list[HeadRows]:
        """What a training loss reads at each set of N (row, slot) pairs of an uncached layout: the hidden
        states there under a plain output layer (`fastforward.model.head` projects them a chunk at a time,
        with the loss), else the model's own logits there (`logits_at`)."""
        weight = self.plain_head
        if weight is None:
            return [HeadRows(logits=logits) for logits in self.logits_at(layout, *slots)]
        hidden = self.hidden_states(layout)
        return [HeadRows(hidden[rows, columns], weight) for rows, columns in slots]

    def logits_at(self, layout: Layout, *slots: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
        """Float32 logits [N, V] of an uncached layout at each set of N (row, slot) pairs (training: a loss
        reads only the slots it needs), from the model's own forward: its output layer runs on those slots
        only (`logits_to_keep`), and whatever its family applies after it (Gemma's final soft-capping,
        Cohere's and Granite's logit scales) is applied as in decoding."""
        batch, length = layout.tokens.shape
        keep = torch.zeros(batch, length, dtype=torch.bool, device=layout.tokens.device)
        for rows, columns in slots:
            keep[rows, columns] = True
        if MASKED_KEEP:  # every kept slot once, row by row: the k-th True of `keep` is the k-th row of logits
            logits, place = self._training_logits(layout, keep), keep.flatten().cumsum(0) - 1
            return [logits[place[rows * length + columns]].float() for rows, columns in slots]
        kept = keep.any(dim=0)
        logits, place = self._training_logits(layout, kept.nonzero().flatten()), kept.cumsum(0) - 1
        return [logits[rows, place[columns]].float() for rows, columns in slots]

    def _training_logits(self, layout: Layout, keep: torch.Tensor) -> torch.Tensor:
        return self.hf(
            input_ids=layout.tokens,
            position_ids=layout.positions,
            attention_mask=self._masks(layout, None, 0),
            use_cache=False,
            logits_to_keep=keep,
        ).logits

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
            seen = visibility.over_cache(visibility.causal(length, layout.tokens.device), past, batch=batch)
        return windows.masks(self.window, seen, queries, keys)

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
