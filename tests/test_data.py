"""JSONL reading, tokenisation with loss masks, packing and deterministic batching."""

from __future__ import annotations

import json

import pytest
import torch

from fastforward.errors import FastForwardError
from fastforward.model.tiny import fit_tokenizer
from fastforward.training.data import Example, PackedData, encode_record, load_examples, read_jsonl, split_examples

CHAT_TEMPLATE = (
    "{% for m in messages %}<|pad|>{{ m.role }}<|pad|>{{ m.content }}<|endoftext|>{% endfor %}"
    "{% if add_generation_prompt %}<|pad|>assistant<|pad|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return fit_tokenizer(["Tom has 3 apples and buys 5 more. How many? 8", "def add(a, b): return a + b"], 300)


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_text_record_is_all_targets_and_ends_in_eos(tokenizer):
    ex = encode_record({"text": "Tom has 3 apples"}, tokenizer)
    assert ex.ids[-1] == tokenizer.eos_token_id
    assert all(ex.targets)
    assert tokenizer.decode(ex.ids[:-1]) == "Tom has 3 apples"


def test_raw_prompt_completion_learns_only_the_completion(tokenizer):
    ex = encode_record({"prompt": "How many?", "completion": " 8"}, tokenizer)
    prompt = [i for i, t in zip(ex.ids, ex.targets, strict=True) if not t]
    target = [i for i, t in zip(ex.ids, ex.targets, strict=True) if t]
    assert tokenizer.decode(prompt) == "How many?"
    assert target[-1] == tokenizer.eos_token_id and tokenizer.decode(target[:-1]) == " 8"
    assert ex.targets == sorted(ex.targets)  # context first, then targets


def test_chat_template_puts_loss_on_the_assistant_turn_only(tokenizer):
    tokenizer.chat_template = CHAT_TEMPLATE
    try:
        ex = encode_record({"prompt": "How many?", "completion": "8"}, tokenizer)
        raw = encode_record({"prompt": "How many?", "completion": "8"}, tokenizer, chat_template=False)
    finally:
        tokenizer.chat_template = None
    context = tokenizer.decode([i for i, t in zip(ex.ids, ex.targets, strict=True) if not t])
    target = tokenizer.decode([i for i, t in zip(ex.ids, ex.targets, strict=True) if t])
    assert context == "<|pad|>user<|pad|>How many?<|endoftext|><|pad|>assistant<|pad|>"
    assert target == "8<|endoftext|>"
    assert tokenizer.decode(raw.ids) == "How many?8<|endoftext|>"


@pytest.mark.parametrize(
    "bad, reason",
    [
        ("{not json", "not valid JSON"),
        ({"prompt": "a"}, "expected an object"),
        ({"text": "a", "prompt": "b"}, "expected an object"),
        (["text"], "expected an object"),
        ({"text": 3}, "must be a string"),
        ({"prompt": "a", "completion": ""}, "is empty"),
    ],
)
def test_malformed_line_names_file_line_and_reason(tmp_path, bad, reason):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, "", bad])
    with pytest.raises(FastForwardError, match=rf"d\.jsonl:3: .*{reason}"):
        read_jsonl(path)


def test_missing_and_empty_files_are_clear_errors(tmp_path, tokenizer):
    with pytest.raises(FastForwardError, match="does not exist"):
        load_examples(tmp_path / "nope.jsonl", tokenizer)
    with pytest.raises(FastForwardError, match="no records"):
        read_jsonl(write_jsonl(tmp_path / "blank.jsonl", ["", "  "]))


def test_packing_concatenates_and_pads_the_tail():
    examples = [Example([1, 2, 3], [False, True, True]), Example([4, 5, 6, 7], [True] * 4)]
    data = PackedData(examples, seq_len=3, pad_id=0)
    assert data.tokens.tolist() == [[1, 2, 3], [4, 5, 6], [7, 0, 0]]
    assert data.loss_mask.tolist() == [[False, True, True], [True, True, True], [True, False, False]]
    assert data.valid.tolist() == [[True] * 3, [True] * 3, [True, False, False]]


def test_data_shorter_than_one_row_is_padded():
    data = PackedData([Example([5, 6], [True, True])], seq_len=8, pad_id=9)
    assert data.tokens.tolist() == [[5, 6] + [9] * 6]
    assert data.valid.sum() == 2 and data.loss_mask.sum() == 2


def test_no_targets_at_all_is_an_error():
    with pytest.raises(FastForwardError, match="no tokens to learn"):
        PackedData([Example([1, 2], [False, False])], seq_len=4, pad_id=0)


def test_batches_are_a_pure_function_of_seed_and_index():
    examples = [Example(list(range(i * 4, i * 4 + 4)), [True] * 4) for i in range(10)]
    one, two = PackedData(examples, 4, 0), PackedData(examples, 4, 0)
    assert torch.equal(one.batch(7, 3, seed=1).tokens, two.batch(7, 3, seed=1).tokens)
    assert not torch.equal(one.batch(7, 3, seed=1).tokens, one.batch(7, 3, seed=2).tokens)
    # An epoch is a permutation: 10 rows in batches of 2 → each row once in batches 0..4, again in 5..9.
    for epoch in range(2):
        seen = torch.cat([one.batch(i, 2, seed=0).tokens[:, 0] for i in range(epoch * 5, epoch * 5 + 5)])
        assert sorted(seen.tolist()) == [i * 4 for i in range(10)]


def test_split_holds_out_whole_examples_deterministically():
    examples = [Example([i], [True]) for i in range(20)]
    train, held = split_examples(examples, 0.25, seed=3)
    assert len(held) == 5 and len(train) == 15
    assert {e.ids[0] for e in train} | {e.ids[0] for e in held} == set(range(20))
    assert [e.ids for e in split_examples(examples, 0.25, seed=3)[1]] == [e.ids for e in held]
    with pytest.raises(FastForwardError, match="between 0 and 1"):
        split_examples(examples, 1.5, seed=0)
    with pytest.raises(FastForwardError, match="keep any for training"):
        split_examples(examples[:1], 0.5, seed=0)
