"""Training tokens/s per objective: the trainer as it was (float32, every weight) against its settings now.

Contenders, each a `fastforward.training.trainer.train` run from a freshly loaded model, interleaved
round by round in one process, their order rotating from round to round (the machine's load moves the
figures; the ratios within a round hold):

- `float32`: the trainer as it was on a CPU: float32 weights and arithmetic, every weight trained, and
  torch's default (foreach) AdamW in place of the fused one it uses now;
- `bf16`: float32 master weights, bf16 autocast (the CLI's default here when the CPU has AVX-512 BF16
  or AMX, and on GPUs);
- `bf16+lora`: the same with a LoRA adapter of rank 16 on every linear layer (`--lora-rank 16`): the
  frozen weights need no weight gradients and no optimizer state;
- `float32+lora`: that adapter in float32, what the recipes train with where the CPU has no bf16, its
  losses read from whole logits (the trainer before `fastforward.model.head`);
- `float32+lora+head`: the same with the output layer and its loss a chunk of rows at a time (the trainer now);
- `float32+lora+top10`, `+top15`: that, with LoRA on the top 10 or 15 decoder layers only (`--lora-layers`):
  the backward pass stops at the lowest adapted layer.

`--isolated` runs each in a process of its own and reports its peak resident memory (VmHWM): in one process
the peak would count what earlier runs left allocated.

Several `--seq-len`s compare row lengths at equal tokens per step: `--batch-size` rows at the first
length, as many tokens a step at the others (`--seq-len 512 256` runs 4 x 512 against 8 x 256). An
objective's attention grows with the square of its row (`sbd`, `multitf`, `setdlm` attend over two
copies of it), so on a CPU short rows can train faster per token.

Rows: `ntp`, `sbd`, `multitf` and `setdlm` train on `pycode` records packed into rows of --seq-len;
`jacobi_forcing` on trajectory-shaped rows cut from the same text (a 96-token prompt, then blocks of
16 whose fixed points are the next tokens and whose earlier states replace a share of them with other
tokens of the text): a training step's cost does not depend on the token values, and collecting real
trajectories would take most of the benchmark's time. Those rows are all of one length; `--jf-lengths
varied` draws each row's prompt (48-96 tokens) and block count (2-8) and ends its response at a stop
token inside the last block, as real responses do, so that the rows of a batch differ in length.
tokens/s counts the tokens the model reads in a step, the trainer's own measure (padding not counted):
`jacobi_forcing` the prompt and both copies of every block; `sbd`, `multitf` and `setdlm` each row twice, the
clean row and its masked copy (since 2026-12-02; figures from before counted those rows once). The first
step of each run is left out (allocations, one-time set-up).

    python benchmarks/train_speed.py                       # SmolLM2-135M, every objective, 3 rounds
    python benchmarks/train_speed.py --objectives jacobi_forcing --rounds 5
    python benchmarks/train_speed.py --model tiny --rounds 1  # that it runs, in seconds
    python benchmarks/train_speed.py --objectives jacobi_forcing --contenders bf16+lora --jf-lengths varied
    python benchmarks/train_speed.py --objectives sbd --contenders float32+lora --seq-len 512 256 --batch-size 2

Target (issue 52): `jacobi_forcing` at least 2x the float32 trainer's tokens/s on SmolLM2.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch
from common import RESULTS, load_average, log, set_threads, write_report

from fastforward.model import Model, load_model
from fastforward.model.tiny import tiny_model
from fastforward.tasks import get_task
from fastforward.training.data import PackedData, encode_record
from fastforward.training.objectives import make_objective
from fastforward.training.trainer import TrainConfig, train
from fastforward.training.trajectories.dataset import TrajectoryData
from fastforward.training.trajectories.records import Block, Trajectory

ADAMW = torch.optim.AdamW
OBJECTIVES = ("ntp", "sbd", "multitf", "setdlm", "jacobi_forcing")
WHOLE = {"whole_logits": True}  # losses from whole logits, as before `fastforward.model.head`
CONTENDERS = {
    "float32": {"mixed_precision": "no", "fused_adamw": False, **WHOLE},
    "bf16": {"mixed_precision": "bf16", **WHOLE},
    "bf16+lora": {"mixed_precision": "bf16", "lora_rank": 16, **WHOLE},
    "float32+lora": {"mixed_precision": "no", "lora_rank": 16, **WHOLE},  # the recipes' setting without bf16
    "float32+lora+head": {"mixed_precision": "no", "lora_rank": 16},
    "float32+lora+top10": {"mixed_precision": "no", "lora_rank": 16, "lora_layers": 10},
    "float32+lora+top15": {"mixed_precision": "no", "lora_rank": 16, "lora_layers": 15},
    "bf16+lora+top10": {"mixed_precision": "bf16", "lora_rank": 16, "lora_layers": 10},
}
BASELINE = "float32+lora"


def fresh_model(name: str):
    return tiny_model(seed=0) if name == "tiny" else load_model(name)


def text_ids(model, n_records: int) -> list[list[int]]:
    records = get_task("pycode").training_records(n_records, seed=0)
    return [model.tokenizer(r["prompt"] + r["completion"])["input_ids"] for r in records]


def trajectory_rows(
    ids: list[list[int]], n: int, prompt: int = 96, blocks: int = 8, size: int = 16, stop: int | None = None
) -> list:
    """Trajectory-shaped examples from real text: states replace 3/4, 1/2 and 1/4 of a block's tokens.
    With a `stop` token: each row's prompt of 48 to `prompt` tokens, 2 to `blocks` blocks, and the stop token
    at a random place of the last block (training cuts the response after it)."""
    flat = [t for row in ids for t in row if t != stop]
    rng = random.Random(0)
    out = []
    for i in range(n):
        length, count = (prompt, blocks) if stop is None else (rng.randint(48, prompt), rng.randint(2, blocks))
        start = rng.randrange(0, len(flat) - length - count * size)
        text = flat[start : start + length + count * size]
        if stop is not None:
            text[len(text) - rng.randint(1, size)] = stop
        made = []
        for b in range(count):
            fixed = text[length + b * size : length + (b + 1) * size]
            states = [[rng.choice(flat) if rng.random() < share else t for t in fixed] for share in (0.75, 0.5, 0.25)]
            made.append(Block(states, fixed))
        out.append(Trajectory(text[:length], made, size, index=i))
    return out


def dataset(objective: str, model, ids: list[list[int]], seq_len: int, varied: bool = False):
    if objective == "jacobi_forcing":
        stop = model.stop_token_ids[0] if varied else None
        return TrajectoryData(trajectory_rows(ids, 64, stop=stop), seq_len * 2)
    examples = [encode_record({"text": model.tokenizer.decode(row)}, model.tokenizer) for row in ids]
    return PackedData(examples, seq_len, model.pad_token_id)


def foreach_adamw(*args, fused=None, **kwargs) -> torch.optim.AdamW:
    """torch's AdamW without the trainer's `fused=True`: the optimizer the trainer used before."""
    return ADAMW(*args, **kwargs)


def one_run(args, objective: str, options: dict, work: Path, seq_len: int) -> tuple[float, float | None]:
    """Median tokens/s over the steps after the first of one `train` run, rows of `seq_len` (and no peak memory:
    `isolated_run` measures it)."""
    options = dict(options)
    if not options.pop("fused_adamw", True):
        with mock.patch.object(torch.optim, "AdamW", foreach_adamw):
            return one_run(args, objective, options, work, seq_len)
    if options.pop("whole_logits", False):  # no plain head: every loss reads the model's whole logits
        with mock.patch.object(Model, "plain_head", None):
            return one_run(args, objective, options, work, seq_len)
    model = fresh_model(args.model)
    data = dataset(objective, model, text_ids(model, 200), seq_len, args.jf_lengths == "varied")
    config = TrainConfig(
        steps=args.steps + 1,
        seq_len=data.seq_len,
        batch_size=max(1, args.batch_size * args.seq_len[0] // seq_len),  # the first length's tokens a step
        warmup=1,
        save_every=0,
        eval_every=0,
        **options,
    )
    history = train(model, make_objective(objective), data, config, work, overwrite=True)
    return statistics.median(r["tokens_per_s"] for r in history[1:]), None


def isolated_run(args, objective: str, options: dict, work: Path, seq_len: int) -> tuple[float, float]:
    """`one_run` in a process of its own: its peak resident memory (VmHWM) is this run's alone."""
    child = [sys.executable, __file__, *sys.argv[1:], "--child", json.dumps([objective, options, str(work), seq_len])]
    done = subprocess.run(child, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"a run failed:\n{done.stderr[-3000:]}")
    rate, peak = json.loads(done.stdout.strip().splitlines()[-1])
    return rate, peak


