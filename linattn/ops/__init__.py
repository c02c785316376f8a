"""The operator families of linattn, one module each (the layout of flash-linear-attention's
``fla/ops/<family>/``: the slow, obvious form next to the fast one).
"""
