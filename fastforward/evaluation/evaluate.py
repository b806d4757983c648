"""Evaluation: model × decoder(s) × task → accuracy, NFE, TPF, TPS, speedup, AUP; sweeps and records.

Metrics follow DESIGN.md (Metrics) and `fastforward.decoding.metrics`:

- accuracy: percent of examples the task grades correct;
- NFE: decoding forwards (prefill excluded), summed over examples; `nfe_mean` per example;
- TPF: generated tokens (up to and including the stop token) ÷ decoding forwards, both summed over
  the examples (a ratio of sums, so long answers weigh more);
- queries per token: tokens the decoding forwards ran (AR: one per forward; drafts, candidates and
  masked positions add theirs) ÷ generated tokens: AR's is just under 1.0 (its first token comes
  from the prefill), and what a higher TPF costs in work shows here (on a CPU each query adds to a
  forward's time);
- TPS: generated tokens ÷ wall seconds of generation, prefill included, model load and grading
  excluded; prefill seconds are also reported on their own;
- speedup: TPS ÷ TPS of AR decoding of the same model on the same prompts, measured in the same run;
  `nfe_speedup` is TPF ÷ TPF of that AR run (the paper's Table 1 "speedup" is the NFE reduction);
- agreement: how far each output's token ids match the same model's greedy AR output
  (`metrics.token_agreement`): `agree_exact` (percent identical) and `agree_tokens` (mean match rate).

Timing is kept honest on a shared machine by interleaving: the examples are cut into batches and
each batch is decoded by every decoder in turn (AR first), so a change of machine load hits all of
them alike; each decoder also runs one untimed warm-up batch first. With `batch_size > 1` the wall
time of a batch is shared by its rows (a batch runs until its slowest row stops), so TPS and speedup
are throughput figures at that batch size; TPF and NFE are per row whatever the batch size.

`timed=M` splits the two: accuracy, NFE, TPF and agreement come from every example at `batch_size`
(a decoder gives a prompt the same tokens in any batch where it is batch invariant: docs/precision.md),
and TPS and speedup from a second pass over the first M examples at batch 1, interleaved example by
example (`EvalResult.timing`), which also counts how many of its outputs equal the batched pass's.

The results are `results.EvalResult` and `results.SweepResult`; `report` writes them out.

    model = load_model("runs/demo/sbd")
    task = get_task("arithmetic", max_number=20)
    result = evaluate(model, task, build_decoder("sbd", gamma=0.1), n=100)
    curve = sweep(model, task, "sbd", "gamma", [0, 0.1, 0.35, 1.0], n=100)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

from tqdm.auto import tqdm

from fastforward.api import build_decoder
from fastforward.decoding import metrics
from fastforward.decoding.decoders import ARDecoder, Decoder, Generation, Prompt, registry
from fastforward.errors import FastForwardError
from fastforward.evaluation.results import EvalResult, SweepResult, Timing
from fastforward.model import Model
from fastforward.tasks import Example, Task

AR = "ar"


def describe_decoder(decoder: Decoder) -> dict[str, Any]:
    """The knobs of a decoder instance, for result files (public attributes that are plain values)."""
    knobs: dict[str, Any] = {}
    for key, value in vars(decoder).items():
        if key.startswith("_"):
            continue
        if isinstance(value, (int, float, str, bool)) or value is None:
            knobs[key] = value
        elif hasattr(value, "__dataclass_fields__"):
            knobs[key] = {"name": type(value).__name__, **asdict(value)}
    return knobs


def _batches(items: Sequence, size: int) -> list[Sequence]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _timed_generate(
    decoder: Decoder, model: Model, prompts: list[list[int]] | list[Prompt], max_new_tokens: int
) -> tuple[list[Generation], float]:
    """Generate and time one batch. Infilling rows (`Prompt`s with a suffix) go whole to a decoder
    that infills; any other decoder continues each prefix alone for the gap's length (the baseline)."""
    rows = prompts if prompts and isinstance(prompts[0], Prompt) and not decoder.infills else None
    if rows is not None:
        prompts, max_new_tokens = [list(r.prefix) for r in rows], max(r.gap for r in rows)
    started = time.perf_counter()
    generations = decoder.generate(model, prompts, max_new_tokens)
    wall = time.perf_counter() - started
    if rows is not None:  # a batch continues to its longest gap: each row is graded on its own
        generations = [_cut(model, g, r.gap) for g, r in zip(generations, rows, strict=True)]
    return generations, wall


