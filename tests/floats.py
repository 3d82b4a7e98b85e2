"""How close two float32 results must be: the suite's one rule for float comparisons.

Two float32 evaluations of the same sum differ when the terms are added in another order: another
CPU (AVX2 vs AVX-512 kernels block a matmul differently), another thread count, a batch split over
two processes. Each of the n - 1 additions of a sum rounds by at most half an ulp of the partial sum,
u = eps / 2, so each order is within (n - 1) u sum|x_i| of the exact sum (Higham, Accuracy and
Stability of Numerical Algorithms, eq. 4.4), and two orders are within

    |a - b| <= n * eps * scale,     eps = 2^-23 ~ 1.19e-7 (float32),  scale ~ sum|x_i|

A test names n, the number of terms of the longest sum behind the value (tokens in a batch, the
width of a layer, the elementwise operations of a formula: exp and log count 1 each, since torch's
vectorised kernels are accurate to about 1 ulp), and the scale of the result (by default its
largest |entry|). So a tolerance follows from float32 and the size of the sum, not from what one
machine happened to print, and it stays orders of magnitude below what a wrong formula changes.

Bit-exact comparisons (torch.equal) are kept for what is exact by construction: integer tokens and
masks, a value copied or multiplied by zero, and two runs of the same code on the same machine in
the same test (determinism, kill and resume)."""
import math

import torch

EPS = torch.finfo(torch.float32).eps  # 2^-23: the gap between 1.0 and the next float32


def tolerance(terms: int, scale: float = 1.0) -> float:
    """|a - b| two float32 evaluations of a sum of `terms` terms of size `scale` may show."""
    return terms * EPS * scale


def assert_close(actual, expected, terms: int, scale: float | None = None, msg: str = ""):
    """Every |actual - expected| <= tolerance(terms, scale); scale defaults to max |expected| (at least 1e-30).
    Works for tensors, Python floats and lists; NaN or inf anywhere fails (inf == inf passes)."""
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, f"{msg} shapes {tuple(actual.shape)} vs {tuple(expected.shape)}"
    same_inf = torch.isinf(expected) & (actual == expected)
    finite = torch.isfinite(expected) & ~same_inf
    assert (torch.isfinite(actual) | same_inf).all() and (same_inf | finite).all(), f"{msg} non-finite values"
    if scale is None:
        scale = expected[finite].abs().max().item() if finite.any() else 0.0
    bound = tolerance(terms, max(scale, 1e-30))
    worst = (actual[finite] - expected[finite]).abs().max().item() if finite.any() else 0.0
    assert worst <= bound, f"{msg} max |difference| {worst:.3g} > {bound:.3g} = {terms} terms x eps x scale {scale:.3g}"
    return worst


def approx(expected: float, terms: int = 4, scale: float | None = None):
    """pytest.approx with the float32 tolerance of a short formula computed in float32: for
    hand-computed scalars (`loss.item() == approx(-0.5)`). terms: rounding steps of the formula."""
    import pytest

    if isinstance(expected, (list, tuple)):
        scale = scale if scale is not None else max((abs(x) for x in expected), default=0.0)
        return pytest.approx(expected, rel=0, abs=tolerance(terms, max(scale, 1e-30)))
    scale = scale if scale is not None else abs(expected)
    assert math.isfinite(expected)
    return pytest.approx(expected, rel=0, abs=tolerance(terms, max(scale, 1e-30)))


def forward_terms(config) -> int:
    """The sums a value of one forward pass has gone through: each decoder layer's widest matmul
    (the MLP's intermediate size, or the hidden size), then the logsumexp over the vocabulary.
    Two passes that batch, pad or cache differently add these in another order."""
    width = max(getattr(config, "intermediate_size", 0) or 0, config.hidden_size)
    return config.num_hidden_layers * width + config.vocab_size
