"""What a recipe's method trains toward: reference completions, or the model's own greedy answers.

Jacobi decoding converges to the model's own greedy output (and `sbd-verified` keeps only what greedy AR
confirms), so a target taken from that output agrees with the AR term; a reference solution (say
GSM8K's) pulls the two apart where a small model would have written something else. `self_answers`
decodes the train prompts in batches with the lossless `ar` decoder at the precision the shipped model
runs at, and appends each batch to a JSONL file as it finishes, so a killed run loses at most one batch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm.auto import tqdm

from fastforward.api import build_decoder
from fastforward.errors import FastForwardError
from fastforward.model import Model
from fastforward.recipes.records import Record
from fastforward.training.data import Example, encode_record

TARGETS = ("self", "reference")


def reference_examples(records: Sequence[Record], model: Model) -> list[Example]:
    """The records' own completions as training examples (through the chat template)."""
    missing = sum(r.completion is None for r in records)
    if missing:
        raise FastForwardError(
            f"--targets reference needs a completion on every train record; {missing} of {len(records)} have none "
            "(use --targets self: the model's own answers)"
        )
    return [encode_record({"prompt": r.prompt, "completion": r.completion}, model.tokenizer) for r in records]


def _written(path: Path) -> list[dict]:
    """The complete lines of an answers file; a line cut short by a killed run is cut off the file."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    good = raw[: raw.rfind(b"\n") + 1]
    if len(good) < len(raw):
        with path.open("r+b") as f:
            f.truncate(len(good))
    return [json.loads(line) for line in good.splitlines() if line.strip()]


def self_answers(
    load: Callable[[], Model], records: Sequence[Record], path: Path, max_new_tokens: int, batch_size: int = 16
) -> list[Example]:
    """The greedy answers of the model `load` gives to the records' prompts (those that end with a stop
    token) as examples; answers already in `path` are kept, the rest decoded and appended batch by batch
    (the model is loaded only when some are missing)."""
    done = _written(path)[: len(records)]
    if len(done) < len(records):
        _decode_missing(load(), records, done, path, max_new_tokens, batch_size)
    kept = [d for d in done if d["finish"] == "stop"]
    if not kept:
        raise FastForwardError(f"none of the model's {len(records)} answers ended within {max_new_tokens} tokens")
    return [_example(d["prompt_ids"], d["response_ids"]) for d in kept]


def _example(prompt: list[int], response: list[int]) -> Example:
    return Example(prompt + response, [False] * len(prompt) + [True] * len(response))


def _decode_missing(
    model: Model, records: Sequence[Record], done: list[dict], path: Path, max_new_tokens: int, batch_size: int
) -> None:
    """Decode the records after the `done` ones with greedy `ar`, appending each batch to `path` and `done`."""
    decoder = build_decoder("ar")
    with path.open("a") as out, tqdm(total=len(records), initial=len(done), desc="own answers", unit="prompt") as bar:
        for start in range(len(done), len(records), batch_size):
            batch = records[start : start + batch_size]
            prompts = [model.encode_prompt(r.prompt) for r in batch]
            generations = decoder.generate(model, prompts, max_new_tokens)
            for index, (prompt, gen) in enumerate(zip(prompts, generations, strict=True), start):
                line = {"index": index, "prompt_ids": prompt, "response_ids": gen.token_ids}
                line["finish"] = gen.finish_reason
                done.append(line)
                out.write(json.dumps(line) + "\n")
            out.flush()
            bar.update(len(batch))
