"""Progress of long steps, for whoever listens (the CLI draws a bar, flows publish an artifact).

A process-local listener list keeps the numerical code free of UI concerns: steps call
``report(description, done, total)`` and know nothing of who draws it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

Listener = Callable[[str, int, int], None]
_listeners: list[Listener] = []


def report(description: str, done: int, total: int) -> None:
    for listener in list(_listeners):
        listener(description, done, total)


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[None]:
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)
