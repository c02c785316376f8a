"""Whether this process is a child forked after ``import linattn`` (private).

The compiled CPU kernels run on PyTorch's OpenMP threads, which do not survive ``fork()``: a forked
child that used them would wait for the parent's threads for ever, so there the kernels start
threads of their own (a library loaded before the fork is switched by its ``pthread_atfork`` handler).
"""
import os

forked = False


def _mark_forked() -> None:
    global forked
    forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mark_forked)
