"""The docs hold together: every note is indexed, every relative link leads to a file and heading that
exist, raw records stay out of docs/, and results.md gives each claim one "measured at" line."""

import re
import shlex
from pathlib import Path

from fastforward.decoding.decoders import registry
from fastforward.training.objectives import OBJECTIVES

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NOTES = DOCS / "notes"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md")), *sorted((ROOT / "benchmarks").rglob("README.md"))]


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # links inside code blocks are code
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    found = set()
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def test_every_note_is_indexed_and_every_index_link_exists():
    index = NOTES / "README.md"
    linked = {target.split("#")[0] for target in links(index)}
    notes = {p.name for p in NOTES.glob("*.md") if p.name != "README.md"}
    assert notes - linked == set(), "notes missing from docs/notes/README.md"
    missing = {t for t in linked if t and not (NOTES / t).exists()}
    assert missing == set(), "docs/notes/README.md links to files that do not exist"


def test_relative_links_lead_to_files_and_headings_that_exist():
    broken = []
    for path in markdown_files():
        for target in links(path):
            file_part, _, anchor = target.partition("#")
            destination = (path.parent / file_part).resolve() if file_part else path
            if not destination.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
            elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_raw_records_stay_out_of_docs():
    assert sorted(p.relative_to(ROOT).as_posix() for p in DOCS.rglob("*.json")) == []


def test_results_page_states_the_present():
    """One "measured at" line per claim: each section with a table has exactly one; the history of a
    figure belongs in a dated note, not here."""
    text = (DOCS / "results.md").read_text()
    assert len(text.splitlines()) <= 425
    for section in re.split(r"^## ", text, flags=re.M)[2:]:  # after "Hardware and how to read this page"
        title = section.splitlines()[0]
        for part in re.split(r"^### ", section, flags=re.M):
            if re.search(r"^\|---", part, re.M):
                assert len(re.findall(r"[Mm]easured at\s", part)) == 1, f"{title}: {part.splitlines()[0]}"


def documented_commands(path: Path) -> list[list[str]]:
    """The `fastforward ...` command lines of a page's bash blocks, as argument lists (continuation lines
    joined, shell variables set in the same block substituted, comments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
        variables: dict[str, str] = {}
        for line in block.replace("\\\n", " ").splitlines():
            if m := re.match(r'(\w+)="([^"]*)"$', line.strip()):
                variables[m.group(1)] = m.group(2)
                continue
            for name, value in variables.items():
                line = line.replace(f"${name}", value)
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split, lexer.commenters = True, "#"
            words = list(lexer)
            for i, word in enumerate(words):
                if word.endswith("/fastforward") or (
                    word == "fastforward" and (i == 0 or words[i - 1] in ("-m", "&&", "|"))
                ):
                    rest = words[i + 1 :]
                    end = next((j for j, w in enumerate(rest) if w in ("|", "&&", ";", ">")), len(rest))
                    if "..." not in rest[:end]:  # an elided example
                        commands.append(rest[:end])
    return commands


def test_the_readme_documents_every_command_with_an_example_that_parses():
    """Every subcommand has a runnable example in the README, and every example there and in docs/
    parses with today's flags (a renamed or removed flag fails here, not in a user's shell)."""
    from fastforward.cli import COMMANDS, build_parser

    readme = documented_commands(ROOT / "README.md")
    assert set(COMMANDS) <= {args[0] for args in readme if args}
    parser = build_parser()
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for args in documented_commands(path):
            try:
                parser.parse_args(args)
            except SystemExit:
                raise AssertionError(f"{path.relative_to(ROOT)}: fastforward {' '.join(args)}") from None


DOC = DOCS / "extending.md"


def test_extending_guide_examples_run(capsys, scratch_registries):
    # the guide registers a sketch decoder and objective: `scratch_registries` keeps them from other tests
    code = "\n".join(re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S))
    exec(compile(code, str(DOC), "exec"), {"__name__": "docs_extending"})
    out = capsys.readouterr().out
    assert "torch.Size([1, 4," in out and "{'name': 'ntp-sketch', 'weight': 0.5} [" in out
    assert "greedy-sketch" in registry.DECODERS and "ntp-sketch" in OBJECTIVES
