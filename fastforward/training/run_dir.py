"""A training run's directory: its lock, its record, its checkpoints and its final model.

    out/train_config.json        what was asked (a resumed run must ask the same)
    out/metrics.jsonl            one JSON record per step, and one per evaluation
    out/checkpoints/step-NNNNNN  accelerate state: weights, optimizer, scheduler, RNG, step; manifest.json
    out/config.json, *.safetensors, tokenizer files   the final model (`--model out` loads it)
    out/.lock                    flock'ed by the run in progress (holds its pid)

Checkpoints are written to a hidden temporary directory and renamed into place, so a crash never
leaves a half-written `step-*` behind; their manifest (sizes and sha256 of every file, written last)
catches what a rename cannot, such as files truncated by a lost write, and a resume falls back to
the newest checkpoint that matches its manifest.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from torch import nn

from fastforward.errors import FastForwardError
from fastforward.model import MASK_CONFIG_KEY, PRESETS, Model, adapters, quiet_progress

RUN_CONFIG = "train_config.json"
METRICS = "metrics.jsonl"
MANIFEST = "manifest.json"
LOCK = ".lock"
CHECKPOINT = re.compile(r"step-(\d+)")
# Options that do not change the trained weights: a resumed run may change them. (batch_size and grad_accum
# only split a step's rows, whose number, rows_per_step, the run record holds.)
RESUME_NEUTRAL = {"eval_every", "save_every", "keep_checkpoints", "max_eval_batches", "batch_size", "grad_accum"}


def write_json_atomic(path: Path, value: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def lock_run_dir(out: Path) -> Iterator[None]:
    """Hold an exclusive flock on `out/.lock` so that two runs cannot share (or wipe) one directory.

    The OS releases the lock when the process exits, however it exits: a killed run leaves no stale lock.
    """
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise FastForwardError(
                f"{out} is in use by another training run (pid {holder}); wait for it or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def checkpoints(out_dir: str | Path) -> list[Path]:
    """The finished checkpoints of a run, oldest first (hidden temporaries are not among them)."""
    root = Path(out_dir) / "checkpoints"
    found = [(int(m[1]), p) for p in root.glob("step-*") if (m := CHECKPOINT.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def _step(checkpoint: Path) -> int:
    return int(CHECKPOINT.fullmatch(checkpoint.name)[1])


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_manifest(directory: Path) -> None:
    """Record the size and sha256 of every file in `directory`; written last, so it vouches for all of them."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    entries = {p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    write_json_atomic(directory / MANIFEST, {"files": entries})


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Why `checkpoint` cannot be resumed from, or None when every file matches its manifest."""
    try:
        files = json.loads((checkpoint / MANIFEST).read_text())["files"]
        expected = {name: (int(entry["size"]), str(entry["sha256"])) for name, entry in files.items()}
    except FileNotFoundError:
        return f"no {MANIFEST} (it is written last, so the checkpoint is incomplete or predates manifests)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"unreadable {MANIFEST} ({type(exc).__name__}: {exc})"
    for name, (size, _) in expected.items():  # sizes first: cheap, and they catch truncation
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, its manifest says {size}"
    for name, (_, digest) in expected.items():
        if _sha256(checkpoint / name) != digest:
            return f"{name} does not match the sha256 in its manifest"
    return None


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The checkpoint a resume starts from: the newest that matches its manifest (a warning names each skipped)."""
    for checkpoint in reversed(checkpoints(out_dir)):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint
        _warn(f"skipping the damaged checkpoint {checkpoint}: {problem}")
    return None


def model_identity(name: str) -> str:
    """One spelling per model directory (`m`, `./m`, `/abs/m`, a symlink to it), so a resume compares models."""
    path = Path(name).expanduser()
    return str(path.resolve()) if name not in PRESETS and path.exists() else name


