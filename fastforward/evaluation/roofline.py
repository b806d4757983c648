"""The SBD paper's roofline model of a block forward (Sec. 4, Fig. 6 and 11), and measured block costs.

A forward of `block` new tokens per sequence, against `kv_len` cached keys, for `batch` sequences,
takes (eq. 15) max(flops / peak flops, bytes / bandwidth) per operation, summed over the fused
attention kernel and the linear layers of one transformer layer. From it:

- Table 3, the slowdown of a block forward over a one-token (NTP) forward: time(k) / time(1);
- Table 4, the wall-clock speedup of SBD with NFE speedup k/l (eq. 16-17):
  speedup(l, k) = k·time(1) / (time(2k) + (l − 1)·time(k)) — the first forward of a block carries
  the previous, finished block along (2k tokens), the l − 1 others only the k masked tokens.

`measure_block_cost` times the same quantity, time(k) / time(1), for a real model on this machine,
and `wallclock_speedup` turns either kind of cost into eq. 16 speedups.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from fastforward.model import visibility

if TYPE_CHECKING:
    from fastforward.model import Model
    from fastforward.model.cache import KVCache

# The grids the paper prints.
PAPER_BLOCKS = (1, 2, 4, 8, 16, 32, 64)
PAPER_KV_LENS = (2**4, 2**8, 2**10, 2**12, 2**14, 2**16, 2**20, 2**22)
PAPER_SLOWDOWN_BATCHES = (1, 4, 8, 16)
PAPER_SPEEDUP_BATCHES = (1, 4, 8)
PAPER_SPEEDUP_BLOCKS = (8, 16, 32, 64)
PAPER_NFE_SPEEDUPS = (2, 4, 8)


@dataclass(frozen=True)
class Hardware:
    """Accelerator constants (paper Fig. 6: an H100 running FP8 weights, BF16 attention)."""

    name: str = "H100 (FP8)"
    bytes_per_weight: float = 1  # also used for activations in the paper's GEMM and attention I/O
    peak_flops: float = 1978e12  # FLOP/s for the linear layers (FP8)
    attention_flops: float = 989e12  # FLOP/s for attention (BF16)
    bandwidth: float = 3.35 * 1024**4  # memory bandwidth, bytes/s
    bytes_per_kv: float = 1  # bytes per cached K or V element

    def __post_init__(self) -> None:
        for name in ("bytes_per_weight", "peak_flops", "attention_flops", "bandwidth", "bytes_per_kv"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Hardware.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Transformer:
    """Transformer shape (paper Fig. 6: a standard 8B model; Llama-3-8B has 32 layers).

    paper_quirks=True reproduces the paper's Fig. 11 code exactly, so that Tables 3 and 4 come out
    digit for digit. That code (i) gives the K and V projections a width of heads × kv_heads
    (32 × 8 = 256) where a GQA model has kv_heads × head_dim (8 × 128 = 1024); (ii) gives the FFN
    up/down projections an inner width of hidden × ffn (4096 × 16384) where the model has ffn
    (16384), which makes the FFN weights ~4096× too large and the model more memory bound than it
    is; and (iii) has no gate projection (a SwiGLU FFN has three matrices). paper_quirks=False uses
    the real widths and a gated FFN.

    The model is per layer: every layer costs the same, so `layers` only scales absolute times and
    cancels in every ratio (the paper's code computes one layer; the embedding and the output
    layer are left out either way).
    """

    hidden: int = 4096
    ffn_mult: float = 4
    heads: int = 32
    head_dim: int | None = None  # default hidden // heads
    kv_heads: int = 8
    layers: int = 32
    paper_quirks: bool = True

    def __post_init__(self) -> None:
        for name in ("hidden", "ffn_mult", "heads", "kv_heads", "layers"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Transformer.{name} must be > 0, got {getattr(self, name)}")
        if self.head_dim is not None and self.head_dim <= 0:
            raise ValueError(f"Transformer.head_dim must be > 0, got {self.head_dim}")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def ffn(self) -> int:
        return int(round(self.ffn_mult * self.hidden))

    @classmethod
    def from_hf_config(cls, config: Any, paper_quirks: bool = False) -> Transformer:
        """The shape of a Hugging Face decoder config (llama-style field names)."""
        hidden = config.hidden_size
        heads = config.num_attention_heads
        return cls(
            hidden=hidden,
            ffn_mult=config.intermediate_size / hidden,
            heads=heads,
            head_dim=getattr(config, "head_dim", None) or hidden // heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            layers=config.num_hidden_layers,
            paper_quirks=paper_quirks,
        )


H100 = Hardware()
LLAMA_8B = Transformer()


# ---- the roofline (paper Fig. 11) -----------------------------------------------------------------


def gemm_time(m: int, n: int, k: int, hw: Hardware = H100) -> tuple[float, float]:
    """Seconds and FLOPs of C = A @ B with A [m, k] and B [k, n] (read A and B, write C)."""
    io = (m * k + n * k + m * n) * hw.bytes_per_weight
    flops = 2.0 * m * n * k
    return max(io / hw.bandwidth, flops / hw.peak_flops), flops


def attention_time(block: int, kv_len: int, batch: int = 1, hw: Hardware = H100, tf: Transformer = LLAMA_8B) -> float:
    """One fused attention kernel (FlashAttention-like): Q, K, V read once, the output written once.

    As in the paper, the block's own keys are not added to kv_len and softmax I/O is free.
    """
    tokens = block * batch
    q_width = tf.heads * tf.dim_per_head
    bytes_q = tokens * q_width * hw.bytes_per_weight
    bytes_kv = 2 * batch * kv_len * tf.kv_heads * tf.dim_per_head * hw.bytes_per_kv
    bytes_out = tokens * q_width * hw.bytes_per_weight
    # QKᵀ and PV. The paper's call gemm(tokens, kv_len, width) is taken for its FLOPs only: each
    # sequence's queries meet only its own keys, so tokens × kv_len is exact per batch.
    flops = 2 * gemm_time(tokens, kv_len, q_width, hw)[1]
    return max((bytes_q + bytes_kv + bytes_out) / hw.bandwidth, flops / hw.attention_flops)


def linear_time(block: int, batch: int = 1, hw: Hardware = H100, tf: Transformer = LLAMA_8B) -> float:
    """The linear layers of one transformer layer: FFN and the Q, K, V and output projections."""
    tokens = block * batch
    q_width = tf.heads * tf.dim_per_head
    if tf.paper_quirks:  # see Transformer's docstring
        kv_width, ffn_width, ffn_in = tf.heads * tf.kv_heads, tf.hidden * tf.ffn, 1
    else:
        kv_width, ffn_width, ffn_in = tf.kv_heads * tf.dim_per_head, tf.ffn, 2  # gate and up
    total = ffn_in * gemm_time(tokens, tf.hidden, ffn_width, hw)[0]  # FFN up (+ gate)
    total += gemm_time(tokens, ffn_width, tf.hidden, hw)[0]  # FFN down
    total += gemm_time(tokens, tf.hidden, q_width, hw)[0]  # Q
    total += 2 * gemm_time(tokens, tf.hidden, kv_width, hw)[0]  # K and V
    total += gemm_time(tokens, q_width, tf.hidden, hw)[0]  # output
    return total


def layer_time(block: int, kv_len: int, batch: int = 1, hw: Hardware = H100, tf: Transformer = LLAMA_8B) -> float:
    """Seconds for one layer's forward of `block` new tokens per sequence (what the paper's code gives)."""
    return attention_time(block, kv_len, batch, hw, tf) + linear_time(block, batch, hw, tf)


def block_time(block: int, kv_len: int, batch: int = 1, hw: Hardware = H100, tf: Transformer = LLAMA_8B) -> float:
    """Seconds for a whole forward (all `tf.layers` layers; no embedding or output layer)."""
    if block <= 0 or kv_len < 0 or batch <= 0:
        raise ValueError(f"need block > 0, kv_len >= 0, batch > 0; got {block}, {kv_len}, {batch}")
    return tf.layers * layer_time(block, kv_len, batch, hw, tf)


def slowdown(block: int, kv_len: int, batch: int = 1, hw: Hardware = H100, tf: Transformer = LLAMA_8B) -> float:
    """time(block) / time(1): the cost of a block forward relative to a one-token forward."""
    return block_time(block, kv_len, batch, hw, tf) / block_time(1, kv_len, batch, hw, tf)


def wallclock_speedup(cost: Callable[[int], float] | Mapping[int, float], block: int, nfe_speedup: float) -> float:
    """Eq. 16 with l = k / NFE speedup (eq. 17): k·time(1) / (time(2k) + (l − 1)·time(k)).

    `cost` maps a block size to a forward time (any unit) or to a slowdown time(k)/time(1); it
    needs 1, k and 2k. l may be fractional (an average number of forwards per block).
    """
    if nfe_speedup <= 0 or nfe_speedup > block:
        raise ValueError(f"NFE speedup must be in (0, k={block}], got {nfe_speedup}")
    time_of = cost.__getitem__ if isinstance(cost, Mapping) else cost
    forwards = block / nfe_speedup
    return block * time_of(1) / (time_of(2 * block) + (forwards - 1) * time_of(block))


# ---- tables ---------------------------------------------------------------------------------------


@dataclass
class Table:
    """A grid of figures: rows are KV-cache lengths, columns block sizes."""

    title: str
    rows: list[int]
    cols: list[int]
    values: list[list[float | None]]
    batch: int
    nfe_speedup: float | None = None
    row_label: str = "KV cache length"
    col_label: str = "block size k"

    def at(self, row: int, col: int) -> float | None:
        return self.values[self.rows.index(row)][self.cols.index(col)]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self, digits: int = 3) -> str:
        head = f"{self.row_label:>20} |" + "".join(f"{c:>8}" for c in self.cols)
        lines = [self.title, f"{'':>20} | {self.col_label}", head, "-" * len(head)]
        for row, values in zip(self.rows, self.values, strict=True):
            cells = "".join(f"{v:>8.{digits}f}" if v is not None else f"{'—':>8}" for v in values)
            lines.append(f"{_kv_label(row):>20} |{cells}")
        return "\n".join(lines)


def _kv_label(n: int) -> str:
    if n > 0 and n & (n - 1) == 0:
        return f"2^{int(math.log2(n))} ({n:,})"
    return f"{n:,}"


def _hw_tag(hw: Hardware, tf: Transformer) -> str:
    shape = f"hidden {tf.hidden}, {tf.heads}/{tf.kv_heads} heads"
    return f"{hw.name}, {shape}{'' if tf.paper_quirks else ', corrected widths'}"


def slowdown_table(
    batches: Iterable[int] = PAPER_SLOWDOWN_BATCHES,
    kv_lens: Sequence[int] = PAPER_KV_LENS,
    blocks: Sequence[int] = PAPER_BLOCKS,
    hw: Hardware = H100,
    tf: Transformer = LLAMA_8B,
) -> list[Table]:
    """Table 3: one table per batch size of time(k) / time(1)."""
    return [
        Table(
            title=f"Table 3 — block-forward slowdown time(k)/time(1), batch {b} [{_hw_tag(hw, tf)}]",
            rows=list(kv_lens),
            cols=list(blocks),
            values=[[slowdown(k, kv, b, hw, tf) for k in blocks] for kv in kv_lens],
            batch=b,
        )
        for b in batches
    ]


def speedup_table(
    nfe_speedups: Iterable[float] = PAPER_NFE_SPEEDUPS,
    batches: Iterable[int] = PAPER_SPEEDUP_BATCHES,
    kv_lens: Sequence[int] = PAPER_KV_LENS,
    blocks: Sequence[int] = PAPER_SPEEDUP_BLOCKS,
    hw: Hardware = H100,
    tf: Transformer = LLAMA_8B,
) -> list[Table]:
    """Table 4: one table per (NFE speedup, batch) of eq. 16 wall-clock speedups (— where k < NFE speedup)."""
    tables = []
    batches = list(batches)
    for nfe in nfe_speedups:
        for b in batches:
            values = []
            for kv in kv_lens:

                def cost(k: int, kv: int = kv, b: int = b) -> float:
                    return block_time(k, kv, b, hw, tf)

                values.append([wallclock_speedup(cost, k, nfe) if k >= nfe else None for k in blocks])
            tables.append(
                Table(
                    title=f"Table 4 — wall-clock speedup, NFE speedup {nfe:g}, batch {b} [{_hw_tag(hw, tf)}]",
                    rows=list(kv_lens),
                    cols=list(blocks),
                    values=values,
                    batch=b,
                    nfe_speedup=nfe,
                )
            )
    return tables


# ---- measured block cost --------------------------------------------------------------------------


@dataclass
class BlockCost:
    """Measured forward times of k-token blocks against a cache of `cache_len` entries."""

    cache_len: int
    batch: int
    repeats: int
    dtype: str
    device: str
    threads: int
    times: dict[int, float] = field(default_factory=dict)  # median seconds per forward
    ratios: dict[int, float] = field(default_factory=dict)  # time(k) / time(1)
    fastest: dict[int, float] = field(default_factory=dict)  # min seconds: less hurt by other load on the machine
    layout: str = "SBD step"  # or "causal block" (`measure_block_cost(..., dense_mask=False)`)

    def speedups(self, nfe_speedups: Iterable[float] = PAPER_NFE_SPEEDUPS) -> dict[float, dict[int, float]]:
        """Eq. 16 speedups these costs predict, for every k whose 2k was measured too and k ≥ NFE speedup."""
        out: dict[float, dict[int, float]] = {}
        for nfe in nfe_speedups:
            out[nfe] = {
                k: wallclock_speedup(self.times, k, nfe) for k in sorted(self.times) if 2 * k in self.times and k >= nfe
            }
        return out

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_block_cost(
    model: Model,
    ks: Iterable[int] = PAPER_BLOCKS,
    cache_len: int = 256,
    repeats: int = 10,
    warmup: int = 2,
    batch: int = 1,
    read_logits: bool = True,
    cache: KVCache | None = None,
    seed: int = 0,
    dense_mask: bool = True,
) -> BlockCost:
    """Time a forward of k new tokens against a `cache_len`-token cache, for each k, on `model`.

    The cache is filled by one prefill of random ids (into `cache` when given: it must be empty).
    Each timed forward is an SBD decoding step — k tokens that see the whole cache and each other,
    their logits read (read_logits) and their entries dropped (a truncate), so the cache is the same
    for every repeat. Block sizes are interleaved within each repeat so drift hits all alike; the
    median of `repeats` timings after `warmup` untimed rounds is reported. k=1 is always measured.
    dense_mask=False runs the same tokens through the model's own mask-free causal path instead:
    the same work, so comparing the two tells what the dense SBD mask itself costs.
    """
    ks = sorted(set(ks) | {1})
    if ks[0] <= 0 or cache_len < 0 or repeats <= 0 or batch <= 0:
        raise ValueError(f"need k > 0, cache_len >= 0, repeats > 0, batch > 0; got {ks}, {cache_len}, {repeats}")
    limit = model.max_context
    if limit is not None and cache_len + ks[-1] > limit:
        raise ValueError(f"cache_len + max k = {cache_len + ks[-1]} exceeds the model's context of {limit}")
    device = model.device
    cache = cache if cache is not None else model.new_cache()
    if cache.get_seq_length() != 0:
        raise ValueError("measure_block_cost fills the cache itself: pass an empty one")
    vocab = model.hf.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, vocab, (batch, n), generator=gen).to(device)

    from fastforward.model import Layout  # model imports transformers: keep the roofline import light

    with torch.inference_mode():
        if cache_len:
            prefill = Layout(
                tokens=ids(cache_len),
                positions=torch.arange(cache_len, device=device).expand(batch, -1),
                visibility=visibility.over_cache(visibility.causal(cache_len, device), 0, batch=batch),
            )
            model.run(prefill, cache)
        layouts = {}
        for k in ks:
            layouts[k] = Layout(
                tokens=ids(k),
                positions=torch.arange(cache_len, cache_len + k, device=device).expand(batch, -1),
                visibility=visibility.over_cache(visibility.sbd_decode(0, k, device), cache_len, batch=batch)
                if dense_mask
                else None,
                read=torch.arange(k, device=device) if read_logits else None,
            )
        samples: dict[int, list[float]] = {k: [] for k in ks}
        for round_ in range(warmup + repeats):
            for k in ks:
                _sync(device)
                start = time.perf_counter()
                model.run(layouts[k], cache)
                cache.truncate(cache_len)
                _sync(device)
                if round_ >= warmup:
                    samples[k].append(time.perf_counter() - start)
                if cache.get_seq_length() != cache_len:
                    raise RuntimeError(f"cache length changed to {cache.get_seq_length()} (expected {cache_len})")
    times = {k: statistics.median(v) for k, v in samples.items()}
    return BlockCost(
        cache_len=cache_len,
        batch=batch,
        repeats=repeats,
        dtype=_precision(model),
        device=str(device),
        threads=torch.get_num_threads(),
        times=times,
        ratios={k: t / times[1] for k, t in times.items()},
        fastest={k: min(v) for k, v in samples.items()},
        layout="SBD step" if dense_mask else "causal block",
    )


def _precision(model: Model) -> str:
    """The weights' dtype, with the quantization, the attention and compilation when not the defaults."""
    parts = [str(model.dtype).removeprefix("torch.")]
    quantized = getattr(model.hf.config, "fastforward_quantization", None)
    if quantized:
        parts.append(f"{quantized} linears")
    if model.hf.config._attn_implementation != "sdpa":
        parts.append(f"{model.hf.config._attn_implementation} attention")
    if model.compiled_forward is not None:
        parts.append("compiled steps")
    if model.step_graphs is not None and not model.step_graphs.failed:
        parts.append("CUDA graphs" if model.step_graphs.capture else "fixed-shape steps")
    return " + ".join(parts)


