"""What a step prints or logs is printed or logged after every run with that step's values,
as eager prints it, instead of once at capture with traced placeholders."""

from __future__ import annotations

import contextlib
import copy
import csv
import io
import json
import logging
import os
import sysconfig
import warnings

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.errors import CaptureError

_LOG = logging.getLogger("remat-test-train")


class _Trainer:
    def __init__(self) -> None:
        self.step_no = 0
        self.loss_sum = 0.0

    def step(self, model, opt, batch):
        x, y = batch
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        print("before", self.step_no, "lr", opt.param_groups[0]["lr"], "batch", tuple(x.shape))
        self.step_no += 1
        self.loss_sum += loss.item()
        _LOG.info("step %d sum %.6f loss %.6f", self.step_no, self.loss_sum, loss.item())
        _LOG.debug("not shown at INFO: %s", loss.item())
        print(loss.detach(), {"loss": loss.item()}, sep=" | ")
        return loss


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)


def _run(step, model, opt, steps: int) -> list[str]:
    """What each step printed and logged, step by step."""
    handler_stream = io.StringIO()
    handler = logging.StreamHandler(handler_stream)
    _LOG.addHandler(handler)
    _LOG.setLevel(logging.INFO)
    out = []
    try:
        for i in range(steps):
            if i == 2:  # the loop quiets the logger: the step's later logs are not made
                _LOG.setLevel(logging.WARNING)
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                step(model, opt, _batch(i))
            out.append(printed.getvalue() + handler_stream.getvalue())
            handler_stream.seek(0)
            handler_stream.truncate()
    finally:
        _LOG.removeHandler(handler)
    return out


def test_what_a_step_prints_and_logs_is_printed_after_every_run_with_its_values():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_model, eager_opt = copy.deepcopy((model, opt))
    eager, mine = _Trainer(), _Trainer()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        compiled = remat.compile(mine.step, model, opt, _batch(0), memory_budget=None, profile_runs=1, measure=False)
    assert printed.getvalue() == ""  # compiling prints nothing of the step's
    expected = _run(lambda m, o, b: eager.step(m, o, b), eager_model, eager_opt, 4)
    got = _run(lambda m, o, b: compiled(b), model, opt, 4)
    assert got == expected
    assert "before 1 lr 0.1 batch (32, 16)" in got[1] and "step 2 sum" in got[1] and "step 3" not in got[2]
    assert len(compiled._graphs) == 1 and vars(mine) == vars(eager)


def _step_then(after):
    """A cross-entropy step that calls `after(loss, opt)` once its update is made."""

    def step(model, opt, batch):
        x, y = batch
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        after(loss, opt)
        return loss

    return step


def test_a_number_formatted_into_text_inside_the_step_is_refused_saying_to_pass_it_as_an_argument():
    step = _step_then(lambda loss, opt: print(f"loss {loss.item():.4f}"))

    model = torch.nn.Linear(16, 4)
    with pytest.raises(CaptureError, match=r"formats a number it computes into text .* Pass the number to print or logging as an argument"):
        remat.compile(step, model, torch.optim.SGD(model.parameters(), lr=0.1), _batch(0), memory_budget=None, profile_runs=1, measure=False)


def _bar_step(bar):
    return _step_then(lambda loss, opt: (bar.set_postfix(loss=loss.item(), lr=opt.param_groups[0]["lr"]), bar.update(1)))


