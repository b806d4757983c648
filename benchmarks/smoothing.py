"""How close each quantization's next-token choices are to fp32's, teacher-forced (`fastforward.cpu.smoothing`).

For `pycode` test examples (prompt, then the reference continuation), one forward of the fp32 model
and of each quantized variant over the whole text; over the reference's tokens, the share where the
variant's argmax equals fp32's and the mean KL(fp32 || variant). Variants: int8 without smoothing,
int8 smoothed as `load_model` does it (calibrated on the `pycode` train split), and int4 on each
int4 kernel (the native one of fastforward.cpu.w4a8 where it builds, and PyTorch's). A cheap,
smooth proxy for the greedy agreement and accuracy of whole decodes (`fastforward eval --quantize
... --out DIR`; docs/notes/2026-11-quantization-quality.md compares such runs' outputs), and the
seconds quantizing took (calibration included). Writes JSON with the load average.

    python benchmarks/smoothing.py                 # 40 examples, about 3 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from unittest import mock

import torch
from common import RESULTS, load_average, log, set_threads, write_report

from fastforward.cpu.quantize import quantize
from fastforward.cpu.smoothing import calibration_ids
from fastforward.evaluation.report import format_table
from fastforward.model import load_model
from fastforward.tasks import get_task

# label: (scheme, smoothed, int4 kernel: fastforward.cpu.w4a8's "native" or "pytorch")
VARIANTS = {
    "int8 unsmoothed": ("int8", False, "native"),
    "int8 smoothed": ("int8", True, "native"),
    "int4": ("int4", True, "native"),
    "int4 pytorch kernel": ("int4", True, "pytorch"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=40, help="pycode test examples")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "smoothing.json")
    args = parser.parse_args()
    threads = set_threads(args.threads)
    load_before = load_average()
    reference = load_model("smollm2-135m")
    tokenizer = reference.tokenizer
    texts = [
        (tokenizer(ex.prompt)["input_ids"], tokenizer("\n" + ex.reference)["input_ids"])
        for ex in get_task("pycode").examples("test", n=args.n)
    ]

    def logits(hf, prompt: list[int], continuation: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            out = hf(input_ids=torch.tensor([prompt + continuation])).logits[0]
        return out[len(prompt) - 1 : -1].float().log_softmax(-1)

    wanted = [logits(reference.hf, *text) for text in texts]
    rows = []
    for label, (scheme, smoothed, kernel) in VARIANTS.items():
        model = load_model("smollm2-135m")
        started = time.perf_counter()  # what quantizing costs at load, calibration included
        with mock.patch.dict(os.environ, {"FASTFORWARD_INT4_KERNEL": kernel}):
            quantize(model.hf, scheme, calibration=calibration_ids(tokenizer) if smoothed else None)
        quantize_s = time.perf_counter() - started
        agree = total = 0
        divergence = 0.0
        for text, want in zip(texts, wanted, strict=True):
            got = logits(model.hf, *text)
            agree += int((got.argmax(-1) == want.argmax(-1)).sum())
            total += len(want)
            divergence += float(torch.nn.functional.kl_div(got, want, log_target=True, reduction="sum"))
        rows.append(
            {
                "variant": label,
                "top1_agreement": agree / total,
                "mean_kl": divergence / total,
                "tokens": total,
                "quantize_s": quantize_s,
            }
        )
        log(f"{label}: done")
    columns = [
        ("variant", "variant", str),
        ("argmax = fp32's", "top1_agreement", lambda v: f"{v:.3f}"),
        ("mean KL", "mean_kl", lambda v: f"{v:.4f}"),
        ("tokens", "tokens", str),
        ("quantize s", "quantize_s", lambda v: f"{v:.1f}"),
    ]
    log(format_table(rows, columns))
    write_report(args.out, load_before, threads, n=args.n, rows=rows)


if __name__ == "__main__":
    main()
