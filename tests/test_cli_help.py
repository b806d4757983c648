"""The command's help text: it opens for the user, and every option of every command says what it does
and, where it has one, its default."""

import argparse

import pytest

from fastforward.cli import COMMANDS, DESCRIPTION, build_parser, main, shows_default


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_the_help_opens_with_what_the_command_does_for_a_user(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    description = " ".join(text.split("\n\n")[1].split())  # the paragraph after the usage line
    assert description == " ".join(DESCRIPTION.split())
    assert "register(" not in text and "module" not in description
    assert "about two minutes" in text and "about 3 min" not in text  # as the README says of the demo


def test_every_command_is_in_the_full_parser():
    assert sorted(subcommands()) == sorted(COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_has_help_and_shows_its_default(command):
    parser = subcommands()[command]
    formatter = parser._get_formatter()
    for action in options(parser):
        flag = "/".join(action.option_strings)
        assert (action.help or "").strip(), f"{command} {flag} has no help"
        if shows_default(action):
            text = formatter._expand_help(action)  # the help as --help prints it, %(default)s filled in
            assert str(action.default) in text, f"{command} {flag}: its help does not show its default {action.default}"


def test_max_new_tokens_says_what_it_is_and_its_default(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    entry = capsys.readouterr().out.rsplit("\n  --max-new-tokens", 1)[1].split("\n  -", 1)[0]  # past the usage
    line = " ".join(entry.split())
    assert "tokens" in line and "(default: 256)" in line


def test_a_default_of_zero_is_shown_and_none_or_off_is_not():
    parser = argparse.ArgumentParser()
    zero, none, off = (
        parser.add_argument(f"--{n}", **kw)
        for n, kw in [("a", {"default": 0}), ("b", {}), ("c", {"action": "store_true"})]
    )
    assert shows_default(zero) and not shows_default(none) and not shows_default(off)
