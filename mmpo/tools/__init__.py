"""Tools, their sandbox, tool-call parsing and multi-turn environments (docs/agents.md).

Imports nothing heavy: the sandbox worker process loads this package without torch.
"""
