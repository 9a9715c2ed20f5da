"""A project's settings module, which a training loop changes and a step reads as `loop_settings.aux`."""

aux = 0.0
