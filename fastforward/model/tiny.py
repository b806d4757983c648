"""Small randomly initialised llama-style models with a byte-level BPE fitted to given text.

Used by the tests (fast, exact) and by demos that train a model from scratch on a task.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from fastforward.model import Model

EOS, PAD = "<|endoftext|>", "<|pad|>"
DEFAULT_CORPUS = (
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = #",
    "Tom has 3 apples and buys 5 more. How many apples does he have? 3 + 5 = 8\n#### 8",
)


def fit_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `texts` (every byte is covered, so nothing is unknown)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)


def tiny_model(
    texts: Iterable[str] = DEFAULT_CORPUS,
    vocab_size: int = 300,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 512,
    seed: int = 0,
    init_std: float = 0.02,
) -> Model:
    """A random-init llama (fp32, SDPA) with a tokenizer fitted to `texts`.

    A large `init_std` (e.g. 0.5) gives peaked, well-separated predictions: tests use it so that
    greedy choices and reveal orders do not hinge on float rounding between near-ties.
    """
    tokenizer = fit_tokenizer(texts, vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
        initializer_range=init_std,
    )
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(config).eval()
    return Model(hf, tokenizer, name="tiny")