def _cut(model: Model, gen: Generation, length: int) -> Generation:
    if len(gen.token_ids) <= length:
        return gen
    ids = gen.token_ids[:length]
    return replace(gen, token_ids=ids, text=model.decode(ids))


def infill_rows(model: Model, examples: Sequence[Example]) -> list[Prompt]:
    """Each infilling example as a `Prompt`: prefix, suffix, and a gap of the reference's length in tokens."""
    rows = []
    for e in examples:
        prefix = model.encode_prompt(e.prompt, chat_template=False)
        suffix = model.tokenizer(e.meta["suffix"], add_special_tokens=False)["input_ids"]
        gap = len(model.tokenizer(e.reference, add_special_tokens=False)["input_ids"])
        rows.append(Prompt(prefix, suffix, max(gap, 1)))
    return rows


def compare(
    model: Model,
    task: Task,
    decoders: dict[str, Decoder],
    examples: Sequence[Example] | None = None,
    *,
    n: int | None = 100,
    split: str = "test",
    seed: int = 0,
    max_new_tokens: int | None = None,
    batch_size: int = 1,
    timed: int | None = None,
    chat_template: bool = True,
    warmup: bool = True,
    progress: bool = True,
    desc: str = "eval",
    shard: tuple[int, int] = (0, 1),
) -> dict[str, EvalResult]:
    """Run AR (always, as the baseline, under the label "ar") and every decoder of `decoders` over
    the same examples, interleaved batch by batch; grade, and return one EvalResult per label.

    Every result's speedup is against the AR run of this call; agreement is against its outputs.
    timed=M: TPS and speedup from the first M examples again, at batch 1 (`EvalResult.timing`); the
    rest from every example at `batch_size` (see the module docstring).
    shard=(k, n): in a process group of n (torch.distributed, initialised), process k decodes every
    n-th batch from the k-th; the generations are gathered, so every process returns the results one
    process would (the seconds are summed over the processes: tokens/s is per process).
    """
    if batch_size < 1:
        raise FastForwardError(f"batch_size must be at least 1, got {batch_size}")
    if timed is not None and timed < 1:
        raise FastForwardError(f"timed must be at least 1 example, got {timed}")
    if examples is None:
        examples = task.examples(split, n=n, seed=seed)
    if not examples:
        raise FastForwardError("no examples to evaluate; ask for at least one (--n)")
    max_new_tokens = max_new_tokens or task.max_new_tokens
    runs: dict[str, Decoder] = {AR: ARDecoder()}
    for label, decoder in decoders.items():
        if label == AR and not (isinstance(decoder, ARDecoder) and decoder.sampler.temperature == 0):
            raise FastForwardError("the label 'ar' is reserved for the greedy AR baseline; name the decoder otherwise")
        runs.setdefault(label, decoder)
    if task.infilling:
        prompts: list = infill_rows(model, examples)
    else:
        prompts = [model.encode_prompt(e.prompt, chat_template=chat_template) for e in examples]
    passes = [(prompts, batch_size)] + ([(prompts[:timed], 1)] if timed else [])
    if warmup:  # first calls allocate and pick kernels: keep them out of every timing (the last pass's)
        for decoder in runs.values():
            _timed_generate(decoder, model, prompts[: passes[-1][1]], min(max_new_tokens, 32))
    # disable=None: a bar on a terminal (or notebook), none where stderr is a log (redraws would fill it)
    total = sum(len(b) for rows, size in passes for _, b in _own_batches(rows, size, shard)) * len(runs)
    bar = tqdm(total=total, desc=desc, disable=None if progress else True, dynamic_ncols=True, leave=False)
    outputs, seconds, prefill = _decode(model, runs, prompts, max_new_tokens, batch_size, shard, bar.update)
    clocked = _decode(model, runs, prompts[:timed], max_new_tokens, 1, shard, bar.update) if timed else None
    bar.close()
    results: dict[str, EvalResult] = {}
    ar_gens = outputs[AR]
    for label, decoder in runs.items():
        results[label] = _result(
            label, decoder, task, examples, outputs[label], ar_gens, seconds[label], prefill[label], batch_size
        )
        if clocked is not None:
            results[label].timing = _timing(clocked[0][label], outputs[label], clocked[1][label], clocked[2][label])
    ar = results[AR]
    for result in results.values():
        result.ar_tps, result.ar_tpf = ar.tps, ar.tpf
    return results


