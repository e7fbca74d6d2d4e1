"""The types of the optional C extension built from `_statskernel.c` (see `stats.py`): mypy cannot read a compiled
module, so its three functions are declared here, as the C file's method table documents them."""

def simd() -> bool: ...

# (low, high, sum, sumsq, abs_sum, nan, inf, finite, check0, check1): five float64 sums, then five counts/words
def reduce(address: int, numel: int, kind: int, vectorized: bool = ..., /) -> tuple[
    float, float, float, float, float, int, int, int, int, int]: ...

# (sum a^2, sum b^2, sum (a-b)^2, sum a*b, max |a-b|)
def pair(address_a: int, address_b: int, numel: int, kind: int, vectorized: bool = ..., /) -> tuple[
    float, float, float, float, float]: ...
