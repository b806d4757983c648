"""fastforward's own CPU kernels (`csrc/`), compiled once per machine, for x86 CPUs with AVX2 or AVX-512.

Two operators, both computing each row (a token) with the same instructions whatever else shares the
call, which is what makes a block's logits the same bits as its tokens' 1-token logits:

- `fastforward::w4a8_linear`: int4 weights times int8 activations (`w4a8.W4A8Linear`);
- `fastforward::exact_attention`: attention of each query over its own visible keys, in key order
  (`attention.row_invariant_attention`, the `--exact` path).

They are written once against `csrc/simd.h` and built for the widest instruction set the CPU has:
AVX-512 with VNNI (16 lanes, VPDPBUSD), else AVX2 (8 lanes; Haswell and Zen onwards). Built with
torch's C++ extension builder (a C++ compiler and ninja; `setup.sh` builds them ahead of first use).
Where they cannot be built (said once, with the reason) or the CPU has neither, int4 keeps PyTorch's
kernel and `--exact` attention its chunked SDPA calls.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import threading
from pathlib import Path

import torch

from fastforward.errors import FastForwardError

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("w4a8.cpp", "exact_attention.cpp")]
COMMON = ["-O3", "-mf16c", "-fopenmp", "-ffp-contract=off"]  # no fused multiply-adds: the tests recompute the bits
FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", *COMMON],
    "avx2": ["-mavx2", "-mfma", *COMMON],
}

_lock = threading.Lock()


def instruction_set() -> str | None:
    """The widest instruction set the kernels are built for here: "avx512" (with VNNI), "avx2" or None
    (torch's private CPU probes; a torch without them answers None). FASTFORWARD_NATIVE_ISA=avx2 asks
    for the narrower build on an AVX-512 CPU (to compare the two)."""
    asked = os.environ.get("FASTFORWARD_NATIVE_ISA")
    if asked not in (None, "", "avx2"):
        raise FastForwardError(f"FASTFORWARD_NATIVE_ISA={asked!r}: only avx2 may be asked for (or leave it unset)")
    probe = {name: getattr(torch.cpu, f"_is_{name}_supported", lambda: False)() for name in ("avx512", "vnni", "avx2")}
    found = "avx512" if probe["avx512"] and probe["vnni"] else "avx2" if probe["avx2"] else None
    return "avx2" if found and asked else found


@functools.cache
def available() -> bool:
    """Whether the `fastforward::` operators run here: builds them on first call (about 20 s, then
    cached under ~/.cache/fastforward or $TORCH_EXTENSIONS_DIR). A failed build is said once per
    machine, with its first error and its log, and not tried again until the sources change or
    `python -m fastforward.cpu.native` asks for it."""
    isa = instruction_set()
    if isa is None:
        _say_once(_root() / "no-simd.txt", f"fastforward: this CPU has neither AVX2 nor AVX-512; {FALLBACK}")
        return False
    build = _build_directory(isa)
    failed = build / FAILED
    if failed.is_file() and failed.read_text().split("\n", 1)[0] == _sources_digest():
        return False  # said when it failed
    with _lock:
        try:
            _build(isa)
        except Exception as error:  # a missing compiler or ninja, a failed build: the PyTorch paths serve
            reason = first_error(str(error))
            log = build / "build-error.log"
            try:
                build.mkdir(parents=True, exist_ok=True)
                log.write_text(str(error))
                failed.write_text(f"{_sources_digest()}\n{reason}\n")
            except OSError:  # nowhere to keep it: said again by the next process
                pass
            print(
                f"fastforward: its native CPU kernels did not build: {reason}\n  full log: {log}\n  {FALLBACK}; "
                "fix the build and run `python -m fastforward.cpu.native` to try again",
                file=sys.stderr,
            )
            return False
    failed.unlink(missing_ok=True)
    return True


FAILED = "build-failed.txt"  # the sources' digest and the first error of the last failed build
BUILT = "built.txt"  # the sources' digest and the library built from them
# What the fallback costs, measured (docs/results.md, "Precision and exactness"): compiled int4 `ar` ran
# 1.7-1.8x faster on the native kernel than on PyTorch's on a 2-core AVX2 EPYC.
FALLBACK = (
    "PyTorch's kernels serve meanwhile (int4 decoding about 1.7x slower, `--exact` attention on chunked SDPA calls)"
)


def first_error(log: str) -> str:
    """The compiler's first error line in a build log (else the log's first line)."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or ["no output"])[0]


def _sources_digest() -> str:
    """What a build is made of: the sources, the headers beside them, and the flags."""
    digest = hashlib.sha256(repr(FLAGS).encode())
    for path in sorted(SOURCES[0].parent.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    for source in SOURCES:
        digest.update(str(source).encode())
    return digest.hexdigest()[:16]


def _say_once(marker: Path, message: str) -> None:
    """Print `message` the first time any process on this machine gets here (a marker file remembers)."""
    if marker.exists():
        return
    print(message, file=sys.stderr)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(message + "\n")
    except OSError:
        pass


def _build(isa: str) -> None:
    """Load the kernels, building them first unless this build directory holds a library made from
    these sources (`BUILT` names it): then it is loaded directly, without torch's extension builder,
    whose imports and checks cost a fresh process about 0.07 s."""
    build = _build_directory(isa)
    built = build / BUILT
    if built.is_file():
        digest, _, name = built.read_text().partition("\n")
        library = build / name.strip()
        if digest == _sources_digest() and name.strip() and library.is_file():
            torch.ops.load_library(str(library))
            return
    _compile_and_load(isa)
    newest = max(build.glob("*.so"), key=lambda path: path.stat().st_mtime)
    with contextlib.suppress(OSError):  # nowhere to note it: the next process goes through the builder again
        built.write_text(f"{_sources_digest()}\n{newest.name}\n")


def _compile_and_load(isa: str) -> None:
    from torch.utils import cpp_extension

    try:  # the ninja wheel's binary, where the environment's bin folder is not on PATH
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    except ImportError:
        pass
    build = _build_directory(isa)
    build.mkdir(parents=True, exist_ok=True)
    if not any(build.glob("*.so")):
        print("fastforward: compiling its CPU kernels (once per machine, about 20 s)", file=sys.stderr)
    cpp_extension.load(
        "fastforward_native",
        [str(source) for source in SOURCES],
        extra_cflags=FLAGS[isa],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
        is_python_module=False,
    )


def _root() -> Path:
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "fastforward")


def _build_directory(isa: str) -> Path:
    """Per torch version (the extension is built against its headers) and instruction set, under
    $TORCH_EXTENSIONS_DIR or ~/.cache/fastforward."""
    return _root() / f"native-torch{torch.__version__}-{isa}"


# The schemas and their shape functions live here; csrc/ registers the CPU kernels once built.
library = torch.library.Library("fastforward", "FRAGMENT")
library.define("w4a8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor")
library.define("exact_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor")

TILE = 16  # output columns per w4a8 kernel tile


@torch.library.register_fake("fastforward::w4a8_linear", lib=library)
def _(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], codes.shape[0] * TILE)


@torch.library.register_fake("fastforward::exact_attention", lib=library)
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float):
    batch, heads, length, dim = query.shape
    return query.new_empty(batch, length, heads, dim, dtype=torch.float32)


if __name__ == "__main__":  # `python -m fastforward.cpu.native`: build the kernels now (setup.sh), say whether they run
    if instruction_set():
        (_build_directory(instruction_set()) / FAILED).unlink(missing_ok=True)  # asked for: try again
    print("native CPU kernels:", f"built ({instruction_set()})" if available() else "not here: PyTorch's kernels serve")
