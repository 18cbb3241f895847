"""protocol: the plain data that crosses a process boundary, and the errors every layer shares.

The bottom package: it imports nothing of tandem and no torch, so the HTTP front end, the
coordinator and the workers can all depend on it without loading a model stack.
"""
