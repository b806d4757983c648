"""`fastforward engine` and `generate` as its client: the client parses `generate`'s flags as `generate`
does and computes the key of the one engine that serves them without torch; its typed request survives
JSON and a bad one is refused; an engine (a tiny model, eager steps) starts, says when it is ready,
answers `generate` with exactly what `generate` prints in process (across decoders, text and --json)
without importing torch, leaves what it does not serve to the client's process, cancels a request whose
client is interrupted, and stops cleanly; an engine killed while it answers leaves `generate` to print
in its own process what `--no-engine` prints, and its leftovers are cleaned."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fastforward.cli import build_parser, main, resolve_precision
from fastforward.cli.engine import action_parser
from fastforward.cli.warm.flags import GenerateFlags
from fastforward.cli.warm.folder import EngineFolder
from fastforward.cli.warm.protocol import Request
from fastforward.cli.warm.server import generate_flags
from fastforward.cli.warm.spec import Serves
from fastforward.model.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]
PRECISION = ("--quantize", "none")  # the CPU's other defaults (float32, --exact) as generate's
PROMPTS = ["def add(a, b):", "Tom has 3 apples", "0"]
READY_SECONDS = 180.0  # a busy 2-core machine imports torch in seconds; the tiny model loads in less
# `generate` in a fresh interpreter; after its own output, one stderr line names the heavy modules it loaded.
CLIENT = (
    "import sys\nfrom fastforward.cli import main\ncode = main(sys.argv[1:])\n"
    "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
    "print('\\nheavy modules: ' + ' '.join(heavy[:3]), file=sys.stderr)\nsys.exit(code)"
)


def environment(home: Path) -> dict[str, str]:
    return {**os.environ, "FASTFORWARD_HOME": str(home), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def cli(home: Path, *argv: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    """`fastforward ARGV` in its own process, with `home` as $FASTFORWARD_HOME."""
    command = [sys.executable, "-m", "fastforward", *argv]
    return subprocess.run(command, input=stdin, capture_output=True, env=environment(home), timeout=300)


def client(home: Path, *argv: str, stdin: bytes = b"") -> tuple[str, str, str]:
    """`fastforward generate ARGV`'s stdout and stderr, and the heavy modules it imported."""
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, "generate", *argv],
        input=stdin,
        capture_output=True,
        env=environment(home),
        timeout=300,
    )
    err = done.stderr.decode()
    assert done.returncode == 0, err
    err, _, heavy = err.rpartition("\nheavy modules: ")
    return done.stdout.decode(), err, heavy.strip()


def wait_ready(home: Path) -> str:
    """Poll `engine status` until it exits 0 (every engine ready); its report."""
    deadline = time.monotonic() + READY_SECONDS
    while (status := cli(home, "engine", "status")).returncode != 0:
        assert time.monotonic() < deadline, status.stdout.decode() + logs(home)
    return status.stdout.decode()


def logs(home: Path) -> str:
    return "".join(p.read_text() for p in (home / "engines").glob("*/engine.log"))


def start(home: Path, model: str, *flags: str) -> None:
    started = cli(home, "engine", "start", "--model", model, *PRECISION, "--no-compile", "--threads", "1", *flags)
    assert started.returncode == 0, started.stderr.decode()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    model = tiny_model(seed=0, init_std=0.5)
    model.add_mask_token()  # for sbd-verified
    path = tmp_path_factory.mktemp("tiny") / "model"
    model.save(path)
    return str(path)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def engine(model_dir, home):
    """An engine for the tiny model, ready; stopped after the module's tests."""
    start(home, model_dir)
    try:
        wait_ready(home)
        yield
    finally:
        cli(home, "engine", "stop")


@pytest.fixture
def in_home(monkeypatch, home):
    """`main` in this process sees the module's engines."""
    monkeypatch.setenv("FASTFORWARD_HOME", str(home))


