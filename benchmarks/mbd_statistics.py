"""Train-inference statistics of Multi-Block Diffusion on the demo (the MBD-LMs paper's Figure 2, at
CPU scale): what `mbd` meets at inference against what MultiTF's training states contain.

Inference: the demo's `mbd` (block 6, buffer 3, add 0.5, τ 0.9; `fastforward.demo.showcase.Settings`)
decodes the --n held-out problems with a model (the shipped SBD checkpoint by default), and before
every forward a recording subclass notes the running set: how many blocks are active, each slot's
mask ratio (masked ÷ block size), the gap between adjacent slots, and whether a partly revealed
block's masks are a suffix (revealed left to right). It also notes, for every revealed token, the slot
that revealed it, so the first position where `mbd`'s output leaves the same model's greedy AR output
can be charged to a slot (front block, or a later block beside a partly masked predecessor). The
same with a buffer of one (SingleBD) is the baseline.

Training: MultiTF's `draw` (the shipped recipe's options, or --block/--max-group/--layouts/--schedule)
on the demo's fine-tuning rows, for --batches batches: noise-group sizes, each block's slot in its
group and realized mask ratio (targets masked ÷ targets), adjacent-slot gaps, and the suffix share;
what each noisy query sees follows from the group (its clean prefix and the group's noisy blocks up to
its own: `visibility.multitf_train`, tested as a table in tests/test_multitf.py).

    python benchmarks/mbd_statistics.py --threads 1                  # about 2 min at 1 thread
    python benchmarks/mbd_statistics.py --threads 1 --n 3 --batches 2 --results /tmp/s   # smoke

Writes mbd_statistics.json and mbd_statistics.png to --results (benchmarks/results by default).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from common import log, machine_info, set_threads

from fastforward.decoding.decoders.mbd import MultiBlockDiffusionDecoder
from fastforward.demo.pipeline import DemoConfig, pack_records
from fastforward.demo.showcase import Settings
from fastforward.evaluation.evaluate import AR, compare
from fastforward.evaluation.report import write_json
from fastforward.model import load_model
from fastforward.training.objectives import MultiTF

CHECKPOINTS = Path(__file__).resolve().parents[1] / "fastforward" / "demo" / "checkpoints"
SLOTS = 3


def is_suffix(masked: list[bool]) -> bool:
    """The masked positions of a block form one run ending at its last position."""
    first = masked.index(True) if True in masked else len(masked)
    return all(masked[first:])


class RecordingMBD(MultiBlockDiffusionDecoder):
    """`mbd` that notes, before each forward, its running blocks and, per revealed position, the slot.

    It reads the buffer where the decoder chooses what to reveal (`_choose`, called once per forward
    with the running blocks as the forward saw them), so mbd.py itself is unchanged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.traces: list[dict] = []

    def begin(self, session, rows) -> None:
        self.traces.append({"forwards": [], "revealed_by": {}})
        super().begin(session, rows)

    def _choose(self, running, confidence):
        chosen = super()._choose(running, confidence)
        trace = self.traces[-1]
        ratios = [1 - b.progress for b in running]
        partial = [not b.complete and any(b.done) for b in running]
        suffix = [is_suffix([not d for d in b.done]) for b in running]
        trace["forwards"].append({"ratios": ratios, "partial": partial, "suffix": suffix})
        for slot, (block, picks) in enumerate(zip(running, chosen, strict=True)):
            before = ratios[slot - 1] if slot else None
            for j in picks:
                trace["revealed_by"][block.start + j] = (slot, ratios[slot], before)
        return chosen


