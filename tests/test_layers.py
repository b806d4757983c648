"""The package's layers: a module imports only from its own layer or the layers below it, so there
are no import circles and nothing imports upward (docs/extending.md, "Layout of the code")."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fastforward"

# lowest first; each entry is a top-level module or folder of the package
LAYERS = [
    {"errors", "home", "jsonl", "options", "registry", "shipped"},  # shipped: the names that load without a path
    {"tasks"},
    {"cpu"},
    {"model", "presets"},  # presets: the adapters shipped as data, which model loads by name
    {"decoding"},
    {"api"},
    {"training", "evaluation"},
    {"demo", "serving", "recipes"},  # recipes: training, then measuring with decoders
    {"cli", "warm", "__init__", "__main__"},  # warm: the engine behind `generate`, which prints as generate does
]
RANK = {part: rank for rank, layer in enumerate(LAYERS) for part in layer}


def part_of(module: str) -> str:
    """The top-level entry of the package that a dotted module name lives in."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported_modules(path: Path) -> set[str]:
    """Every fastforward module the file imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("fastforward")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fastforward"):
            if node.module == "fastforward":  # `from fastforward import jsonl` names a module
                found |= {f"fastforward.{alias.name}" for alias in node.names}
            else:
                found.add(node.module)
    return found


def test_every_part_of_the_package_has_a_layer():
    parts = {p.stem if p.suffix == ".py" else p.name for p in PACKAGE.iterdir() if not p.name.startswith((".", "_"))}
    assert parts <= set(RANK), f"give {sorted(parts - set(RANK))} a layer in LAYERS"


def test_nothing_imports_from_a_higher_layer():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        own = part_of(module.removesuffix(".__init__")) if path.parent != PACKAGE else path.stem
        for target in imported_modules(path):
            if RANK.get(part_of(target), -1) > RANK[own]:
                upward.append(f"{module} imports {target}")
    assert upward == []


def test_the_two_layers_that_share_a_rank_do_not_import_each_other():
    for a, b in (("training", "evaluation"), ("demo", "serving")):
        for path in (PACKAGE / a).rglob("*.py"):
            assert not {t for t in imported_modules(path) if part_of(t) == b}, f"{path} imports {b}"


def test_decoders_share_code_through_steps_never_through_each_other():
    """A decoder imports no other decoder: what two decoders share lives in `decoding/steps.py`."""
    shared = {"fastforward.decoding.decoders.base", "fastforward.decoding.decoders.registry"}
    crossing = []
    for path in (PACKAGE / "decoding" / "decoders").glob("*.py"):
        if path.stem in ("__init__", "base", "registry"):
            continue
        for target in imported_modules(path):
            if target.startswith("fastforward.decoding.decoders") and target not in shared:
                crossing.append(f"{path.stem} imports {target}")
    assert crossing == []
