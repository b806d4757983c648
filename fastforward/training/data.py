"""Training data: JSONL records → token ids with a loss mask → fixed-length packed rows → batches.

A record is either {"prompt", "completion"} (loss on the completion only; the tokenizer's chat
template is applied when it has one) or {"text"} (loss on every token). Examples are concatenated,
each ending in an end-of-sequence token, and cut into rows of `seq_len` tokens; rows may straddle
examples (ordinary packing: tokens attend across the boundary). The last row is padded with the pad
token, which never carries loss and is never attended to.

The batch for a given index is a pure function of (seed, index), so resuming a run needs only the
step number. Each row of a batch carries its place in the endless stream of rows (`Batch.ids`):
objectives seed a row's random draws with it, so a row draws the same masks whichever process or
micro-batch it lands in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from fastforward import jsonl
from fastforward.errors import FastForwardError

RECORD_KINDS = ({"prompt", "completion"}, {"text"})


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from several parts (seed, epoch, step, …): independent streams, stable across runs."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class Example:
    """Token ids of one record and, per token, whether it is a prediction target."""

    ids: list[int]
    targets: list[bool]


@dataclass
class Batch:
    """Rows of packed tokens [B, L]; `loss_mask`: token is a prediction target; `valid`: not padding;
    `ids`: each row's place in the data stream (default 0..B-1), which seeds its random draws."""

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    valid: torch.Tensor
    ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.ids is None:
            self.ids = list(range(self.tokens.shape[0]))

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.tokens.to(device), self.loss_mask.to(device), self.valid.to(device), self.ids)

    def row(self, r: int) -> Batch:
        """Row `r` alone, as a batch of one."""
        return Batch(self.tokens[r : r + 1], self.loss_mask[r : r + 1], self.valid[r : r + 1], self.ids[r : r + 1])

    @property
    def n_tokens(self) -> int:
        return int(self.valid.sum())


# ---- reading ------------------------------------------------------------------------------------
def read_jsonl(path: str | Path) -> list[dict[str, str]]:
    """Validated records of a JSONL file; any bad line raises with the file, line number and reason."""
    lines = jsonl.read_jsonl(path, "data file", "give a JSONL file of prompt/completion or text lines")
    return [_check_record(record, f"{path}:{number}") for number, record in lines]


def _check_record(record: dict, where: str) -> dict[str, str]:
    if set(record) not in RECORD_KINDS:
        raise FastForwardError(
            f"{where}: expected an object with keys 'prompt' and 'completion', or only 'text'; got {sorted(record)}"
        )
    for key, value in record.items():
        if not isinstance(value, str):
            raise FastForwardError(f"{where}: {key!r} must be a string, got {type(value).__name__}")
        if not value:
            raise FastForwardError(f"{where}: {key!r} is empty")
    return record