def inference_stats(model, config: DemoConfig, s: Settings, n: int, buffer_size: int) -> dict:
    """Run the recording `mbd` (and AR) on n test problems; summarize its running sets."""
    task = config.task()
    examples = task.examples("test", n=n, seed=config.seed)
    decoder = RecordingMBD(s.small_block, buffer_size, s.add_threshold, s.accept_threshold)
    results = compare(
        model, task, {"mbd": decoder}, examples, max_new_tokens=config.max_new_tokens, chat_template=False,
        warmup=False, progress=False,
    )  # fmt: skip
    forwards = [f for t in decoder.traces for f in t["forwards"]]
    sizes = Counter(len(f["ratios"]) for f in forwards)
    per_slot = {k: [f["ratios"][k] for f in forwards if len(f["ratios"]) > k] for k in range(SLOTS)}
    gaps = [f["ratios"][k + 1] - f["ratios"][k] for f in forwards for k in range(len(f["ratios"]) - 1)]
    partial = [x for f in forwards for p, x in zip(f["partial"], f["suffix"], strict=True) if p]
    # where the output first leaves AR's: which slot revealed that token, beside what predecessor
    leave = Counter()
    tokens_by_slot = Counter()
    for trace, ar, mine in zip(decoder.traces, results[AR].records, results["mbd"].records, strict=True):
        tokens_by_slot.update(slot for slot, _, _ in trace["revealed_by"].values())
        a, b = ar["token_ids"], mine["token_ids"]
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        if first is None:
            leave["never"] += 1
        elif first not in trace["revealed_by"]:
            leave["length"] += 1
        else:
            slot, _, before = trace["revealed_by"][first]
            leave[
                f"slot {slot}"
                + ("" if before is None else f" (predecessor {'partly masked' if before > 0 else 'complete'})")
            ] += 1
    summary = {
        "buffer_size": buffer_size,
        "accuracy": round(results["mbd"].accuracy, 2),
        "ar_accuracy": round(results[AR].accuracy, 2),
        "tpf": round(results["mbd"].tpf, 3),
        "forwards": len(forwards),
        "running_set_size": {str(k): round(v / len(forwards), 4) for k, v in sorted(sizes.items())},
        "slot_mask_ratio_mean": {str(k): round(statistics.mean(v), 3) for k, v in per_slot.items() if v},
        "slot_fully_masked": {str(k): round(sum(x == 1 for x in v) / len(v), 3) for k, v in per_slot.items() if v},
        "gap_mean": round(statistics.mean(gaps), 3) if gaps else None,
        "suffix_share_of_partly_masked_blocks": round(sum(partial) / len(partial), 3) if partial else None,
        "tokens_revealed_by_slot": {str(k): v for k, v in sorted(tokens_by_slot.items())},
        "first_departure_from_ar": dict(leave),
    }
    return {"summary": summary, "per_slot": per_slot, "gaps": gaps, "sizes": dict(sizes)}


def training_stats(model, config: DemoConfig, objective: MultiTF, batches: int) -> dict:
    """MultiTF's draws on the demo's fine-tuning rows: groups, slot-wise realized mask ratios, gaps."""
    records = config.task().training_records(config.finetune_examples, seed=config.seed + 1)
    data = pack_records(model, records, config.seq_len)
    sizes, per_slot, gaps, partial, blocks = Counter(), {k: [] for k in range(8)}, [], [], Counter()
    shifts, seen_noisy, seen_clean = Counter(), Counter(), []
    for step in range(batches):
        batch = data.batch(step, config.batch_size, config.seed)
        masking = objective.draw(batch, torch.Generator().manual_seed(1000 + step))
        k = masking.block
        blocks[k] += 1
        for row in range(batch.tokens.shape[0]):
            groups = masking.groups[row].tolist()
            targets, masked = batch.loss_mask[row], masking.masked[row]
            ratio = {}
            for b in range(len(groups)):
                t = targets[b * k : (b + 1) * k]
                if int(t.sum()) == len(t) == k:  # whole blocks of targets (the decoder's blocks are)
                    m = masked[b * k : (b + 1) * k].tolist()
                    ratio[b] = sum(m) / k
                    if 0 < sum(m) < k:
                        partial.append(is_suffix(m))
            shifts[groups.count(0)] += 1  # the first group's size: a systematic layout's size minus its shift
            for g in sorted(set(groups)):
                members = [b for b, x in enumerate(groups) if x == g]
                sizes[len(members)] += 1
                for i, _ in enumerate(members):  # a noisy query sees i + 1 noisy blocks, the clean blocks before
                    seen_noisy[i + 1] += 1
                    seen_clean.append(members[0])
                slots = [ratio.get(b) for b in members]
                for i, r in enumerate(slots):
                    if r is not None:
                        per_slot[i].append(r)
                gaps += [b - a for a, b in zip(slots, slots[1:], strict=False) if a is not None and b is not None]
    per_slot = {k: v for k, v in per_slot.items() if v}
    total = sum(sizes.values())
    summary = {
        "objective": objective.describe(),
        "batches": batches,
        "block_sizes_drawn": dict(sorted(blocks.items())),
        "group_size": {str(k): round(v / total, 4) for k, v in sorted(sizes.items())},
        "first_group_size": {str(k): round(v / sum(shifts.values()), 4) for k, v in sorted(shifts.items())},
        "noisy_blocks_seen_per_query": {
            str(k): round(v / sum(seen_noisy.values()), 4) for k, v in sorted(seen_noisy.items())
        },
        "clean_blocks_seen_per_query_mean": round(statistics.mean(seen_clean), 2),
        "slot_mask_ratio_mean": {str(k): round(statistics.mean(v), 3) for k, v in per_slot.items()},
        "slot_fully_masked": {str(k): round(sum(x == 1 for x in v) / len(v), 3) for k, v in per_slot.items()},
        "gap_mean": round(statistics.mean(gaps), 3) if gaps else None,
        "suffix_share_of_partly_masked_blocks": round(sum(partial) / len(partial), 3) if partial else None,
    }
    return {"summary": summary, "per_slot": per_slot, "gaps": gaps, "sizes": dict(sizes)}


