"""Does a token's logits depend on what shares its forward? Block logits against 1-token logits.

For each precision (float32, bfloat16, int8, int4), with SDPA attention and with row-invariant
attention (`--exact`): prefill a prompt, feed a 16-token block, then feed the same 16 tokens one
at a time from the same cache; print the largest logit difference, whether the argmaxes agree and
whether the two are bit-equal. Writes benchmarks/results/exactness.json.

    python benchmarks/exactness.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import RESULTS, load_average, log, machine_info, set_threads

from fastforward.evaluation.evaluate import format_table, write_json
from fastforward.model import load_model
from fastforward.model.cache import truncate

PRECISIONS = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantize": "int8"},
    "int4": {"dtype": "float32", "quantize": "int4"},
}


def compare(model, prompt: list[int], block: torch.Tensor) -> dict:
    with torch.inference_mode():
        cache = model.new_cache()
        model.hf(input_ids=torch.tensor([prompt]), **{model.cache_argument: cache}, use_cache=True, logits_to_keep=1)
        together = model.hf(input_ids=block, **{model.cache_argument: cache}, use_cache=True).logits[0].float()
        truncate(cache, len(prompt))
        alone = torch.stack(
            [
                model.hf(input_ids=block[:, i : i + 1], **{model.cache_argument: cache}, use_cache=True)
                .logits[0, 0]
                .float()
                for i in range(block.shape[1])
            ]
        )
    return {
        "max_difference": (together - alone).abs().max().item(),
        "argmax_equal": bool((together.argmax(-1) == alone.argmax(-1)).all()),
        "bit_equal": bool(torch.equal(together, alone)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "exactness.json")
    args = parser.parse_args()
    set_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for name, options in PRECISIONS.items():
        for exact in (False, True):
            model = load_model(args.model, exact=exact, **options)
            prompt = model.encode_prompt("Write a Python function that reverses a linked list, with comments.")
            block = torch.randint(0, 5000, (1, 16), generator=generator)
            rows.append({"precision": name, "attention": "exact" if exact else "sdpa", **compare(model, prompt, block)})
    columns = [
        ("precision", "precision", str),
        ("attention", "attention", str),
        ("max |difference|", "max_difference", lambda v: f"{v:.2e}"),
        ("argmax equal", "argmax_equal", str),
        ("bit-equal", "bit_equal", str),
    ]
    log(format_table(rows, columns))
    write_json(args.out, {"machine": machine_info(load=True), "rows": rows})
    log(f"load average {load_average()}; wrote {args.out}")


if __name__ == "__main__":
    main()