def in_process(capsys, monkeypatch, argv: list[str], stdin: bytes = b"") -> tuple[str, str]:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    assert main([*argv, "--no-engine", "--threads", "1"]) == 0
    said = capsys.readouterr()
    return said.out, said.err


def without_timings(out: str, err: str, as_json: bool) -> tuple[list, str]:
    """The output with the figures that measure time dropped (tokens/s, seconds)."""
    figures = re.sub(r"[\d.]+ tokens/s", "", err)
    if not as_json:
        return [out], figures
    records = [json.loads(line) for line in out.splitlines()]
    for r in records:
        for timing in ("seconds", "prefill_seconds", "tps"):
            del r["stats"][timing]
    return records, figures


ARGVS = [
    ["hi"],
    ["--mod", "m", "--dec", "jacobi", "--block-size=4", "a", "b"],  # abbreviations, --flag=value
    ["--device", "cuda", "--no-exact", "--temperature", "0.5", "--json", "x"],  # a GPU's precision defaults
    ["--first-token-from-ntp", "--decoder", "sbd", "--max-new", "3", "--adapter", "a", "p"],
    ["--static", "--threads", "2", "--dtype", "bfloat16", "--batch-size", "2", "q", "r"],
    ["--stop", "\n\n", "--stop=###", "s"],  # repeated --stop
]


@pytest.mark.parametrize("argv", ARGVS, ids=range(len(ARGVS)))
def test_the_client_parses_generates_flags_as_generate_does(argv):
    """The flags an engine publishes, through JSON, parse a command line into generate's own namespace
    (less its defaults that are no flags, and --compile, which generate resolves later and no engine asks)."""
    flags = GenerateFlags.from_json(json.loads(json.dumps(generate_flags().as_json())))
    own = build_parser("generate").parse_args(["generate", *argv])
    resolve_precision(own)
    parsed = vars(flags.parse(argv))
    unflagged = ("command", "run", "cpu_precision", "cpu_compile", "printed", "compile")
    assert {k: v for k, v in parsed.items() if k != "compile"} == {
        k: v for k, v in vars(own).items() if k not in unflagged
    }
    assert flags.options(flags.parse(argv)) == {k: v for k, v in parsed.items() if k in generate_flags().knobs}


@pytest.mark.parametrize(
    "argv", [["--decoder", "nope"], ["--max-new-tokens", "x"], ["--batch-size", "0"], ["a", "--json", "b"]]
)
def test_a_command_line_generate_refuses_the_client_refuses_too(argv):
    flags = GenerateFlags.from_json(json.loads(json.dumps(generate_flags().as_json())))
    with pytest.raises(SystemExit):
        build_parser("generate").parse_args(["generate", *argv])
    with pytest.raises(ValueError):
        flags.parse(argv)


def test_a_request_round_trips_through_json_and_a_bad_one_is_refused():
    serves = Serves("/m", "float32", "int4", True, "sdpa", None, "cpu")
    request = Request(serves, ("hi", "ho"), 12, 2, "jacobi", {"block_size": 4, "temperature": 0.5}, True, False)
    assert Request.from_json(json.loads(json.dumps(request.as_json()))) == request
    good = request.as_json()
    bad = [
        {k: v for k, v in good.items() if k != "json"},
        {**good, "max_new_tokens": "12"},
        {**good, "batch_size": 0},
        {**good, "prompts": "hi"},
        {**good, "options": {"block_size": [4]}},
        {**good, "decoder": 3},
        {**good, "serves": {**good["serves"], "exact": "yes"}},
        {**good, "serves": {k: v for k, v in good["serves"].items() if k != "device"}},
    ]
    for data in bad:
        with pytest.raises(ValueError, match="bad request|what an engine serves"):
            Request.from_json(json.loads(json.dumps(data)))


