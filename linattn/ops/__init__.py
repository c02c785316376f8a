"""The operator families, one folder each (flash-linear-attention's ``fla/ops/<family>/`` layout):
``naive.py`` holds the public token-loop oracle, ``chunk.py`` the PyTorch chunk form and
``__init__.py`` the public op, which asks :mod:`linattn.backends` which implementation runs.
Plain linear attention's public op is :func:`linattn.linear_attention` (:mod:`linattn.attention`)."""
from .delta.naive import recurrent_delta_rule
from .gated_delta.naive import recurrent_gated_delta_rule
from .gla.naive import recurrent_gated_linear_attention
from .linear.naive import recurrent_linear_attention
from .retention.naive import recurrent_retention

__all__ = ["recurrent_linear_attention", "recurrent_retention", "recurrent_gated_linear_attention",
           "recurrent_delta_rule", "recurrent_gated_delta_rule"]
