"""Named plugins that register themselves: decoders (`decoding.decoders.registry`) and training
objectives (`training.objectives.registry`) each keep one `Registry`.

Every module of the registry's package is imported on the first lookup, so a new plugin is one new
file whose registration runs when it is imported; no list elsewhere names it.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

from fastforward.errors import FastForwardError

T = TypeVar("T")
C = TypeVar("C", bound=type)


class Registry(Mapping[str, T], Generic[T]):
    """Entries by name, in the order of their modules' names (then of registration within a module):
    the same order whichever module a program happened to import first."""

    def __init__(self, kind: str, package: str):
        self.kind = kind  # how errors name an entry: "decoder", "objective"
        self.package = package
        self.entries: dict[str, tuple[str, T]] = {}  # name → (module that registered it, entry)
        self._discovered = False

    def add(self, name: str, entry: T, module: str) -> None:
        """Register `entry` as `name`; a name taken by another module is a mistake in the code."""
        taken = self.entries.get(name)
        if taken is not None and taken[0] != module:
            raise TypeError(f"{self.kind} {name!r} of {module} is already registered by {taken[0]}")
        self.entries[name] = (module, entry)

    def named(self, name: str) -> Callable[[C], C]:
        """A class decorator: registers the class as `name` and sets its `name` attribute (objectives, recipes)."""

        def decorate(cls: C) -> C:
            cls.name = name
            self.add(name, cls, cls.__module__)  # type: ignore[arg-type]
            return cls

        return decorate

    def find(self, name: str) -> T:
        """The entry `name`, or an error a user can act on: it lists the known names."""
        if name not in self:
            raise FastForwardError(f"unknown {self.kind} {name!r}; choose one of {', '.join(self)}")
        return self[name]

    def _discover(self) -> None:
        """Import every module of the package once, so each registers what it defines."""
        if self._discovered:
            return
        self._discovered = True  # first: the imports below register through `add`
        package = importlib.import_module(self.package)
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{self.package}.{module.name}")

    def __getitem__(self, name: str) -> T:
        self._discover()
        return self.entries[name][1]

    def __iter__(self) -> Iterator[str]:
        self._discover()
        ordered = sorted(self.entries.items(), key=lambda item: item[1][0])  # a stable sort: by module
        return iter([name for name, _ in ordered])

    def __len__(self) -> int:
        self._discover()
        return len(self.entries)
