"""A progress bar on stderr, for the long stages (profiling, compiling regions)."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator


@contextlib.contextmanager
def progress_bar(enabled: bool, total: int, what: str) -> Iterator[Callable[[str], None]]:
    """A progress bar on stderr; yields `advance(next_description)`."""
    if not enabled:
        yield lambda desc: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(file=sys.stderr, emoji=False)  # a model named hf:llama:... is no emoji code
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task(what, total=total)
        yield lambda desc: bar.update(task, advance=1, description=desc)
