"""fastforward's own CPU kernels (`csrc/`), compiled once per machine, for x86 CPUs with AVX2 or AVX-512.

Three operators, each computing each row (a token) with the same instructions whatever else shares the
call, which is what makes a block's logits the same bits as its tokens' 1-token logits:

- `fastforward::w4a8_linear`: int4 weights times int8 activations (`w4a8.W4A8Linear`);
- `fastforward::w4a8_lowrank`: the same with a low-rank update beside the weights, W·x + B·(A·x) in one
  call (`low_rank.W4A8LowRankLinear`);
- `fastforward::exact_attention`: attention of each query over its own visible keys, in key order
  (`attention.row_invariant_attention`, the `--exact` path).

They are written once against `csrc/simd.h` and built for the widest instruction set the CPU has:
AVX-512 with VNNI (16 lanes, VPDPBUSD), else AVX2 (8 lanes; Haswell and Zen onwards). Built with
torch's C++ extension builder (a C++ compiler and ninja; `setup.sh` builds them ahead of first use),
into a folder of $FASTFORWARD_HOME/native named by what the library is made of (the sources' bytes,
the flags, torch and Python), never by where the sources are: checkouts and installs of the same code
share one build. A build is made in a folder of its own and renamed into place when complete, so two
processes building at once never see each other's half-made files.
Where they cannot be built (said once, with the reason) or the CPU has neither, int4 keeps PyTorch's
kernel and `--exact` attention its chunked SDPA calls.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from fastforward.errors import FastForwardError

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("w4a8.cpp", "exact_attention.cpp")]
COMMON = ["-O3", "-mf16c", "-fopenmp", "-ffp-contract=off"]  # no fused multiply-adds: the tests recompute the bits
FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", *COMMON],
    "avx2": ["-mavx2", "-mfma", *COMMON],
}
LDFLAGS = ["-fopenmp"]

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
    """Whether the `fastforward::` operators run here: builds them on first call (once, then kept:
    `_build_directory`). A failed build is said once per machine, with its first error and its
    log, and not tried again until the sources change or `python -m fastforward.cpu.native` asks for it."""
    isa = instruction_set()
    if isa is None:
        _say_once(_root() / "no-simd.txt", f"fastforward: this CPU has neither AVX2 nor AVX-512; {FALLBACK}")
        return False
    build = _build_directory(isa)
    failed = build / FAILED
    if failed.is_file():  # the folder is this build's alone: its failure is these sources' failure
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
                failed.write_text(f"{reason}\n")
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


FAILED = "build-failed.txt"  # the first error of the failed build
BUILT = "built.txt"  # the name of the library in a complete build (written last)
ABANDONED_AFTER = 3600  # seconds after which an unfinished build folder is a stopped process's, not a running one's
# What the fallback costs is measured in docs/notes/2026-11-avx2-kernels.md: the user is told it is slower.
FALLBACK = (
    "PyTorch's kernels serve meanwhile (int4 decoding about 1.7x slower, `--exact` attention on chunked SDPA calls)"
)


def first_error(log: str) -> str:
    """The compiler's first error line in a build log (else the log's first line)."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or ["no output"])[0]


