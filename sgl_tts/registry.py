"""Plug-ins by name: one small registry type for programs' helpers, scorers, policies, hardware, datasets.

A `Registry` maps names to entries; looking up an unknown name raises a `KeyError` whose message lists the
known names, so every "unknown X" error in the project reads the same and never goes stale.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, Mapping, TypeVar

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """Named entries of one kind (`kind` is what an error calls them: 'scorer kind', 'hardware', ...)."""

    def __init__(self, kind: str, entries: Mapping[str, T] | None = None):
        self.kind = kind
        self._entries: dict[str, T] = {}
        for name, entry in (entries or {}).items():
            self.add(name, entry)

    def add(self, name: str, entry: T) -> T:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = entry
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of `add`."""
        return lambda entry: self.add(name, entry)

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(self.unknown(name)) from None

    def unknown(self, name: object) -> str:
        """The error message for a name that is not registered."""
        return f"unknown {self.kind} {name!r}; known: {', '.join(self._entries)}"

    def check(self, name: object) -> None:
        """Raise ValueError (what config validation raises) unless `name` is registered."""
        if name not in self._entries:
            raise ValueError(self.unknown(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
