"""Whether this process is a child forked after ``import linattn`` (private)."""
import os

forked = False


def _mark_forked() -> None:
    global forked
    forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mark_forked)
