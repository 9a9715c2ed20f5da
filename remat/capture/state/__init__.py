"""The user's Python state around a captured step: where values live (slots), what the
trace read (guards), what it did (effects, replayed after each run) and what capture leaves
as it found it."""
