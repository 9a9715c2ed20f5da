"""remat inside the training frameworks users already run: Hugging Face's Trainer
(`remat.integrations.transformers`) and PyTorch Lightning (`remat.integrations.lightning`).
Each is imported on its own, so that remat does not need the framework installed; a step
compiled with `remat.compile` loads the integration of each framework the process has
imported (`load_for_loaded_frameworks`), for what it tells remat's capture about the
framework's objects."""

from __future__ import annotations

import importlib
import sys

# The framework's module, and remat's integration of it that registers with the capture
# what a step compiled directly needs too (a LightningModule's trainer state, `self.log`).
_INTEGRATIONS = {"lightning.pytorch": "remat.integrations.lightning"}


def load_for_loaded_frameworks() -> None:
    for framework, integration in _INTEGRATIONS.items():
        if framework in sys.modules and integration not in sys.modules:
            importlib.import_module(integration)