def _own_batches(prompts: list, size: int, shard: tuple[int, int]) -> list[tuple[int, Sequence]]:
    """The batches of `size` (with their indices) that process `shard[0]` of `shard[1]` decodes."""
    rank, processes = shard
    return [(i, b) for i, b in enumerate(_batches(prompts, size)) if i % processes == rank]


def _decode(
    model: Model,
    runs: dict[str, Decoder],
    prompts: list,
    max_new_tokens: int,
    batch_size: int,
    shard: tuple[int, int],
    done: Callable[[int], Any],
) -> tuple[dict[str, list[Generation]], dict[str, float], dict[str, float]]:
    """Every decoder of `runs` over `prompts`, interleaved batch by batch (`done(rows)` after each): the
    generations in order, the wall seconds and the prefill seconds, by label."""
    decoded: dict[str, dict[int, list[Generation]]] = {label: {} for label in runs}  # by batch index
    seconds = dict.fromkeys(runs, 0.0)
    prefill = dict.fromkeys(runs, 0.0)
    for index, batch in _own_batches(prompts, batch_size, shard):
        for label, decoder in runs.items():
            generations, wall = _timed_generate(decoder, model, list(batch), max_new_tokens)
            decoded[label][index] = generations
            seconds[label] += wall
            prefill[label] += generations[0].stats.prefill_seconds
            done(len(batch))
    if shard[1] > 1:
        decoded, seconds, prefill = _gather_shards(decoded, seconds, prefill)
    outputs = {label: [g for i in sorted(parts) for g in parts[i]] for label, parts in decoded.items()}
    return outputs, seconds, prefill


def _timing(clocked: list[Generation], batched: list[Generation], seconds: float, prefill: float) -> Timing:
    """The timed pass's figures of one decoder, and how many of its outputs equal the batched pass's."""
    return Timing(
        n=len(clocked),
        batch_size=1,
        tokens=sum(g.stats.tokens for g in clocked),
        nfe=sum(g.stats.nfe for g in clocked),
        seconds=seconds,
        prefill_seconds=prefill,
        queries=sum(g.stats.queries for g in clocked),
        same_tokens=sum(a.token_ids == b.token_ids for a, b in zip(clocked, batched, strict=False)),
    )


def _gather_shards(decoded: dict, seconds: dict, prefill: dict) -> tuple[dict, dict, dict]:
    """Every process's generations by batch index, and the seconds summed, in every process."""
    import torch.distributed as dist

    shares: list = [None] * dist.get_world_size()
    dist.all_gather_object(shares, (decoded, seconds, prefill))
    merged: dict = {label: {} for label in decoded}
    for parts, _, _ in shares:
        for label, batches in parts.items():
            merged[label].update(batches)
    return (
        merged,
        {label: sum(share[1][label] for share in shares) for label in seconds},
        {label: sum(share[2][label] for share in shares) for label in prefill},
    )


