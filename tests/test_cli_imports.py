"""A command imports only what it runs: `fastforward --help`, `generate` and `serve` load nothing from
training, evaluation, the demo, lm-eval or ROUGE (each costs seconds of a newcomer's first command)."""

import json
import subprocess
import sys

import pytest

from fastforward.cli import COMMANDS, build_parser
from fastforward.model.tiny import tiny_model

UNUSED = ("fastforward.training", "fastforward.evaluation", "fastforward.demo", "lm_eval", "rouge_score", "nltk")


def modules_after(code: str) -> list[str]:
    """The modules a fresh interpreter has loaded after running `code`."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_model(seed=0).save(path)
    return str(path)


def test_help_generate_and_serve_import_only_what_they_run(saved):
    runs = {
        "--help": "from fastforward.cli import build_parser, named_command; build_parser(named_command([]))",
        "generate": (
            "from fastforward.cli import main; "
            f"main(['generate', '--model', {saved!r}, '--quantize', 'none', '--max-new-tokens', '2', 'hi'])"
        ),
        "serve": "from fastforward.cli import build_parser; build_parser('serve').parse_args(['serve'])",
    }
    for command, code in runs.items():
        loaded = modules_after(code)
        assert [m for m in loaded if m.startswith(UNUSED)] == [], command
        assert command == "--help" or f"fastforward.cli.{command}" in loaded  # what it runs is there


def test_every_command_is_listed_and_parses_alone():
    full = build_parser()
    for name in COMMANDS:
        assert build_parser(name).format_help() == full.format_help()
        assert name in full.format_help()


def test_the_command_freezes_its_imports_objects_and_a_caller_in_process_keeps_its_gc():
    """`fastforward` as its own process moves the imports' objects out of the collector's way (gc.freeze);
    main(argv) called from a longer-lived process (a test, a notebook) leaves its collector alone."""
    code = (
        "import gc, sys\nfrom fastforward.cli import main\n"
        "sys.argv = ['fastforward', 'generate', '--model', '/no/such/model', 'hi']\n"
        "print(main(), gc.get_freeze_count() > 0)\n"
        "gc.unfreeze()\n"
        "print(main(sys.argv[1:]), gc.get_freeze_count() > 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["2", "True", "2", "False"]