def plot(path: Path, inference: dict, training: dict, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    keys = sorted({*inference["sizes"], *training["sizes"]})
    ni, nt = sum(inference["sizes"].values()), sum(training["sizes"].values())
    xs = range(len(keys))
    ax.bar(
        [x - 0.2 for x in xs],
        [inference["sizes"].get(k, 0) / ni for k in keys],
        0.4,
        label="mbd: running blocks per forward",
    )
    ax.bar(
        [x + 0.2 for x in xs],
        [training["sizes"].get(k, 0) / nt for k in keys],
        0.4,
        label="MultiTF: blocks per noise-group",
    )
    ax.set_xticks(list(xs), [str(k) for k in keys])
    ax.set_xlabel("blocks")
    ax.set_ylabel("share")
    ax.legend(fontsize=8)
    ax.set_title("running-set size vs noise-group size")
    ax = axes[1]
    slots = [k for k in range(SLOTS) if inference["per_slot"].get(k) or training["per_slot"].get(k)]
    data, labels, colors = [], [], []
    for k in slots:
        for name, source, color in (("mbd", inference, "tab:blue"), ("MultiTF", training, "tab:orange")):
            data.append(source["per_slot"].get(k) or [0.0])
            labels.append(f"{name}\nslot {k}")
            colors.append(color)
    parts = ax.violinplot(data, showmeans=True)
    for body, color in zip(parts["bodies"], colors, strict=True):
        body.set_facecolor(color)
    ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=7)
    ax.set_ylabel("mask ratio of the block")
    ax.set_title("slot-wise mask ratios (slot 0 = front)")
    ax = axes[2]
    bins = [x / 12 - 1 / 24 for x in range(-12, 14)]
    ax.hist(inference["gaps"], bins=bins, density=True, alpha=0.6, label="mbd")
    ax.hist(training["gaps"], bins=bins, density=True, alpha=0.6, label="MultiTF")
    ax.set_xlabel("mask ratio of slot k+1 − slot k")
    ax.set_ylabel("density")
    ax.legend(fontsize=8)
    ax.set_title("gaps between adjacent slots")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(CHECKPOINTS / "sbd"), help="the model mbd decodes with")
    p.add_argument("--n", type=int, default=DemoConfig().eval_examples)
    p.add_argument("--batches", type=int, default=50, help="MultiTF draws: batches of the demo's rows")
    p.add_argument("--min-block", type=int, default=2, help="MultiTF's block sizes (the shipped recipe: 2-16)")
    p.add_argument("--max-block", type=int, default=16)
    p.add_argument("--max-group", type=int, default=3)
    p.add_argument("--layouts", default="both")
    p.add_argument("--schedule", default="chain-uniform")
    p.add_argument("--results", default="benchmarks/results")
    p.add_argument("--tag", default="")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--draws-only", action="store_true", help="only MultiTF's draws (seconds): print their summary")
    args = p.parse_args()
    threads = set_threads(args.threads)
    load_before = machine_info(load=True)["load_average"]
    started = time.perf_counter()
    config, settings = DemoConfig(), Settings()
    model = load_model(args.model, precision=config.precision())
    objective = MultiTF(
        min_block=args.min_block, max_block=args.max_block, max_group=args.max_group, layouts=args.layouts,
        schedule=args.schedule,
    )  # fmt: skip
    if args.draws_only:
        log(f"MultiTF draws: {training_stats(model, config, objective, args.batches)['summary']}")
        return
    multi = inference_stats(model, config, settings, args.n, settings.buffer_size)
    single = inference_stats(model, config, settings, args.n, 1)
    train = training_stats(model, config, objective, args.batches)
    for name, part in (("mbd (buffer 3)", multi), ("SingleBD (buffer 1)", single), ("MultiTF draws", train)):
        log(f"{name}: {part['summary']}")
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    title = (
        f"mbd block {settings.small_block} x{settings.buffer_size}, add {settings.add_threshold:g}, τ "
        f"{settings.accept_threshold:g} on {Path(args.model).name} (n={args.n}) vs MultiTF draws "
        f"(blocks {args.min_block}-{args.max_block}, max group {args.max_group}, {args.layouts}, {args.schedule})"
    )
    figure = plot(out / f"mbd_statistics{args.tag}.png", multi, train, title)
    report = {
        "args": vars(args),
        "inference_mbd": multi["summary"],
        "inference_singlebd": single["summary"],
        "training_multitf": train["summary"],
        "seconds": round(time.perf_counter() - started, 1),
        "threads": threads,
        "load_average_before": load_before,
        "machine": machine_info(load=True),
        "plot": str(figure),
    }
    path = write_json(out / f"mbd_statistics{args.tag}.json", report)
    log(f"wrote {path} and {figure}")


if __name__ == "__main__":
    main()
