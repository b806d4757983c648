"""Jacobi Forcing on SmolLM2-135M-Instruct with a LoRA adapter: the recipe, its learning curve, its figures.

Stages, each resumable (rerun the same command: finished stages are skipped, a trajectory file is
completed, training continues from its last checkpoint):

1. prompts: `--code` code prompts (the `pycode` task's train split: standard-library files whose
   paths hash into train, short contexts, sent as raw text, as a code completion) and `--chat` chat
   prompts (`fastforward.tasks.instructions`, train topics, through the chat template);
2. trajectories: the base model's Jacobi trajectories at block 16 (`fastforward trajectories`' code),
   decoded at --collect-quantize with `--exact`, so that their fixed points are the tokens the
   decoding precision's greedy AR gives;
3. training: `jacobi_forcing` with a LoRA adapter (--lora-rank) under bf16 autocast; at each step of
   --curve an adapter snapshot is written to WORK/curve/step-N;
4. evaluation of the base (step 0) and every snapshot, at int4 `--exact`, batch 1, greedy, on
   held-out prompts (the `pycode` test split's files and the instruction test split's topics, never
   trained on): TPF and tokens/s of `jacobi` and `jacobi-mr` on code and chat, whether their tokens
   equal the model's own `ar`, `pycode` next-line accuracy of `ar`, and the base model's per-token
   negative log-likelihood of the model's greedy outputs (quality kept: within 10 % of the base's own);
   the last point also times the base model's `ar` and `lookup` in the same interleaved run.

Writes WORK/curve.json and a plot WORK/curve.png, and prints one table.

    python benchmarks/smollm2_jf.py        # 300 + 300 prompts, 300 steps (not yet run; see below)
    python benchmarks/smollm2_jf.py --code 16 --chat 16 --steps 8 --curve 4,8 --n 2 --work runs/jf-smoke

The defaults are sized for about 3 hours on 2 quiet cores, an estimate from the collection and training
rates in docs/notes/2026-11-28-jacobi-forcing-lora.md (the command that was run, and its figures).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from common import load_average, log, machine_info, set_threads

from fastforward.api import build_decoder
from fastforward.model import Model, load_model
from fastforward.tasks import get_task
from fastforward.tasks.instructions import instruction_prompts
from fastforward.training.objectives import JacobiForcing
from fastforward.training.run_dir import finished_run, save_adapter_snapshot, tokens_seen
from fastforward.training.trainer import TrainConfig, train
from fastforward.training.trajectories.dataset import TrajectoryData
from fastforward.training.trajectories.writer import collect

BASE = "smollm2-135m"
CODE_OPTIONS = {"context_lines": 12, "max_prompt_chars": 600}  # short contexts: most of a row is the response
BLOCK = 16


# ---- prompts and trajectories ---------------------------------------------------------------------------
def prompt_ids(model: Model, code: int, chat: int, split: str, seed: int = 0) -> dict[str, list[list[int]]]:
    """Code prompts as raw text, chat prompts through the chat template (as a user of each sends them)."""
    examples = get_task("pycode", **CODE_OPTIONS).examples(split, n=code, seed=seed)
    return {
        "code": [model.encode_prompt(ex.prompt, chat_template=False) for ex in examples],
        "chat": [model.encode_prompt(p) for p in instruction_prompts(split, chat, seed=seed)],
    }


def collect_trajectories(args, work: Path) -> Path:
    path = work / "trajectories.jsonl"
    if args.device == "cpu":
        model = load_model(BASE, quantize=args.collect_quantize, exact=args.collect_quantize != "none")
    else:  # a GPU: bfloat16, as it decodes there
        model = load_model(BASE, dtype="bfloat16", device=args.device)
    groups = prompt_ids(model, args.code, args.chat, "train")
    mixed = [p for pair in zip(groups["code"], groups["chat"], strict=False) for p in pair]
    mixed += groups["code"][len(groups["chat"]) :] + groups["chat"][len(groups["code"]) :]
    started = time.perf_counter()
    summary = collect(
        model, mixed, path, block_size=BLOCK, max_new_tokens=args.max_new_tokens, batch_size=args.collect_batch_size
    )
    if summary.written:
        seconds = time.perf_counter() - started
        log(f"trajectories: {summary.written} prompts in {seconds:.0f} s, TPF {summary.tokens_per_forward:.2f}")
    return path


# ---- training with snapshots ----------------------------------------------------------------------------
def train_adapter(args, work: Path, trajectories: Path) -> list[int]:
    """Train (or resume) and write the snapshots of --curve; returns their steps."""
    points = sorted({int(s) for s in args.curve.split(",")} | {args.steps})
    run = work / "train"
    if finished_run(run):
        return points
    model = load_model(BASE, device=args.device)
    data = TrajectoryData.from_file(trajectories, args.seq_len)
    config = TrainConfig(
        steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
        mixed_precision="bf16", save_every=args.save_every, eval_every=0, keep_checkpoints=1,
        lora_rank=args.lora_rank,
    )  # fmt: skip
    objective = JacobiForcing(noise_schedule="progressive", noise_window=BLOCK)
    provenance = {"base": BASE, "objective": objective.describe(), "recipe": "benchmarks/smollm2_jf.py"}

    def snapshot(step: int, record: dict) -> None:
        if step in points and step < args.steps:
            save_adapter_snapshot(model, work / "curve" / f"step-{step:05d}", {**provenance, "step": step})

    (work / "curve").mkdir(parents=True, exist_ok=True)
    log(f"training on {len(data)} trajectories: {args.steps} steps of {args.batch_size} rows, LoRA {args.lora_rank}")
    train(model, objective, data, config, run, callback=snapshot)
    return points


def adapter_at(work: Path, step: int, last: int) -> Path | None:
    return None if step == 0 else work / "train" if step == last else work / "curve" / f"step-{step:05d}"


# ---- evaluation -----------------------------------------------------------------------------------------
def nll(scorer: Model, prompt: list[int], output: list[int]) -> tuple[float, int]:
    """Sum of the scorer's negative log-likelihoods of `output` after `prompt`, and the count."""
    if not output:
        return 0.0, 0
    ids = torch.tensor([prompt + output])
    with torch.inference_mode():
        logits = scorer.hf(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(output), reduction="sum")), len(output)


