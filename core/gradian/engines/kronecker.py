"""Kronecker-factored curvature of one linear layer: K-FAC and its eigenvalue-corrected form.

A linear layer ``y = W x`` (``W``: ``[out, in]``) trained on examples ``b`` with tokens ``t`` has
the per-example weight gradient ``G_b = sum_t g_bt x_bt^T``, where ``g_bt`` is the gradient of the
example's loss with respect to the output at token ``t``. The (empirical) Fisher of the layer,
``F = (1/N) sum_b vec(G_b) vec(G_b)^T``, is approximated by a Kronecker product of two small
factors (Martens & Grosse, 2015)::

    A = (1/T) sum_{b,t} x_bt x_bt^T        input covariance, [in, in], T real tokens
    S = (1/N) sum_{b,t} g_bt g_bt^T        output-gradient covariance, [out, out], N examples
    F ~ A (x) S

With ``A = Q_A diag(a) Q_A^T`` and ``S = Q_S diag(s) Q_S^T``, K-FAC's eigenvalues in the Kronecker
basis are ``s_o a_i``. EK-FAC (George et al., 2018) keeps the basis and replaces them with the
exact second moment of the gradients in it, ``Lambda[o, i] = (1/N) sum_b (Q_S^T G_b Q_A)[o, i]^2``:
the diagonal of ``F`` in that basis, so the approximation is exact whenever ``F`` is diagonal
there (for instance with one example of one token, where ``F = A (x) S`` exactly).

The damped inverse applied to a matrix-shaped vector ``V`` (``[out, in]``) is::

    (F + lam I)^-1 V ~ Q_S [ (Q_S^T V Q_A) / (Lambda + lam) ] Q_A^T

with ``lam = scale * mean(Lambda)`` by default (the mean eigenvalue), or an absolute value.
Everything here is float64 numpy; nothing forms the ``[out*in, out*in]`` matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gradian.errors import ConfigError

__all__ = ["KroneckerFactors", "KroneckerEigen", "eigendecompose", "corrected_eigenvalues", "damped_inverse"]


@dataclass
class KroneckerFactors:
    """Running sums of one linear layer's two covariances; ``finish`` divides them."""

    a_sum: np.ndarray
    s_sum: np.ndarray
    tokens: int = 0
    examples: int = 0

    @classmethod
    def zeros(cls, out_dim: int, in_dim: int) -> "KroneckerFactors":
        return cls(np.zeros((in_dim, in_dim)), np.zeros((out_dim, out_dim)))

    def add(self, x: np.ndarray, g: np.ndarray, examples: int) -> None:
        """Add ``x`` (``[tokens, in]``) and ``g`` (``[tokens, out]``) of ``examples`` examples."""
        x = np.asarray(x, dtype=np.float64)
        g = np.asarray(g, dtype=np.float64)
        self.add_sums(x.T @ x, g.T @ g, int(x.shape[0]), examples)

    def add_sums(self, xx: np.ndarray, gg: np.ndarray, tokens: int, examples: int) -> None:
        """Add precomputed ``sum x x^T`` and ``sum g g^T`` over ``tokens`` tokens of ``examples`` examples."""
        self.a_sum += xx
        self.s_sum += gg
        self.tokens += int(tokens)
        self.examples += int(examples)

    def finish(self) -> tuple[np.ndarray, np.ndarray]:
        """``(A, S)``: the token-mean input covariance and the per-example output-gradient one."""
        return self.a_sum / max(self.tokens, 1), self.s_sum / max(self.examples, 1)


@dataclass
class KroneckerEigen:
    """One layer's eigenbasis and the eigenvalues used in it (``[out, in]``)."""

    q_a: np.ndarray
    q_s: np.ndarray
    eigenvalues: np.ndarray

    def rotate(self, grads: np.ndarray) -> np.ndarray:
        """``Q_S^T G Q_A`` for ``G`` of shape ``[..., out, in]``."""
        if grads.ndim != 3:
            return self.q_s.T @ grads @ self.q_a
        return self.rotate_rows(grads).transpose(1, 0, 2)

    def rotate_rows(self, grads: np.ndarray) -> np.ndarray:
        """``Q_S^T G_b Q_A`` of each row ``b`` of ``grads`` ``[rows, out, in]``, laid out
        ``[out, rows, in]``: two large products instead of two small ones per row (about twice as
        fast on LoRA's thin matrices, where one side is the rank)."""
        rows, out_dim, in_dim = grads.shape
        right = (grads.reshape(rows * out_dim, in_dim) @ self.q_a).reshape(rows, out_dim, in_dim)
        left = self.q_s.T @ right.transpose(1, 0, 2).reshape(out_dim, rows * in_dim)
        return left.reshape(out_dim, rows, in_dim)

    def unrotate(self, grads: np.ndarray) -> np.ndarray:
        return self.q_s @ grads @ self.q_a.T


_FACTOR_FIX = ("the adapter's gradients are too large or not finite: use an earlier checkpoint, load the model "
               "in a wider type (dtype: float32 or float64), or set engine.name: datainf, which needs no "
               "eigendecomposition")


def _eigh(matrix: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    import torch

    if not np.isfinite(matrix).all():
        raise ConfigError(f"EK-FAC: the {what} holds NaN or infinite values; {_FACTOR_FIX}")
    # torch's LAPACK call runs under the project's torch thread settings
    try:
        values_t, vectors_t = torch.linalg.eigh(torch.from_numpy(np.ascontiguousarray((matrix + matrix.T) / 2)))
    except RuntimeError as err:  # torch.linalg.LinAlgError: the iteration did not converge
        largest = float(np.abs(matrix).max()) if matrix.size else 0.0
        raise ConfigError(f"EK-FAC: the eigendecomposition of the {what} did not converge (largest entry "
                          f"{largest:.3g}; {str(err).splitlines()[0][:120]}); {_FACTOR_FIX}") from None
    values, vectors = values_t.numpy(), vectors_t.numpy()
    # covariances are positive semi-definite; round-off can leave tiny negative values
    return np.clip(values, 0.0, None), vectors


def eigendecompose(a: np.ndarray, s: np.ndarray, block: str = "a LoRA block") -> KroneckerEigen:
    """The Kronecker eigenbasis of ``A (x) S`` with K-FAC's eigenvalues ``s_o a_i``.

    Factors that hold NaN or infinity, or whose eigendecomposition does not converge, raise a
    ``ConfigError`` naming ``block`` and the settings that get past it.
    """
    a_values, q_a = _eigh(a, f"input covariance of {block}")
    s_values, q_s = _eigh(s, f"output-gradient covariance of {block}")
    return KroneckerEigen(q_a, q_s, np.outer(s_values, a_values))


def corrected_eigenvalues(eigen: KroneckerEigen, per_example: np.ndarray) -> np.ndarray:
    """Sum over examples of ``(Q_S^T G_b Q_A)^2`` for ``per_example`` of shape ``[rows, out, in]``.

    Divide the total over every chunk by the number of examples to get EK-FAC's eigenvalues.
    """
    rotated = eigen.rotate_rows(np.asarray(per_example, dtype=np.float64))
    return np.einsum("obi,obi->oi", rotated, rotated)


def damped_inverse(eigen: KroneckerEigen, vectors: np.ndarray, damping: float) -> np.ndarray:
    """``(Q diag(Lambda) Q^T + damping I)^-1`` applied to ``vectors`` of shape ``[queries, out, in]``."""
    return eigen.unrotate(eigen.rotate(np.asarray(vectors, dtype=np.float64)) / (eigen.eigenvalues + damping))
