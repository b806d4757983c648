"""Decoding speed and memory: our AR vs transformers' generate, and SBD against our AR.

All figures come from one run on one machine: the same model, prompts, dtype and thread count.
Every decoder runs every prompt `--repeats` times, interleaved, and the median time counts.

    python benchmarks/decode_speed.py                       # SmolLM2-135M, bf16, 2 threads
    python benchmarks/decode_speed.py --sbd-model runs/sbd  # SBD on an SBD-trained checkpoint
    python benchmarks/decode_speed.py --model runs/demo/ntp --sbd-model runs/demo/sbd --task arithmetic

Prints a table and writes benchmarks/results/decode_speed.json.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import threading
import time

import torch
from common import load_average

from fastforward import ARDecoder, SBDDecoder, load_model, make_policy
from fastforward.evaluation.evaluate import write_json
from fastforward.tasks import get_task

PROMPTS = [
    "Write a Python function that reverses a string.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash table is in two sentences.",
    "Write a Python class for a stack with push, pop and peek.",
]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class PeakMemory:
    """Peak memory while the block runs: CUDA allocator peak, or sampled RSS on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = rss_bytes()
            self.running = True
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.002)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self.running = False
            self.thread.join()
            self.peak = max(self.peak, rss_bytes())
        self.extra = self.peak - self.base


def time_hf_generate(model, prompt_ids, max_new_tokens):
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.hf.generate(
            torch.tensor([prompt_ids], device=model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=model.stop_token_ids,
            pad_token_id=model.pad_token_id,
        )
        seconds = time.perf_counter() - start
    return out.shape[1] - len(prompt_ids), seconds, None


def time_decoder(decoder, model, prompt_ids, max_new_tokens):
    start = time.perf_counter()
    gen = decoder.generate(model, [prompt_ids], max_new_tokens)[0]
    return gen.stats.tokens, time.perf_counter() - start, gen.stats.nfe


def measure_all(runners: dict, prompts, repeats: int) -> list[dict]:
    """Per prompt and repeat, every runner in turn (interleaved, so load drifts hit all alike).

    Seconds are the per-prompt medians summed; tokens and forwards come from one pass.
    """
    times = {name: [[] for _ in prompts] for name in runners}
    first: dict[str, list] = {name: [] for name in runners}
    for i, prompt in enumerate(prompts):
        for _ in range(repeats):
            for name, fn in runners.items():
                result = fn(prompt)
                times[name][i].append(result[1])
                if len(times[name][i]) == 1:
                    first[name].append(result)
    rows = []
    for name in runners:
        tokens = sum(r[0] for r in first[name])
        nfe = sum(r[2] or 0 for r in first[name])
        seconds = sum(statistics.median(t) for t in times[name])
        row = {"decoder": name, "tokens": tokens, "seconds": round(seconds, 3), "tps": round(tokens / seconds, 2)}
        if nfe:
            row["nfe"], row["tpf"] = nfe, round(tokens / nfe, 3)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sbd-model", default=None, help="checkpoint with a mask token (default: --model + new mask)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--gammas", type=float, nargs="+", default=[0.35, 1.0])
    ap.add_argument("--task", default=None, help="take prompts from a task's test split (e.g. arithmetic)")
    ap.add_argument("--n", type=int, default=8, help="prompts from --task")
    ap.add_argument("--out", default="benchmarks/results/decode_speed.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model = load_model(args.model, dtype=args.dtype)
    sbd_model = load_model(args.sbd_model, dtype=args.dtype) if args.sbd_model else model
    if sbd_model.mask_token_id is None:
        sbd_model.add_mask_token()  # untrained mask: SBD figures then only show the mechanics' cost
    texts = [e.prompt for e in get_task(args.task).examples("test", args.n)] if args.task else PROMPTS
    prompts = [model.encode_prompt(p) for p in texts]
    warm = ARDecoder()
    warm.generate(model, prompts[:1], 8)

    runners = {
        "hf-generate": lambda p: time_hf_generate(model, p, args.max_new_tokens),
        "ar": lambda p: time_decoder(ARDecoder(), model, p, args.max_new_tokens),
    }
    for gamma in args.gammas:
        decoder = SBDDecoder(args.block_size, make_policy("entropy", gamma), first_token_from_ntp=True)
        runners[f"sbd k={args.block_size} γ={gamma}"] = lambda p, d=decoder: time_decoder(
            d, sbd_model, p, args.max_new_tokens
        )
    rows = measure_all(runners, prompts, args.repeats)
    ar_tps = rows[1]["tps"]
    for row in rows:
        row["tps_vs_ar"] = round(row["tps"] / ar_tps, 3)

    memory = {}
    for name, decoder, m in [
        ("ar", ARDecoder(), model),
        ("sbd", SBDDecoder(args.block_size, make_policy("entropy", args.gammas[0])), sbd_model),
    ]:
        with PeakMemory(m.device) as peak:
            decoder.generate(m, prompts[:1], args.max_new_tokens)
        memory[name] = {"peak_bytes": peak.peak, "extra_bytes": peak.extra}

    print(f"{'decoder':<22}{'tokens':>8}{'nfe':>6}{'tpf':>8}{'tok/s':>9}{'vs ar':>8}")
    for r in rows:
        print(
            f"{r['decoder']:<22}{r['tokens']:>8}{r.get('nfe', '-'):>6}{r.get('tpf', '-'):>8}"
            f"{r['tps']:>9.2f}{r['tps_vs_ar']:>8.3f}"
        )
    for name, mem in memory.items():
        print(
            f"peak memory {name}: {mem['peak_bytes'] / 2**20:.1f} MiB (+{mem['extra_bytes'] / 2**20:.1f} MiB decoding)"
        )
    ratio = memory["sbd"]["peak_bytes"] / memory["ar"]["peak_bytes"]
    print(f"sbd / ar peak memory: {ratio:.4f}")

    result = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "threads": args.threads,
            "load_average": load_average(),
        },
        "device": str(model.device),
        "args": vars(args),
        "rows": rows,
        "memory": memory,
        "sbd_over_ar_peak_memory": ratio,
    }
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