def format_block_cost(cost: BlockCost, nfe_speedups: Iterable[float] = PAPER_NFE_SPEEDUPS) -> str:
    """Measured time(k), time(k)/time(1), and the eq. 16 speedups they predict, as text."""
    ks = sorted(cost.times)
    lines = [
        f"Measured block cost ({cost.layout}s): cache {cost.cache_len} tokens, batch {cost.batch}, {cost.dtype}, "
        f"{cost.device}, {cost.threads} threads, median of {cost.repeats}",
        f"{'k':>12} |" + "".join(f"{k:>8}" for k in ks),
        f"{'time (ms)':>12} |" + "".join(f"{cost.times[k] * 1e3:>8.2f}" for k in ks),
        f"{'time(k)/t(1)':>12} |" + "".join(f"{cost.ratios[k]:>8.3f}" for k in ks),
    ]
    speedups = cost.speedups(nfe_speedups)
    cols = sorted({k for row in speedups.values() for k in row})
    if cols:
        lines += ["", "Eq. 16 wall-clock speedup these costs predict (NFE speedup = k / forwards per block)"]
        lines.append(f"{'NFE speedup':>12} |" + "".join(f"{'k=' + str(k):>8}" for k in cols))
        for nfe, row in speedups.items():
            cells = "".join(f"{row[k]:>8.3f}" if k in row else f"{'—':>8}" for k in cols)
            lines.append(f"{nfe:>12g} |{cells}")
    return "\n".join(lines)
