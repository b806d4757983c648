"""Ship the shared arithmetic start (issue 81, item 0) as a preset, so every method's recipe can start from it
by name on any machine (`--start smollm2-135m-arithmetic-start`), after the machine that trained it is gone.

The training folder's adapter is written in bfloat16 as one adapter over the base (as recipes ship theirs),
with a `provenance.json` that gives the commands that rebuild it (the data, then the training), the data's
checksum, and what `benchmarks/questions_by_hand.py` measured of it (its JSON, when given).

    python benchmarks/ship_start.py --run runs/start/sft --data runs/start/data.jsonl \
        --measured benchmarks/results/questions_by_hand.json --out fastforward/presets/smollm2-135m-arithmetic-start
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

from fastforward.model.flatten import flatten

BASE = "smollm2-135m"
DATA_COMMAND = "python benchmarks/arithmetic_start_data.py --gsm8k gsm8k/train.jsonl --out runs/start/data.jsonl"


def train_command(config: dict) -> str:
    """The `fastforward train` command of a training folder's recorded settings."""
    t = config["train"]
    return (
        f"fastforward train --objective ntp --model {BASE} --data runs/start/data.jsonl --out runs/start/sft "
        f"--lora-rank {t['lora_rank']} --lr {t['lr']:g} --batch-size {t['batch_size']} --seq-len {t['seq_len']} "
        f"--steps {t['steps']} --warmup {t['warmup']} --save-every {t['save_every']} --seed {t['seed']}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, required=True, help="the finished `fastforward train` folder")
    p.add_argument("--data", type=Path, required=True, help="the data it trained on")
    p.add_argument("--measured", type=Path, help="questions_by_hand.py's JSON, with this run among its models")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    config = json.loads((args.run / "train_config.json").read_text())
    measured = json.loads(args.measured.read_text()) if args.measured else None
    data = args.data.read_bytes()
    provenance = {
        "name": args.out.name,
        "description": f"{BASE} + an NTP LoRA adapter: the shared start of the arithmetic models (varied "
        "arithmetic problems and GSM8K's short train problems)",
        "base": BASE,
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "command": f"{DATA_COMMAND} && {train_command(config)}",
        "data": {"sha256": hashlib.sha256(data).hexdigest(), "lines": len(data.splitlines())},
        "training": config["train"],
    }
    if measured is not None:  # the run goes by the preset's name (no machine's folder in a shipped file)
        named = lambda label: args.out.name if label == str(args.run) else label  # noqa: E731
        provenance["measured"] = {
            "questions_by_hand": {
                "command": "python benchmarks/questions_by_hand.py --models " + " ".join(measured["rows"]),
                "right": {named(label): right for label, right in measured["right"].items()},
                "of": measured["of"],
                "tps": {named(label): round(row["tps"], 2) for label, row in measured["rows"].items()},
                "load_average": [measured["load_average_before"], measured["load_average_after"]],
                "cpu": measured["machine"]["processor"],
            }
        }
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    flatten([args.run], tmp, BASE)
    (tmp / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    shutil.rmtree(args.out, ignore_errors=True)
    os.replace(tmp, args.out)
    print(f"shipped {args.out}")


if __name__ == "__main__":
    main()
