"""remat inside the training frameworks users already run: Hugging Face's Trainer
(`remat.integrations.transformers`) and PyTorch Lightning (`remat.integrations.lightning`).
Each is imported on its own, so that remat does not need the framework installed. What an
integration tells the capture about a framework's objects it registers at import, and the
capture imports it as soon as the framework is imported (library_objects.INTEGRATIONS), so
that a step compiled with remat.compile directly gets it too."""
