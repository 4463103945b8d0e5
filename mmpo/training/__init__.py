"""Lightning-level reliability pieces shared by every family and entry point (one module per guard)."""
