"""A Jacobi Forcing LoRA step's tokens/s: this checkout's trainer against an earlier commit's, interleaved.

Each contender is one `benchmarks/train_speed.py` process (SmolLM2-135M, `jacobi_forcing`, `bf16+lora`,
one round) importing fastforward from its side's checkout; the earlier commit is checked out into a
temporary git worktree. Contenders: the earlier trainer at 1 thread (how it was measured before) and at
2, this checkout's at 2 (the whole machine), and two of this checkout's processes at 1 thread each at
once, their tokens/s added (what data parallelism over processes could reach, less its gradient
exchange, which for a LoRA adapter is a few MB a step). Their order rotates round by round, so a load that changes
during a round favours none. Both row shapes of `train_speed.py --jf-lengths`: `fixed` (every row of
one length) and `varied` (rows of unequal length, as real responses give, which padding wastes).

    python benchmarks/train_speed_commits.py 6e583de             # before the bins and `logits_at`
    python benchmarks/train_speed_commits.py 6e583de --rounds 1 --lengths varied
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import RESULTS, load_average, log, machine_info, write_json

HERE = Path(__file__).resolve().parent
CONTENDERS = (("before", 1, 1), ("before", 2, 1), ("after", 2, 1), ("after", 1, 2))  # (side, threads, processes)


def run_one(side_root: Path, threads: int, processes: int, lengths: str, steps: int, out: Path) -> float:
    """`processes` `train_speed.py` processes at once on `side_root`'s fastforward; their median tokens/s, added."""
    command = [
        sys.executable, str(HERE / "train_speed.py"), "--objectives", "jacobi_forcing", "--contenders", "bf16+lora",
        "--rounds", "1", "--steps", str(steps), "--threads", str(threads), "--jf-lengths", lengths,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(side_root)}
    outs = [out.with_name(f"{out.stem}-{i}.json") for i in range(processes)]
    running = [subprocess.Popen([*command, "--out", str(o)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True) for o in outs]  # fmt: skip
    for process in running:
        _, stderr = process.communicate()
        if process.returncode != 0:
            raise SystemExit(f"train_speed.py failed on {side_root}:\n{stderr[-2000:]}")
    return sum(json.loads(o.read_text())["rows"][0]["median"]["bf16+lora"] for o in outs)


def name(side: str, threads: int, processes: int) -> str:
    each = f"{threads} thread{'s' if threads > 1 else ''}"
    return f"{side}, {each if processes == 1 else f'{processes} processes x {each}'}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", help="the earlier commit")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (after one untimed)")
    p.add_argument("--lengths", nargs="+", choices=("fixed", "varied"), default=["fixed", "varied"])
    p.add_argument("--out", type=Path, default=RESULTS / "train_speed_commits.json")
    args = p.parse_args()
    here = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True, cwd=HERE).strip())
    load_before = load_average()
    rates: dict[str, dict[str, list[float]]] = {length: {} for length in args.lengths}
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(here), "worktree", "add", "--detach", str(before), args.before], check=True)
        try:
            roots = {"before": before, "after": here}
            for r in range(args.rounds):
                for length in args.lengths:
                    shift = r % len(CONTENDERS)
                    for side, threads, processes in CONTENDERS[shift:] + CONTENDERS[:shift]:
                        rate = run_one(roots[side], threads, processes, length, args.steps, Path(tmp) / "one.json")
                        rates[length].setdefault(name(side, threads, processes), []).append(rate)
                        log(f"round {r + 1}, {length} rows: {name(side, threads, processes)}: {rate:.0f} tokens/s "
                            f"(load {load_average()})")  # fmt: skip
        finally:
            subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", str(before)], check=True)
    names = [name(*contender) for contender in CONTENDERS]
    log(f"\n| rows | {' | '.join(names)} | after (2 threads) ÷ before, 1 thread | ÷ before, 2 threads | "
        "2 processes ÷ before, 1 thread |")  # fmt: skip
    log(f"|---|{'---|' * (len(names) + 3)}")
    rows = []
    for length, by in rates.items():
        medians = {name: statistics.median(by[name]) for name in names}
        one, two, after, processes = (medians[n] for n in names)
        log(
            f"| {length} | {' | '.join(f'{medians[n]:.0f}' for n in names)} | {after / one:.2f} | {after / two:.2f} | "
            f"{processes / one:.2f} |"
        )
        rows.append({"lengths": length, "tokens_per_s": by, "median": medians})
    after = subprocess.check_output(["git", "-C", str(here), "rev-parse", "HEAD"], text=True).strip()
    write_json(args.out, {"machine": machine_info(), "load_average_before": load_before,
               "load_average_after": load_average(), "before": args.before, "after": after,
               "rounds": args.rounds, "steps": args.steps, "rows": rows})  # fmt: skip
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
