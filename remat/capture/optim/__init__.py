"""The optimizer in the captured step: its settings read at every call (hyperparams), its
state as graph inputs (optimizer_state), that state's first-step values made ahead of the
trace (first_step_state)."""
