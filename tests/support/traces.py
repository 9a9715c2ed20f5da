"""How many times captures trace the step: each make_fx call remat's capture makes."""

from __future__ import annotations

from torch.fx.experimental.proxy_tensor import make_fx

from remat.capture import capture as capture_module


def counted(monkeypatch) -> list[int]:
    """A list that gets an entry at each trace from now on (`monkeypatch` undoes it)."""
    traces: list[int] = []

    def traced(*args, **kwargs):
        traces.append(1)
        return make_fx(*args, **kwargs)

    monkeypatch.setattr(capture_module, "make_fx", traced)
    return traces