def evaluate_point(model: Model, scorer: Model, held: dict, args, base_models: dict | None = None) -> dict:
    """One curve point: every decoder on every group, one prompt at a time (contenders interleaved)."""
    contenders = [("ar", model), ("jacobi", model), ("jacobi-mr", model)]
    if base_models:
        contenders += [("base ar", base_models["ar"]), ("base lookup", base_models["lookup"])]
    out: dict = {}
    for group, prompts in held.items():
        results = {label: [] for label, _ in contenders}
        for prompt in prompts:
            for label, m in contenders:
                name = label.removeprefix("base ")
                results[label].append(build_decoder(name).generate(m, [prompt], args.max_new_tokens)[0])
        row = {}
        for label, generations in results.items():
            tokens = sum(g.stats.tokens for g in generations)
            row[label] = {
                "tpf": tokens / max(sum(g.stats.nfe for g in generations), 1),
                "tps": tokens / sum(g.stats.seconds for g in generations),
                "equal_ar": sum(g.token_ids == a.token_ids for g, a in zip(generations, results["ar"], strict=True)),
            }
        scored = [nll(scorer, p, g.token_ids) for p, g in zip(prompts, results["ar"], strict=True)]
        row["nll"] = sum(s for s, _ in scored) / max(sum(n for _, n in scored), 1)
        out[group] = row
    task = get_task("pycode", **CODE_OPTIONS)
    examples = task.examples("test", n=args.pycode_n, seed=1)
    outputs = [
        build_decoder("ar").generate(model, [model.encode_prompt(ex.prompt, False)], 24)[0].text for ex in examples
    ]
    out["pycode_accuracy"] = sum(g.correct for g in task.grade_all(examples, outputs)) / len(examples)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("runs/smollm2-jf"))
    p.add_argument("--code", type=int, default=300, help="code prompts to collect trajectories for")
    p.add_argument("--chat", type=int, default=300, help="chat prompts to collect trajectories for")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--collect-quantize", default="int4", help="precision of the collecting model (with --exact)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--curve", default="50,100,200", help="steps at which an adapter snapshot is kept and evaluated")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--n", type=int, default=8, help="held-out prompts per group for speed and TPF")
    p.add_argument("--pycode-n", type=int, default=50, help="held-out pycode problems for next-line accuracy")
    p.add_argument("--collect-batch-size", type=int, default=8, help="prompts decoded together while collecting")
    p.add_argument("--device", default="cpu", help="where to collect and train (cuda: the GPU kit, benchmarks/gpu)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-eval", action="store_true", help="collect and train only")
    args = p.parse_args()
    threads = set_threads(args.threads)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    trajectories = collect_trajectories(args, work)
    points = train_adapter(args, work, trajectories)
    log(f"collection and training: {time.perf_counter() - started:.0f} s")
    if args.skip_eval:
        return
    load_before = load_average()
    precision = {"quantize": "int4", "exact": True}
    base = load_model(BASE, **precision)
    scorer = load_model(BASE)
    held = prompt_ids(base, args.n, args.n, "test")
    seen = tokens_seen(work / "train")
    curve = []
    for step in [0, *points]:
        adapter = adapter_at(work, step, args.steps)
        model = base if adapter is None else load_model(BASE, adapter=str(adapter), **precision)
        extra = {"ar": base, "lookup": base} if step == args.steps else None
        figures = evaluate_point(model, scorer, held, args, extra)
        curve.append({"step": step, "tokens": seen.get(step, 0.0), **figures})
        log(f"step {step}: " + json.dumps(figures))
    record = {"machine": machine_info(), "threads": threads, "load_before": load_before, "load_after": load_average(),
              "args": {k: str(v) for k, v in vars(args).items()}, "curve": curve}  # fmt: skip
    (work / "curve.json").write_text(json.dumps(record, indent=2) + "\n")
    print_table(curve)
    plot(curve, work / "curve.png")
    log(f"wrote {work / 'curve.json'} and {work / 'curve.png'}")


