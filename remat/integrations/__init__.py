"""remat inside the training frameworks users already run: Hugging Face's Trainer
(`remat.integrations.transformers`). Each is imported on its own, so that remat does not
need the framework installed."""