def _sources_digest(isa: str) -> str:
    """What a build is made of, and nothing of where it is: the bytes of the sources and the headers
    beside them (by file name), the flags, and the torch and Python it is built against."""
    digest = hashlib.sha256(repr((FLAGS[isa], LDFLAGS, torch.__version__, sys.implementation.cache_tag)).encode())
    digest.update(platform.machine().encode())
    for path in sorted(SOURCES[0].parent.iterdir()):
        if path.is_file():
            data = path.read_bytes()
            for part in (path.name.encode(), data):  # each with its length: no two splits hash alike
                digest.update(len(part).to_bytes(8, "little") + part)
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
    """Load the kernels, building them first unless their folder holds a complete build: then the
    library is loaded directly, without torch's extension builder, whose imports and checks would
    cost every fresh process start-up time."""
    build = _build_directory(isa)
    library = _built_library(build)
    if library is not None:
        torch.ops.load_library(str(library))
        return
    build.parent.mkdir(parents=True, exist_ok=True)
    for left in build.parent.glob(".*-*"):  # builds of processes that were stopped midway
        with contextlib.suppress(OSError):
            if time.time() - left.stat().st_mtime > ABANDONED_AFTER:
                shutil.rmtree(left)
    # In a folder of this process's own, renamed into place once complete: another process building
    # the same sources at the same moment never reads or overwrites half-made files.
    making = Path(tempfile.mkdtemp(prefix=f".{build.name}-", dir=build.parent))
    try:
        _compile_and_load(isa, making)  # loads the library from `making`: the rename leaves it loaded
        newest = max(making.glob("*.so"), key=lambda path: path.stat().st_mtime)
        (making / BUILT).write_text(f"{newest.name}\n")
        if _built_library(build) is None:  # else another process completed it first: its build serves
            shutil.rmtree(build, ignore_errors=True)  # a failed or incomplete build of these sources
            with contextlib.suppress(OSError):  # lost a race to rename: the winner's build is the same
                making.rename(build)
    finally:
        shutil.rmtree(making, ignore_errors=True)


def _built_library(build: Path) -> Path | None:
    """The library of a complete build in folder `build`, or None."""
    try:
        name = (build / BUILT).read_text().strip()
    except OSError:
        return None
    library = build / name
    return library if name and library.is_file() else None


def _compile_and_load(isa: str, directory: Path) -> None:
    from torch.utils import cpp_extension

    try:  # the ninja wheel's binary, where the environment's bin folder is not on PATH
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    except ImportError:
        pass
    print("fastforward: compiling its CPU kernels (once per machine, about 20 s)", file=sys.stderr)
    cpp_extension.load(
        "fastforward_native",
        [str(source) for source in SOURCES],
        extra_cflags=list(FLAGS[isa]),  # copies: the builder appends to the lists it is given
        extra_ldflags=list(LDFLAGS),
        build_directory=str(directory),
        is_python_module=False,
    )


def _root() -> Path:
    """Where builds are kept: $TORCH_EXTENSIONS_DIR (torch's own setting for extension builds) if set,
    else $FASTFORWARD_HOME (default ~/.cache/fastforward), in a folder `native`."""
    home = os.environ.get("TORCH_EXTENSIONS_DIR") or os.environ.get("FASTFORWARD_HOME")
    return Path(home or Path.home() / ".cache" / "fastforward") / "native"


def _build_directory(isa: str) -> Path:
    """The folder of the build of these sources for instruction set `isa` (`_sources_digest`)."""
    return _root() / f"{isa}-{_sources_digest(isa)}"


# The schemas and their shape functions live here; csrc/ registers the CPU kernels once built.
library = torch.library.Library("fastforward", "FRAGMENT")
library.define("w4a8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor")
library.define("w4a8_lowrank(Tensor x, Tensor codes, Tensor scales, Tensor up_groups, int rank) -> Tensor")
library.define("exact_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor")

TILE = 16  # output columns per w4a8 kernel tile


@torch.library.register_fake("fastforward::w4a8_linear", lib=library)
def _(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], codes.shape[0] * TILE)


@torch.library.register_fake("fastforward::w4a8_lowrank", lib=library)
def _(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, up_groups: torch.Tensor, rank: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], up_groups.shape[0] * TILE)


@torch.library.register_fake("fastforward::exact_attention", lib=library)
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float):
    batch, heads, length, dim = query.shape
    return query.new_empty(batch, length, heads, dim, dtype=torch.float32)


if __name__ == "__main__":  # `python -m fastforward.cpu.native`: build the kernels now (setup.sh), say whether they run
    if instruction_set():
        (_build_directory(instruction_set()) / FAILED).unlink(missing_ok=True)  # asked for: try again
    print("native CPU kernels:", f"built ({instruction_set()})" if available() else "not here: PyTorch's kernels serve")
