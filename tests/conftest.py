"""Shared test set-up."""

import os

# Never reach for the Hugging Face hub: every model here is built from a config.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