def test_status_says_what_runs_and_a_second_engine_of_the_same_is_refused(engine, home, model_dir, in_home, capsys):
    said = wait_ready(home)
    assert said.startswith("ready: ") and model_dir in said and "(float32, none, exact, sdpa) on cpu" in said
    assert main(["engine", "start", "--model", model_dir, *PRECISION, "--no-compile"]) == 2
    assert "runs already" in capsys.readouterr().err


def test_the_client_computes_the_engines_key_without_torch(engine, home, model_dir):
    """The key the client computes from generate's command line, in a process without torch, is the key
    the engine computes from its own flags: the running engine's folder."""
    flags = action_parser("run").parse_args(["--model", model_dir, *PRECISION, "--no-compile"])
    resolve_precision(flags)
    engines_key = Serves.of(flags, os.getcwd()).key
    code = (
        "import os, sys\nfrom fastforward.cli.warm.client import choose\n"
        f"chosen = choose(['generate', '--model', {model_dir!r}, '--quantize', 'none', 'hi'], os.getcwd())\n"
        "print(chosen.serves.key, chosen.folder.key, any(m.startswith('torch') for m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, env=environment(home), timeout=60)
    assert done.stdout.decode().split() == [engines_key, engines_key, "False"], done.stderr.decode()
    assert (home / "engines" / engines_key / "socket").exists()


CASES = {
    "lookup, the default": [],
    "ar": ["--decoder", "ar"],
    "jacobi": ["--decoder", "jacobi", "--block-size", "4"],
    "sbd-verified": ["--decoder", "sbd-verified", "--block-size", "4"],
    "ar sampling": ["--decoder", "ar", "--temperature", "0.8", "--seed", "3"],
    "jacobi in batches of 2": ["--decoder", "jacobi", "--batch-size", "2"],
    "ar with stop strings": ["--decoder", "ar", "--stop", "e", "--stop", "a"],
}


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("flags", CASES.values(), ids=CASES.keys())
def test_the_client_prints_what_generate_prints_in_process(
    engine, home, model_dir, flags, as_json, capsys, monkeypatch
):
    argv = ["--model", model_dir, *PRECISION, "--max-new-tokens", "12", *flags, *(["--json"] if as_json else [])]
    out, err, heavy = client(home, *argv, *PROMPTS)
    assert heavy == "" and "decoding in process" not in err  # the engine answered
    expected = in_process(capsys, monkeypatch, ["generate", *argv, *PROMPTS])
    assert without_timings(out, err, as_json) == without_timings(*expected, as_json)


def test_a_models_own_default_decoder_is_the_engines_too(engine, home, model_dir, capsys, monkeypatch):
    """A model's decoding.json names the decoder of a `generate` without --decoder in the engine as in
    process (read per request: written while the engine runs, it counts)."""
    own = Path(model_dir) / "decoding.json"
    own.write_text(json.dumps({"decoder": "jacobi", "options": {"block_size": 4}}))
    argv = ["--model", model_dir, *PRECISION, "--max-new-tokens", "12", *PROMPTS]
    try:
        out, err, heavy = client(home, *argv)
        expected = in_process(capsys, monkeypatch, ["generate", *argv])
    finally:
        own.unlink()
    assert heavy == "" and "decoding in process" not in err and err.startswith("[jacobi: ")
    assert without_timings(out, err, False) == without_timings(*expected, False)


def test_prompts_from_stdin_and_the_chat_template_off(engine, home, model_dir, capsys, monkeypatch):
    argv = ["--model", model_dir, *PRECISION, "--max-new-tokens", "8", "--no-chat-template", "--json"]
    stdin = "\n".join(PROMPTS).encode()
    out, err, heavy = client(home, *argv, stdin=stdin)
    assert heavy == ""
    expected = in_process(capsys, monkeypatch, ["generate", *argv], stdin=stdin)
    assert without_timings(out, err, True) == without_timings(*expected, True)


def test_what_the_engine_cannot_serve_runs_in_process(engine, home, model_dir, in_home, tmp_path, capsys):
    base = ["generate", "--model", model_dir, *PRECISION, "--max-new-tokens", "4", "--threads", "1"]
    assert main([*base, "--no-exact", "hi"]) == 0  # another precision
    assert "decoding in process: no engine serves " in capsys.readouterr().err
    other = shutil.copytree(model_dir, tmp_path / "other")
    assert main(["generate", "--model", str(other), *base[3:], "hi"]) == 0  # another model
    said = capsys.readouterr().err
    assert f"decoding in process: no engine serves {other} (float32, none, exact, sdpa) on cpu" in said
    with pytest.raises(SystemExit):  # the process's own argparse says what is wrong
        main([*base, "--decoder", "nope", "hi"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_engines_of_two_models_coexist_and_stop_one_at_a_time(engine, home, model_dir, tmp_path):
    other = str(shutil.copytree(model_dir, tmp_path / "other"))
    start(home, other)
    try:
        said = wait_ready(home)
        assert said.count("ready: ") == 2
        out, err, heavy = client(home, "--model", other, *PRECISION, "--max-new-tokens", "4", "hi")
        assert heavy == "" and out
    finally:
        stopped = cli(home, "engine", "stop", "--model", other)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout.decode()
    said = wait_ready(home)
    assert said.count("ready: ") == 1 and model_dir in said
    (gone,) = [p for p in (home / "engines").iterdir() if not (p / "state.json").exists()]
    assert not (gone / "socket").exists() and (gone / "engine.log").read_text().endswith("engine: stopped\n")


def test_a_killed_engines_socket_is_cleaned_and_generate_runs_in_process(tmp_path, monkeypatch, capsys, model_dir):
    monkeypatch.setenv("FASTFORWARD_HOME", str(tmp_path))
    serving = Serves(model_dir, "float32", "none", True, "sdpa", None, "cpu")
    folder = EngineFolder.of(serving)
    folder.write_state({"pid": 1, "serves": serving.as_json(), "state": "ready"})
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(folder.socket))  # what a killed engine leaves: a socket file nobody listens on
    dead.close()
    assert main(["generate", "--model", model_dir, *PRECISION, "--max-new-tokens", "4", "--threads", "1", "hi"]) == 0
    assert not folder.socket.exists() and folder.state() is None
    assert main(["engine", "status"]) == 1 and "none runs" in capsys.readouterr().out


def test_an_engine_killed_mid_answer_leaves_generate_to_print_what_no_engine_prints(
    tmp_path, model_dir, capsys, monkeypatch
):
    """An engine killed (SIGKILL) once the client printed its first prompt: `generate` decodes the rest in
    its own process, from the first prompt's batch on, and prints what `--no-engine` prints; its folder is
    cleaned, and `engine status` says none runs."""
    flags = ["--model", model_dir, *PRECISION, "--no-compile", "--threads", "1"]
    argv = ["--model", model_dir, *PRECISION, "--decoder", "ar", "--max-new-tokens", "100", "--batch-size", "2"]
    engine = subprocess.Popen(  # what `engine start` starts, without the seconds of its own process
        [sys.executable, "-m", "fastforward", "engine", "run", *flags],
        env=environment(tmp_path),
        stdout=subprocess.DEVNULL,
    )
    client = None
    try:
        wait_ready(tmp_path)
        command = [sys.executable, "-m", "fastforward", "generate", *argv, *PROMPTS]
        client = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment(tmp_path))
        first = client.stdout.readline()  # the third prompt ("0") takes 100 tokens in a batch of its own
        engine.kill()
        out, err = client.communicate(timeout=240)
    finally:
        for process in (engine, client):
            if process is not None:
                process.kill()
                process.wait()
    assert client.returncode == 0, err.decode()
    note = rf"^fastforward generate: the engine \(pid {engine.pid}\) .*; decoding in process$"
    assert re.search(note, err.decode(), re.M), err.decode()
    assert (first + out).decode() == in_process(capsys, monkeypatch, ["generate", *argv, *PROMPTS])[0]
    status = cli(tmp_path, "engine", "status")
    assert status.returncode == 1 and "none runs" in status.stdout.decode()


def test_an_engine_that_dies_before_it_answers_leaves_generate_to_decode_in_process(
    tmp_path, model_dir, monkeypatch, capsys
):
    """An engine that takes the request and dies (its lock released, its connection closed) before any
    answer: `generate` prints what `--no-engine` prints and removes the dead engine's folder. The engine
    here is a stand-in in a thread of this process, which also sees the typed request as it came."""
    monkeypatch.setenv("FASTFORWARD_HOME", str(tmp_path))
    argv = ["--model", model_dir, *PRECISION, "--max-new-tokens", "8", *PROMPTS]
    serving = Serves(model_dir, "float32", "none", True, "sdpa", None, "cpu")
    folder = EngineFolder.of(serving)
    lock = folder.claim()
    state = {"pid": os.getpid(), "serves": serving.as_json(), "flags": generate_flags().as_json(), "state": "ready"}
    folder.write_state(state)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(folder.socket))
    listener.listen()
    requests = []

    def die_at_the_first_request() -> None:
        connection, _ = listener.accept()
        with connection, connection.makefile("rb") as lines:
            requests.append(Request.from_json(json.loads(next(lines))["request"]))
            connection.sendall(b'{"accepted": true}\n')
            os.close(lock)  # as the kernel does for a killed engine: its lock, then its connection

    engine = threading.Thread(target=die_at_the_first_request, daemon=True)
    engine.start()
    try:
        assert main(["generate", *argv, "--threads", "1"]) == 0
    finally:
        engine.join(10)
        listener.close()
    said = capsys.readouterr()
    assert requests == [Request(serving, tuple(PROMPTS), 8, 1, None, {}, True, False)]
    assert said.err.startswith(
        f"fastforward generate: the engine (pid {os.getpid()}) closed the connection before it answered; "
        "decoding in process\n"
    )
    assert said.out == in_process(capsys, monkeypatch, ["generate", *argv])[0]
    assert folder.state() is None and not folder.socket.exists()
    assert main(["engine", "status"]) == 1 and "none runs" in capsys.readouterr().out


