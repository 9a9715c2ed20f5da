"""Defaults every entry point shares, in a module light enough for the command line to import."""

# The planner used unless one is named: μ-TWO's greedy, then the picks it no longer needs
# taken back (remat/planners/refined.py), never costlier than the greedy alone.
# `planner="mutwo"` is the paper's algorithm as published.
DEFAULT_PLANNER = "refined"