def _result(
    label: str,
    decoder: Decoder,
    task: Task,
    examples: Sequence[Example],
    gens: list[Generation],
    ar_gens: list[Generation],
    seconds: float,
    prefill_seconds: float,
    batch_size: int,
) -> EvalResult:
    grades = task.grade_all(examples, [g.text for g in gens])
    knobs = describe_decoder(decoder)
    steps: dict[int, int] = {}
    records = []
    agreements = []
    for example, gen, grade, ar_gen in zip(examples, gens, grades, ar_gens, strict=True):
        same, rate = metrics.token_agreement(gen.token_ids, ar_gen.token_ids)
        agreements.append((same, rate))
        for k, v in gen.stats.tokens_per_step.items():
            steps[k] = steps.get(k, 0) + v
        records.append(
            {
                "label": label,
                "decoder": decoder.name,
                "id": example.id,
                "prompt": example.prompt,
                "reference": example.reference,
                "output": gen.text,
                "token_ids": gen.token_ids,
                "finish_reason": gen.finish_reason,
                "correct": grade.correct,
                "score": grade.score,
                "detail": grade.detail,
                "tokens": gen.stats.tokens,
                "nfe": gen.stats.nfe,
                "tpf": round(gen.stats.tpf, 4),
                "queries": gen.stats.queries,
                "agree_exact": same,
                "agree_tokens": round(rate, 4),
            }
        )
    n = len(examples)
    return EvalResult(
        label=label,
        decoder=decoder.name,
        knobs=knobs,
        n=n,
        accuracy=100.0 * sum(g.correct for g in grades) / n,
        score=sum(g.score for g in grades) / n,
        nfe=sum(g.stats.nfe for g in gens),
        tokens=sum(g.stats.tokens for g in gens),
        seconds=seconds,
        prefill_seconds=prefill_seconds,
        batch_size=batch_size,
        agree_exact=100.0 * sum(s for s, _ in agreements) / n,
        agree_tokens=sum(r for _, r in agreements) / n,
        tokens_per_step=steps,
        records=records,
        queries=sum(g.stats.queries for g in gens),
    )


def evaluate(
    model: Model, task: Task, decoder: Decoder | str = "sbd", examples: Sequence[Example] | None = None, **options
) -> EvalResult:
    """One decoder against the same model's AR (measured in the same run); see `compare` for options.

    With decoder "ar" (or an ARDecoder) the result is the AR run itself (speedup 1)."""
    if isinstance(decoder, str):
        decoder = build_decoder(decoder)
    label = AR if _is_greedy_ar(decoder) else decoder.name
    return compare(model, task, {} if label == AR else {label: decoder}, examples, **options)[label]


def _is_greedy_ar(decoder: Decoder) -> bool:
    return isinstance(decoder, ARDecoder) and decoder.sampler.temperature == 0


def sweep_label(knob: str, value: Any) -> str:
    return f"{knob}={value}"


def sweep(
    model: Model,
    task: Task,
    decoder: str,
    knob: str,
    values: Sequence[Any],
    examples: Sequence[Example] | None = None,
    knobs: dict[str, Any] | None = None,
    **options,
) -> SweepResult:
    """Decoder `decoder` (a build_decoder name) at each value of `knob` (other knobs from `knobs`),
    interleaved with AR over the same examples; the accuracy-vs-TPF curve and its AUP."""
    if not values:
        raise FastForwardError(f"the sweep over {knob!r} has no values")
    base = dict(knobs or {})
    decoders = {sweep_label(knob, v): build_decoder(decoder, **{**base, knob: v}) for v in values}
    results = compare(model, task, decoders, examples, **options)
    return SweepResult(knob, list(values), [results[label] for label in decoders], results[AR])


def parse_sweep(spec: str) -> tuple[str, list[Any]]:
    """ "gamma=0,0.1,0.35" → ("gamma", [0.0, 0.1, 0.35]); knob names may use dashes; values are typed
    and checked by the decoder registry's declaration of the knob."""
    name, sep, raw = spec.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or not raw.strip():
        raise FastForwardError(f"--sweep {spec!r} must look like knob=v1,v2,..., e.g. gamma=0,0.1,0.35,1")
    knobs = registry.all_knobs()
    if name not in knobs:
        raise FastForwardError(f"cannot sweep {name!r}: not a decoder knob; choose one of {', '.join(knobs)}")
    return name, [knobs[name].parse(item) for item in raw.split(",") if item.strip()]
