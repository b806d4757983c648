"""The wheel and the sdist carry every file of the package: what the checkout runs is what pip installs.

Built without build isolation (setuptools from the dev extra), so no download is needed; `twine check`
then reads the metadata as a package index would.
"""

import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from fastforward.cpu import native
from fastforward.model import SHIPPED_ADAPTERS, SHIPPED_CHECKPOINTS

ROOT = Path(__file__).resolve().parents[1]


def tracked_files(*paths: str) -> set[str]:
    """The files git tracks (as they are in the working tree), under `paths` or everywhere."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to know the package's files")
    listed = subprocess.run(["git", "ls-files", *paths], cwd=ROOT, capture_output=True, text=True, check=True)
    return {line for line in listed.stdout.splitlines() if (ROOT / line).is_file()}


def opened_files() -> set[str]:
    """The files the code opens at run time, from the code itself: the native sources, the headers they
    include, the shipped checkpoints and adapters."""
    files = set()
    for source in native.SOURCES:
        files.add(source)
        for header in re.findall(r'#include "([^"]+)"', source.read_text()):
            files.add(source.parent / header)
    files |= {path for root in (SHIPPED_CHECKPOINTS, SHIPPED_ADAPTERS) for path in root.rglob("*") if path.is_file()}
    return {str(path.relative_to(ROOT)) for path in files}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    # From a copy of the tracked files: an egg-info left in the checkout (an editable install makes
    # one) would otherwise add the files it lists to the sdist whatever the configuration says.
    source = tmp_path_factory.mktemp("source")
    for name in tracked_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
        check=True,
        capture_output=True,
    )
    return out


def test_the_wheel_and_the_sdist_carry_every_file_of_the_package(artifacts):
    wanted = tracked_files("fastforward")
    assert opened_files() <= wanted
    assert {"fastforward/cpu/csrc/simd.h", "fastforward/demo/checkpoints/sbd/model.safetensors"} <= wanted
    (wheel,) = artifacts.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert wanted - set(archive.namelist()) == set()
    (sdist,) = artifacts.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert wanted - names == set()


def test_an_index_would_accept_the_metadata(artifacts):
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, artifacts.iterdir())],
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
