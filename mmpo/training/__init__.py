"""Lightning-level reliability helpers shared by every family (one module per guard)."""
