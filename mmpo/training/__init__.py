"""Lightning-level reliability pieces shared by every training entry point."""
