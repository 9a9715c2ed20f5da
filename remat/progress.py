"""Progress on stderr, for the long stages (profiling, compiling regions, a bench's sweep).

On a terminal, a bar. Anywhere else (a log file, a batch job's output, CI) a bar is never
drawn, so the stages are written as plain lines instead: the stage now running, how far
along, and the time so far; the first at once, then at most one per `LINE_SECONDS`, and
the last.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

LINE_SECONDS = 20.0


@dataclass
class Progress:
    """What a long stage reports to: `advance(next stage)` and `say(message)`."""

    advance: Callable[[str], None]
    say: Callable[[str], None]


@contextlib.contextmanager
def progress_bar(enabled: bool, total: int, what: str) -> Iterator[Progress]:
    """Progress of `total` steps on stderr: a bar on a terminal, plain lines elsewhere."""
    if not enabled:  # no bar; messages are still said
        yield Progress(lambda desc: None, _Lines.say)
        return
    from rich.console import Console

    console = Console(file=sys.stderr, emoji=False)  # a model named hf:llama:... is no emoji code
    if not console.is_terminal:
        yield _Lines(total, what).progress()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bar

    with Bar(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=False) as bar:
        task = bar.add_task(what, total=total)
        yield Progress(lambda desc: bar.update(task, advance=1, description=desc), lambda msg: bar.console.print(msg, markup=False))


@dataclass
class _Lines:
    """Progress as lines on stderr, for where no bar is drawn."""

    total: int
    what: str
    done: int = 0
    start: float = field(default_factory=time.perf_counter)
    last: float = -LINE_SECONDS  # when the last line was written, from `start`

    def progress(self) -> Progress:
        return Progress(self.advance, self.say)

    def advance(self, desc: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        if elapsed - self.last >= LINE_SECONDS or self.done >= self.total:
            self.last = elapsed
            self.say(f"{desc} ({min(self.done, self.total)}/{self.total}, {_clock(elapsed)})")

    @staticmethod
    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"
