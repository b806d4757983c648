"""How often an SBD model's masked predictions agree with its own greedy AR output, by confidence.

For held-out `arithmetic` prompts, the model's greedy AR output y is the reference. At cut points t
of y, one block of `--block-size` positions starting at t is run the way `sbd` decoding runs it:

- fresh: every position masked, the context [prompt, y<t] in the cache (a block's first forward);
- commit: the same, with y[t-k:t] riding causally in front of the block (SBD's commit forward);
- partial: each position masked with probability `--mask-rate`, the others holding y's tokens
  (a block some forwards into decoding).

Each masked position's greedy prediction is compared with y at that position, grouped by the
prediction's confidence (max probability). A calibrated model is right about as often as it is
confident; the reveal rules trust exactly that.

    python benchmarks/sbd_calibration.py --model runs/sbd_vs_ntp_4800/sbd

Prints a table and writes benchmarks/results/sbd_calibration.json (with the machine and its load
average).
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import RESULTS, machine_info, set_threads

from fastforward.decoding.decoders import ARDecoder
from fastforward.decoding.runtime import start
from fastforward.decoding.steps import span
from fastforward.evaluation.report import format_table, write_json
from fastforward.model import load_model, visibility
from fastforward.tasks import get_task

BINS = ((0.999, "> 0.999"), (0.99, "0.99–0.999"), (0.9, "0.9–0.99"), (0.0, "≤ 0.9"))
KINDS = ("fresh", "commit", "partial")
DEFAULT_TASK = ["min_ops=2", "max_ops=3", "max_number=20", "max_factor=5"]  # the arithmetic runs of docs/results.md


def bin_of(confidence: float) -> str:
    return next(label for bound, label in BINS if confidence > bound or bound == 0.0)


def run_block(model, context: list[int], pending: list[int], block: torch.Tensor) -> torch.Tensor:
    """Logits [k, V] of `block` after `context` (cached) and `pending` (causal, in the same forward)."""
    session = start(model, [context], 1)
    commit, size = len(pending), block.shape[1]
    tokens = torch.cat([torch.tensor([pending], dtype=torch.long), block], dim=1)
    positions = span(session, 0, commit + size)
    rule = visibility.sbd_decode(commit, size)
    logits = session.forward(tokens, positions, rule, read=range(commit, commit + size))
    session.advance(keep=commit)
    return logits[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="an SBD-trained model directory")
    ap.add_argument("--n", type=int, default=40, help="held-out prompts")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--stride", type=int, default=7, help="tokens between cut points")
    ap.add_argument("--mask-rate", type=float, default=0.6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--task-option", action="append", metavar="NAME=VALUE", help="arithmetic knob (repeatable)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "sbd_calibration.json"))
    args = ap.parse_args(argv)
    set_threads(args.threads)
    options = dict(o.split("=", 1) for o in args.task_option or DEFAULT_TASK)
    task = get_task("arithmetic", **{k: int(v) for k, v in options.items()})
    model = load_model(args.model)
    mask_id = model.require_mask_token("sbd")
    k = args.block_size
    generator = torch.Generator().manual_seed(0)
    hits: dict[tuple[str, str], list[int]] = {(kind, label): [0, 0] for kind in KINDS for _, label in BINS}
    with torch.inference_mode():
        for example in task.examples("test", args.n, seed=0):
            prompt = model.encode_prompt(example.prompt, chat_template=False)
            y = ARDecoder().generate(model, [prompt], args.max_new_tokens)[0].token_ids
            for t in range(k, len(y) - k, args.stride):
                truth = torch.tensor(y[t : t + k])
                partial = torch.rand(k, generator=generator) < args.mask_rate
                layouts = {
                    "fresh": ([], torch.ones(k, dtype=torch.bool)),
                    "commit": (y[t - k : t], torch.ones(k, dtype=torch.bool)),
                    "partial": ([], partial),
                }
                for kind, (pending, masked) in layouts.items():
                    block = torch.where(masked, mask_id, truth)[None]
                    context = prompt + y[: t - len(pending)]
                    probs = run_block(model, context, pending, block).softmax(-1)
                    confidence, guess = probs.max(-1)
                    for i in masked.nonzero()[:, 0].tolist():
                        cell = hits[(kind, bin_of(float(confidence[i])))]
                        cell[0] += int(guess[i] == truth[i])
                        cell[1] += 1
    rows = [
        {"layout": kind, "confidence": label, "right": right, "n": n, "rate": 100 * right / n if n else None}
        for (kind, label), (right, n) in hits.items()
    ]
    print(
        format_table(
            rows,
            [
                ("layout", "layout", str),
                ("confidence", "confidence", str),
                ("predictions", "n", str),
                ("= greedy AR %", "rate", lambda x: f"{x:.1f}"),
            ],
        )
    )
    write_json(args.out, {"machine": machine_info(load=True), "args": vars(args), "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