def test_ctrl_c_in_the_client_cancels_its_request_in_the_engine(engine, home, model_dir):
    # Many prompts, one at a time: however fast the engine runs beside a slow client, prompts are left to
    # cancel when the client's Ctrl-C comes.
    argv = ["generate", "--model", model_dir, *PRECISION, "--decoder", "ar", "--max-new-tokens", "480", *["0"] * 64]
    command = [sys.executable, "-m", "fastforward", *argv]
    # SIGINT as a terminal delivers it: a suite started in the background (`cmd &`) ignores SIGINT, and the
    # client would inherit that, run to its end and exit 0.
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment(home), preexec_fn=default_sigint
    ) as proc:
        try:
            assert proc.stdout.read(1)  # streaming: the engine is decoding it
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 130
        finally:
            proc.kill()
        assert "interrupted" in proc.stderr.read().decode()
    deadline = time.monotonic() + 60
    while "a client left (Ctrl-C): its request is cancelled" not in logs(home):
        assert time.monotonic() < deadline, logs(home)
        time.sleep(0.05)


def test_the_readmes_engine_commands_parse():
    """`fastforward engine ACTION` parses its options itself (`status` and `stop` import no torch): the
    README's examples must parse there too, as test_docs checks every other command's."""
    examples = re.findall(r"^\.venv/bin/fastforward engine (\w+)([^#\n]*)", (ROOT / "README.md").read_text(), re.M)
    assert {action for action, _ in examples} == {"start", "status", "stop"}
    for action, options in examples:
        action_parser(action).parse_args(options.split())