def test_a_progress_bar_updated_inside_the_step_shows_each_steps_values_as_eager_does():
    # Traced, set_postfix would write the trace's stand-in for loss.item() into the bar's text.
    tqdm = pytest.importorskip("tqdm")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_model, eager_opt = copy.deepcopy((model, opt))
    bars = [tqdm.tqdm(total=4, file=io.StringIO(), mininterval=0) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing of the bar is left alone with a warning
        compiled = remat.compile(_bar_step(bars[1]), model, opt, _batch(0), memory_budget=None, profile_runs=1, measure=False)
    assert bars[1].n == 0 and bars[1].postfix is None  # compiling shows nothing
    shown = [], []
    for i in range(4):
        _bar_step(bars[0])(eager_model, eager_opt, _batch(i))
        compiled(_batch(i))
        for bar, seen in zip(bars, shown):
            seen.append((bar.n, bar.postfix))
    assert shown[0] == shown[1] and shown[1][-1][0] == 4 and "loss=" in shown[1][-1][1]
    assert len(compiled._graphs) == 1


def _library_function(source: str, name: str):
    """A function as a library installed among the packages defines it (its file there)."""
    namespace: dict = {}
    exec(compile(source, os.path.join(sysconfig.get_paths()["purelib"], "a_library_of_the_test.py"), "exec"), namespace)
    return namespace[name]


def test_a_librarys_print_of_a_number_the_step_computes_is_made_after_every_run():
    # Accelerate's accelerator.print("loss", loss.item()) prints from the library's code:
    # made at capture it showed the trace's stand-in once, and nothing at the steps.
    show = _library_function("def show(*args):\n    print('library:', *args)\n", "show")
    announce = _library_function("def announce():\n    print('library: set up')\n", "announce")

    # announce(): a library's own message, with nothing the step computes: made once, at capture, as before
    step = _step_then(lambda loss, opt: (show("loss", loss.item()), announce()))

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_model, eager_opt = copy.deepcopy((model, opt))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        compiled = remat.compile(step, model, opt, _batch(0), memory_budget=None, profile_runs=1, measure=False)
    assert printed.getvalue().count("library: set up") >= 1 and "library: loss" not in printed.getvalue()
    for i in range(3):
        mine, eager = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(mine):
            compiled(_batch(i))
        with contextlib.redirect_stdout(eager):
            step(eager_model, eager_opt, _batch(i))
        loss_line = [line for line in eager.getvalue().splitlines() if "loss" in line]
        assert mine.getvalue().splitlines() == loss_line and len(loss_line) == 1


def test_a_librarys_log_record_made_while_the_step_is_traced_names_the_librarys_line():
    from remat.capture.state import step_prints

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    library_logger = logging.getLogger("torch.some_library")
    library_logger.addHandler(handler)
    try:
        # a line of torch's: made at once, not recorded
        torch_line = os.path.join(os.path.dirname(torch.__file__), "a_module_of_torch.py")
        with step_prints.recording():
            exec(compile("logger.warning('from torch')", torch_line, "exec"), {"logger": library_logger})
    finally:
        library_logger.removeHandler(handler)
    assert [(r.getMessage(), r.pathname) for r in records] == [("from torch", torch_line)]


@pytest.mark.parametrize(
    "write, match",
    [
        (lambda out, loss: out.write(str(loss.item())), r"makes text of a number it computes \(str\(\) or repr\(\) of zuf\d+\), at test_step_prints\.py"),
        (lambda out, loss: csv.writer(out).writerow([loss.item()]), r"makes text of a number it computes .*Pass the number to print or logging"),
        (lambda out, loss: out.write(repr(round(loss.item(), 4))), r"makes text of a number it computes \(str\(\) or repr\(\) of RoundDecimal"),
        (lambda out, loss: out.write(json.dumps({"loss": loss.item()})), r"formats a number it computes into text \(Object of type SymFloat is not JSON serializable\)"),
    ],
    ids=["str", "csv", "round", "json"],
)
def test_text_made_of_a_number_the_step_computes_is_refused_saying_to_pass_the_number(write, match):
    # Made at capture, the text would hold the trace's stand-in (`zuf0`), written once.
    out = io.StringIO()
    step = _step_then(lambda loss, opt: write(out, loss))
    model = torch.nn.Linear(16, 4)
    with pytest.raises(CaptureError, match=match):
        remat.compile(step, model, torch.optim.SGD(model.parameters(), lr=0.1), _batch(0), memory_budget=None, profile_runs=1, measure=False)
    assert out.getvalue() == ""
