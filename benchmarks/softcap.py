"""What Gemma 2's soft-capped attention costs: fastforward's masked eager attention (and its `--exact`
form, one query at a time) against SDPA, on the same model with soft-capping switched off.

SDPA cannot apply attention logit soft-capping, so a Gemma 2 model runs `fastforward.model.softcap`
instead. This times greedy `ar` and `jacobi` on a random-init Gemma 2 of SmolLM2-135M's size (30
layers, hidden 576, 9 heads of 64, 3 KV heads, vocabulary 49152), float32, one prompt of
`--prompt-tokens` tokens, `--new-tokens` tokens, the three attentions interleaved `--rounds` times in
one process (median tokens/s). Soft-capping changes the tokens, so only the speeds compare.

    python benchmarks/softcap.py

Writes benchmarks/results/softcap.json with the machine and its load average.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers
from common import RESULTS, load_average, log, set_threads, write_report

import fastforward as ff
from fastforward.model import Model, softcap
from fastforward.model.tiny import DEFAULT_CORPUS, fit_tokenizer

ATTENTIONS = {"sdpa (no soft-capping)": "sdpa", "softcap": softcap.NAME, "softcap --exact": softcap.EXACT}


def model_with(attention: str, vocab: int) -> Model:
    config = transformers.Gemma2Config(
        vocab_size=vocab,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        sliding_window=4096,
        attn_logit_softcapping=None if attention == "sdpa" else 50.0,
        attn_implementation=softcap.NAME,  # transformers refuses SDPA for Gemma 2 at construction
    )
    torch.manual_seed(0)
    hf = transformers.Gemma2ForCausalLM(config).eval()
    hf.config._attn_implementation = attention  # without soft-capping SDPA computes the same attention
    return Model(hf, fit_tokenizer(DEFAULT_CORPUS), name=f"gemma2-{attention}")  # prompts are random ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    threads = set_threads(args.threads)
    load_before = load_average()
    models = {label: model_with(attention, 49152) for label, attention in ATTENTIONS.items()}
    prompt = torch.randint(0, 49152, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    speeds: dict[str, dict[str, list[float]]] = {label: {"ar": [], "jacobi": []} for label in models}
    for _ in range(args.rounds):
        for label, model in models.items():
            for decoder in ("ar", "jacobi"):
                started = time.perf_counter()
                out = ff.build_decoder(decoder).generate(model, [prompt], args.new_tokens)[0]
                speeds[label][decoder].append(len(out.token_ids) / (time.perf_counter() - started))
    medians = {label: {d: round(statistics.median(v), 2) for d, v in s.items()} for label, s in speeds.items()}
    for label, figures in medians.items():
        log(f"{label:24s} ar {figures['ar']:7.2f} tok/s   jacobi {figures['jacobi']:7.2f} tok/s")
    write_report(RESULTS / "softcap.json", load_before, threads, args=vars(args), tokens_per_second=medians)


if __name__ == "__main__":
    main()