def _differences(previous: dict, current: dict) -> list[str]:
    def flat(record: dict) -> dict:
        items = {f"{k}.{n}": v for k, sub in record.items() if isinstance(sub, dict) for n, v in sub.items()}
        items.update({k: v for k, v in record.items() if not isinstance(v, dict)})
        return {k: v for k, v in items.items() if k.removeprefix("train.") not in RESUME_NEUTRAL}

    old, new = flat(previous), flat(current)
    keys = sorted(old.keys() | new.keys())
    return [f"{k}: {old.get(k)!r} → {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def finished_run(out: Path) -> bool:
    """Whether `out` holds a finished run: its final model (config.json) or adapter (adapter_config.json),
    each written last."""
    return (out / "config.json").exists() or (out / adapters.ADAPTER_CONFIG).exists()


def _refuse_foreign(out: Path) -> None:
    """Refuse a file, or a non-empty directory that no run created, before the lock file is put into it."""
    if out.exists() and not out.is_dir():
        raise FastForwardError(f"--out {out} is a file, not a directory; choose a directory for the run")
    if out.exists() and any(p.name != LOCK for p in out.iterdir()) and not (out / RUN_CONFIG).exists():
        raise FastForwardError(
            f"{out} exists and is not a fastforward run directory (no {RUN_CONFIG}); choose another --out"
        )


def _open_run_dir(out: Path, record: dict, overwrite: bool) -> tuple[Path | None, bool]:
    """Decide how to use `out` (under its lock): (checkpoint to resume, wipe it first).

    When no checkpoint is valid the run starts again from step 0 with a warning rather than an error:
    the damaged checkpoints cannot be used anyway, --overwrite would only delete them, and a job that
    is restarted automatically (a preempted one) must keep going. They stay until valid ones replace them.
    """
    if not any(p.name != LOCK for p in out.iterdir()):
        return None, False
    if overwrite:
        return None, True
    if finished_run(out):
        raise FastForwardError(f"{out} holds a finished run; pass --overwrite to train again, or choose another --out")
    if not checkpoints(out):
        return None, True
    previous = json.loads((out / RUN_CONFIG).read_text())
    previous["model"]["name"] = model_identity(previous["model"]["name"])  # runs recorded before model_identity
    previous.setdefault("rows_per_step", previous["train"]["batch_size"] * previous["train"]["grad_accum"])
    changed = _differences(previous, record)
    if changed:
        raise FastForwardError(
            f"cannot resume {out}: the run was started with different settings ({'; '.join(changed)}); "
            "pass --overwrite to start again, or choose another --out"
        )
    checkpoint = latest_checkpoint(out)
    if checkpoint is None:
        _warn(f"no checkpoint in {out} is valid; training from step 0 (they are kept until new ones replace them)")
    return checkpoint, False


def _clear(out: Path) -> None:
    """Empty `out` but keep its lock file: deleting that would let another run lock a new one beside ours."""
    for path in out.iterdir():
        if path.name == LOCK:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


@contextlib.contextmanager
def claim(accelerator: Accelerator, out: Path, record: dict, overwrite: bool) -> Iterator[Path | None]:
    """Lock `out` for the whole run and prepare it; yields the checkpoint to resume from (None: step 0).

    The main process locks and decides (verifying checkpoints reads them all once), then tells the others;
    when it fails, the others fail with a FastForwardError that says so (the main process reports the error).
    """
    with contextlib.ExitStack() as stack:
        decision: list[Any] = [None]
        if accelerator.is_main_process:
            try:
                _refuse_foreign(out)
                stack.enter_context(lock_run_dir(out))
                checkpoint, wipe = _open_run_dir(out, record, overwrite)
                if wipe:
                    _clear(out)
                (out / "checkpoints").mkdir(parents=True, exist_ok=True)
                write_json_atomic(out / RUN_CONFIG, record)
                decision = [checkpoint]
            except Exception as exc:  # the other processes must raise it too, not wait forever
                decision = [exc]
        broadcast_object_list(decision)
        if isinstance(decision[0], Exception):
            if accelerator.is_main_process:
                raise decision[0]
            raise FastForwardError(f"process 0 could not prepare {out}: {decision[0]}")
        yield decision[0]


def truncate_metrics(path: Path, step: int) -> None:
    """Drop records a crashed run wrote after the checkpoint it resumes from (they will be redone)."""
    if path.exists():
        lines = [line for line in path.read_text().splitlines() if _record_step(line) <= step]
        path.write_text("".join(f"{line}\n" for line in lines))


def _record_step(line: str) -> float:
    """A metrics line's step; a line cut short by a crash counts as after every checkpoint."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def save_checkpoint(accelerator: Accelerator, out: Path, step: int, keep: int, valid: tuple[int, ...] = ()) -> Path:
    """accelerate state + step + manifest, written to a hidden directory and renamed; then prunes.

    A checkpoint is deleted only once `keep` checkpoints known to be valid come after it: this one and
    the steps in `valid` (resumed from or written by this run). Others on disk may be damaged, so they
    never count: a damaged checkpoint is never what a resume is left with.
    """
    root = out / "checkpoints"
    final, tmp = root / f"step-{step:06d}", root / f".tmp-step-{step:06d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        # accelerate logs "Removed shared tensor ..." for tied embeddings; expected, and restored on load.
        shared_tensor_notice = logging.getLogger("accelerate.utils.other")
        level = shared_tensor_notice.level
        shared_tensor_notice.setLevel(logging.ERROR)
        try:
            accelerator.save_state(str(tmp))
        finally:
            shared_tensor_notice.setLevel(level)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            write_json_atomic(tmp / "trainer_state.json", {"step": step})
            _write_manifest(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
    except BaseException:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if accelerator.is_main_process:
        trusted = {*valid, step}
        for old in checkpoints(out):
            if sum(s > _step(old) for s in trusted) >= keep:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def save_final(accelerator: Accelerator, module: nn.Module, model: Model, out: Path, provenance: dict) -> None:
    """Write the model into `out` itself, config.json last: its presence marks a finished run. A LoRA run
    writes a PEFT adapter directory instead (adapter_config.json last), with its provenance beside it."""
    state = accelerator.get_state_dict(module)  # gathers FSDP shards; every process must call it
    if not accelerator.is_main_process:
        return
    tmp = out / ".final"
    shutil.rmtree(tmp, ignore_errors=True)
    weights = {k.removeprefix("hf."): v for k, v in state.items() if k.startswith("hf.")}
    lora = hasattr(model.hf, "peft_config")
    extra = {"save_embedding_layers": False} if lora else {}  # else PEFT may ask the Hub about the base
    with quiet_progress():
        model.hf.save_pretrained(tmp, state_dict=weights, safe_serialization=True, **extra)
    if lora:
        write_json_atomic(tmp / adapters.PROVENANCE, provenance)
    if not lora:
        model.tokenizer.save_pretrained(tmp)
    else:
        _save_added_token(model, tmp)
    last = adapters.ADAPTER_CONFIG if lora else "config.json"
    for path in sorted(tmp.iterdir(), key=lambda p: p.name == last):
        os.replace(path, out / path.name)
    tmp.rmdir()


def append_metrics(out: Path, entries: list[dict]) -> None:
    """Log a step's records; written before the step's checkpoint, so a resume drops records newer than it."""
    with (out / METRICS).open("a") as f:
        f.writelines(json.dumps(e) + "\n" for e in entries)


def load_checkpoint(accelerator: Accelerator, checkpoint: Path) -> int:
    """Restore the accelerate state of `checkpoint`; returns the step it was written after."""
    accelerator.load_state(str(checkpoint))
    return json.loads((checkpoint / "trainer_state.json").read_text())["step"]


def save_adapter_snapshot(model: Model, directory: Path, provenance: dict) -> None:
    """A LoRA run's adapter as it is now (a PEFT directory with its provenance), written to a temporary
    name and renamed; kept if already there (a resumed run passes the same step again)."""
    if (directory / adapters.ADAPTER_CONFIG).exists():
        return
    tmp = directory.with_name(f".{directory.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.hf.save_pretrained(tmp, safe_serialization=True, save_embedding_layers=False)
    _save_added_token(model, tmp)
    (tmp / adapters.PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
    os.replace(tmp, directory)


def _save_added_token(model: Model, directory: Path) -> None:
    """An adapter's tokenizer where training added the mask token (SBD, MultiTF, SetDLM): loading the adapter
    finds the token there, grows the embeddings to it and records it (`fastforward.model.loading`)."""
    if getattr(model.hf.config, MASK_CONFIG_KEY, None) is not None:
        model.tokenizer.save_pretrained(directory)


def tokens_seen(out: Path) -> dict[int, float]:
    """Training tokens seen by the end of each step of a run directory (from its metrics; 0 at step 0)."""
    seen, total = {0: 0.0}, 0.0
    for line in (out / METRICS).read_text().splitlines():
        record = json.loads(line)
        if record.get("split") == "train":
            total += record["tokens"]
            seen[record["step"]] = total
    return seen