# ---- tokenizing ---------------------------------------------------------------------------------
def _chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _plain(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_record(record: dict[str, str], tokenizer: PreTrainedTokenizerBase, chat_template: bool = True) -> Example:
    """Token ids and targets of one record (see the module docstring)."""
    if "prompt" in record and chat_template and getattr(tokenizer, "chat_template", None):
        user = [{"role": "user", "content": record["prompt"]}]
        prompt = _chat_ids(tokenizer, user, generation_prompt=True)
        full = _chat_ids(tokenizer, [*user, {"role": "assistant", "content": record["completion"]}], False)
        shared = next((i for i, (a, b) in enumerate(zip(prompt, full, strict=False)) if a != b), len(prompt))
        return Example(full, [i >= shared for i in range(len(full))])
    if tokenizer.eos_token_id is None:
        raise FastForwardError("the tokenizer has no end-of-sequence token; set tokenizer.eos_token first")
    # Special tokens the tokenizer puts around any text (e.g. BOS) are context, never targets.
    prefix = [i for i in tokenizer("", add_special_tokens=True)["input_ids"] if i != tokenizer.eos_token_id]
    if "prompt" in record:
        context, target = prefix + _plain(tokenizer, record["prompt"]), _plain(tokenizer, record["completion"])
    else:
        context, target = prefix, _plain(tokenizer, record["text"])
    target.append(tokenizer.eos_token_id)
    return Example(context + target, [False] * len(context) + [True] * len(target))


def load_examples(path: str | Path, tokenizer: PreTrainedTokenizerBase, chat_template: bool = True) -> list[Example]:
    return [encode_record(r, tokenizer, chat_template) for r in read_jsonl(path)]


def split_examples(examples: Sequence[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Hold out a seeded random `fraction` of examples (whole examples, so nothing leaks): (train, held out)."""
    if not 0 < fraction < 1:
        raise FastForwardError(f"the eval fraction must be between 0 and 1, got {fraction}")
    held = max(1, round(len(examples) * fraction))
    if held >= len(examples):
        raise FastForwardError(
            f"cannot hold out {fraction:.0%} of {len(examples)} examples and keep any for training; "
            "give more data or a separate --eval-data file"
        )
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(derive_seed(seed, "split")))
    chosen = set(order[:held].tolist())
    return (
        [e for i, e in enumerate(examples) if i not in chosen],
        [e for i, e in enumerate(examples) if i in chosen],
    )


# ---- packing and batching -----------------------------------------------------------------------
class PackedData:
    """Examples concatenated and cut into rows of `seq_len` tokens; the tail row is padded."""

    def __init__(self, examples: Sequence[Example], seq_len: int, pad_id: int):
        if seq_len < 2:
            raise FastForwardError(f"seq_len must be at least 2, got {seq_len}")
        if not examples:
            raise FastForwardError("no examples to pack")
        ids = torch.tensor([t for e in examples for t in e.ids], dtype=torch.long)
        targets = torch.tensor([t for e in examples for t in e.targets], dtype=torch.bool)
        rows = -(-len(ids) // seq_len)
        pad = rows * seq_len - len(ids)
        self.seq_len = seq_len
        self.tokens = torch.cat([ids, ids.new_full((pad,), pad_id)]).view(rows, seq_len)
        self.loss_mask = torch.cat([targets, targets.new_zeros(pad)]).view(rows, seq_len)
        self.valid = torch.arange(rows * seq_len).view(rows, seq_len) < len(ids)
        if int(self.loss_mask.sum()) == 0:
            raise FastForwardError("the data has no tokens to learn from (every completion is empty)")

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, index: torch.Tensor, ids: range) -> Batch:
        return Batch(self.tokens[index], self.loss_mask[index], self.valid[index], list(ids))

    def batch(self, index: int, batch_size: int, seed: int) -> Batch:
        """The `index`-th batch of an endless stream: epoch e visits the rows in a permutation seeded by (seed, e).

        Its rows are the stream's rows index·B … (index+1)·B − 1, so batch i of size B holds the rows of
        batches 2i and 2i+1 of size B/2: how a step's rows are split into batches changes no row."""
        n = len(self)
        samples = range(index * batch_size, (index + 1) * batch_size)
        orders = {epoch: self._order(seed, epoch) for epoch in {s // n for s in samples}}
        return self.rows(torch.stack([orders[s // n][s % n] for s in samples]), samples)

    def in_order(self, batch_size: int) -> Iterator[Batch]:
        """Every row once, in order (evaluation)."""
        for start in range(0, len(self), batch_size):
            stop = min(start + batch_size, len(self))
            yield self.rows(torch.arange(start, stop), range(start, stop))

    def _order(self, seed: int, epoch: int) -> torch.Tensor:
        return torch.randperm(len(self), generator=torch.Generator().manual_seed(derive_seed(seed, epoch)))

    def fingerprint(self) -> str:
        """A hash of the packed tokens and loss mask: a resumed run must see the same data."""
        h = hashlib.sha256(self.tokens.numpy().tobytes())
        h.update(self.loss_mask.numpy().tobytes())
        return h.hexdigest()[:16]
