"""Load any Hugging Face causal LM, give it a mask token, and run layouts against its KV cache.

A *layout* is everything one forward pass needs: tokens, their RoPE positions, a boolean
visibility rule over (query, key) pairs — keys being the cached entries followed by the new
tokens — the positions whose logits are read, and how many of the new entries are kept in the
cache. Every method in fastforward, training and decoding, is a way of building layouts.

One job a module: `core` (the model and its layouts), `precision` (how it computes), `presets` (where a
name leads), `loading` (`load_model`), `saving` (atomic model directories); the names below are theirs
and, for what loads by name, `fastforward.shipped`'s.
"""

from fastforward.model.core import MASK_CONFIG_KEY, MASK_TOKEN, Layout, Model, grow_embeddings
from fastforward.model.loading import check_device, load_model
from fastforward.model.precision import DTYPES, ON_GPU, Precision
from fastforward.model.presets import fastforward_home, preset_names, resolve_model_path
from fastforward.model.saving import quiet_progress, save_atomically
from fastforward.shipped import PRESETS, SHIPPED_ADAPTERS, SHIPPED_CHECKPOINTS

__all__ = [
    "DTYPES",
    "MASK_CONFIG_KEY",
    "MASK_TOKEN",
    "ON_GPU",
    "PRESETS",
    "SHIPPED_ADAPTERS",
    "SHIPPED_CHECKPOINTS",
    "Layout",
    "Model",
    "Precision",
    "check_device",
    "fastforward_home",
    "grow_embeddings",
    "load_model",
    "preset_names",
    "quiet_progress",
    "resolve_model_path",
    "save_atomically",
]
