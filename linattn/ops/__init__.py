"""The operator families, one folder each (flash-linear-attention's ``fla/ops/<family>/`` layout):
``naive.py`` holds the public token-loop oracle, ``chunk.py`` the PyTorch chunk form and
``__init__.py`` the public op, which asks :mod:`linattn.backends` which implementation runs.
Plain linear attention's public op is :func:`linattn.linear_attention` (:mod:`linattn.attention`)."""
from .delta import delta_rule, recurrent_delta_rule
from .gated_delta import gated_delta_rule, recurrent_gated_delta_rule
from .gla import gated_linear_attention, recurrent_gated_linear_attention
from .linear import recurrent_linear_attention
from .retention import recurrent_retention, retention

__all__ = ["retention", "gated_linear_attention", "delta_rule", "gated_delta_rule", "recurrent_linear_attention",
           "recurrent_retention", "recurrent_gated_linear_attention", "recurrent_delta_rule",
           "recurrent_gated_delta_rule"]
