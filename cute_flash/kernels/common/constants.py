"""Numeric constants the kernels and their host side share (pure Python: no DSL import)."""
import math

LOG2E = math.log2(math.e)  # exp(x) = exp2(x * LOG2E): scores are exponentiated with exp2
LN2 = math.log(2.0)        # log(x) = log2(x) * LN2: LSE is stored in natural log