def child_run(args) -> None:
    """The run `--child` names, its tokens/s and VmHWM (GB) printed as the last line."""
    objective, options, work, seq_len = json.loads(args.child)
    rate, _ = one_run(args, objective, options, Path(work), seq_len)
    status = Path("/proc/self/status").read_text()
    peak = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))) * 1024
    print(json.dumps([rate, peak / 1e9]), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a model, or `tiny` (a random 2-layer llama)")
    p.add_argument("--objectives", nargs="+", choices=OBJECTIVES, default=list(OBJECTIVES))
    p.add_argument("--contenders", nargs="+", choices=list(CONTENDERS), default=list(CONTENDERS))
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=2, help="timed steps per run (after one untimed)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument(
        "--seq-len", type=int, nargs="+", default=[256], help="row lengths (jacobi_forcing: twice this at most)"
    )
    p.add_argument("--baseline", default=BASELINE, help="the contender the ratios are taken against")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--jf-lengths", choices=("fixed", "varied"), default="fixed", help="jacobi_forcing rows' lengths")
    p.add_argument("--out", type=Path, default=RESULTS / "train_speed.json")
    p.add_argument("--isolated", action="store_true", help="each run in a process of its own (its own peak memory)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    threads = set_threads(args.threads)
    if args.child:
        child_run(args)
        return
    load_before = load_average()
    shapes = [(o, n) for o in args.objectives for n in args.seq_len]
    rates: dict[tuple[str, int], dict[str, list[float]]] = {shape: {c: [] for c in args.contenders} for shape in shapes}
    peaks: dict[tuple[str, int], dict[str, float]] = {shape: {} for shape in shapes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for objective in args.objectives:
                runs = [(c, n) for c in args.contenders for n in args.seq_len]
                shift = r % len(runs)  # the order rotates: a load that changes over a round favours none
                for contender, seq_len in runs[shift:] + runs[:shift]:
                    work = Path(tmp) / f"{objective}-{contender}-{seq_len}"
                    run = isolated_run if args.isolated else one_run
                    rate, peak = run(args, objective, CONTENDERS[contender], work, seq_len)
                    rates[(objective, seq_len)][contender].append(rate)
                    if peak is not None:
                        peaks[(objective, seq_len)][contender] = max(
                            peak, peaks[(objective, seq_len)].get(contender, 0)
                        )
                    memory = "" if peak is None else f", peak {peak:.1f} GB"
                    log(f"round {r + 1}: {objective} {contender} rows of {seq_len}: {rate:.0f} tokens/s{memory} "
                        f"(load {load_average()})")  # fmt: skip
    rows = []
    base_name = args.baseline if args.baseline in args.contenders else None
    head = f"| objective | row | {' | '.join(args.contenders)} |"
    log(
        f"\ntokens/s (median), × {base_name or '—'} in brackets, peak GB with --isolated\n{head}\n"
        f"|---|---|{'---|' * len(args.contenders)}"
    )
    for (objective, seq_len), by in rates.items():
        medians = {c: statistics.median(v) for c, v in by.items()}
        base = medians.get(base_name) if base_name else None
        cells = [
            f"{m:.0f}{f' ({m / base:.2f}×)' if base else ''}"
            + (f", {peaks[(objective, seq_len)][c]:.1f} GB" if c in peaks[(objective, seq_len)] else "")
            for c, m in medians.items()
        ]
        log(f"| {objective} | {seq_len} | {' | '.join(cells)} |")
        rows.append({"objective": objective, "seq_len": seq_len, "tokens_per_s": by, "median": medians,
                     "peak_gb": peaks[(objective, seq_len)], "baseline": base_name})  # fmt: skip
    write_report(args.out, load_before, threads, model=args.model, batch_size=args.batch_size,
                 seq_len=args.seq_len, steps=args.steps, rounds=args.rounds, jf_lengths=args.jf_lengths,
                 rows=rows)  # fmt: skip


if __name__ == "__main__":
    main()
