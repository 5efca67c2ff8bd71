"""A terminal progress bar for long CLI runs (rich, which Prefect already depends on)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tasks.progress import listening


@contextlib.contextmanager
def console_progress() -> Iterator[None]:
    """Draw one bar per described step while the block runs (only on a terminal)."""
    if not sys.stderr.isatty():
        yield
        return
    bars: dict[str, int] = {}
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=False
    ) as progress:

        def listener(description: str, done: int, total: int) -> None:
            if description not in bars:
                bars[description] = progress.add_task(description, total=total)
            progress.update(bars[description], completed=done, total=max(total, done))

        with listening(listener):
            yield
