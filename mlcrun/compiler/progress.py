"""How long-running library work reports progress without knowing about rich."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def phase(self, name: str, total: int | None = None) -> None:
        """A new phase starts; `total` steps if known (else an indeterminate spinner)."""

    def advance(self, steps: int = 1) -> None: ...

    def done(self) -> None:
        """The current phase finished."""


class NullProgress:
    def phase(self, name: str, total: int | None = None) -> None:
        pass

    def advance(self, steps: int = 1) -> None:
        pass

    def done(self) -> None:
        pass