def print_table(curve: list[dict]) -> None:
    log("\n| step | training tokens | code jacobi TPF | code jacobi-mr TPF | chat jacobi TPF | chat jacobi-mr TPF "
        "| pycode acc | code NLL | chat NLL | = ar |\n|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for point in curve:
        code, chat = point["code"], point["chat"]
        equal = min(g[d]["equal_ar"] for g in (code, chat) for d in ("jacobi", "jacobi-mr"))
        log(
            f"| {point['step']} | {point['tokens']:.0f} | {code['jacobi']['tpf']:.2f} | {code['jacobi-mr']['tpf']:.2f} "
            f"| {chat['jacobi']['tpf']:.2f} | {chat['jacobi-mr']['tpf']:.2f} | {point['pycode_accuracy']:.1%} "
            f"| {code['nll']:.3f} | {chat['nll']:.3f} | {equal} of each |"
        )
    last = curve[-1]
    if "base ar" in last["code"]:
        log("\nspeed at the last point (tokens/s, interleaved):")
        for group in ("code", "chat"):
            row = last[group]
            log(f"  {group}: " + ", ".join(f"{k} {v['tps']:.1f}" for k, v in row.items() if isinstance(v, dict)))


def plot(curve: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    x = [p["tokens"] / 1e3 for p in curve]
    for group in ("code", "chat"):
        for decoder, style in (("jacobi", "-o"), ("jacobi-mr", "--s")):
            ax.plot(x, [p[group][decoder]["tpf"] for p in curve], style, label=f"{group} {decoder}")
    ax.set_xlabel("training tokens (thousands)")
    ax.set_ylabel("tokens per forward")
    ax.set_title("Jacobi Forcing on SmolLM2-135M (LoRA), held-out prompts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
