"""The Kimi delta rule (KDA's core) in plain PyTorch and through flash-linear-attention, ``[b, s, H, D]`` layout.

:func:`chunk_kda_torch` is the chunked WY form (runs anywhere, differentiable by autograd), the reference of FLA's
``chunk_kda`` (:func:`chunk_kda_fla`, CUDA + triton, imported when called); :func:`recurrent_kda_reference` is the
token-by-token recurrence both are tested against. ``cu_seqlens`` (int ``[n_docs + 1]`` along ``s``) restarts the
state at every document boundary; ``None``: every batch row is one document.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch

__all__ = ["l2norm", "chunk_kda_torch", "chunk_kda_fla", "recurrent_kda_reference"]


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` along ``dim`` (FLA / HF convention: eps inside the sqrt, no clamp)."""
    return x / torch.sqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _flat_cu_seqlens(cu_seqlens: Optional[Union[torch.Tensor, List[int]]], b: int, s: int) -> List[int]:
    """Document boundaries over the ``b * s`` flattened tokens (python ints, zero-length documents dropped).

    ``cu_seqlens`` (over one row of length ``s``; a tensor or python ints) applies to every batch row; ``None`` means
    one document per row.
    """
    if cu_seqlens is None:
        row = [0, s]
    else:
        row = [int(x) for x in (cu_seqlens if isinstance(cu_seqlens, list) else cu_seqlens.tolist())]
        if len(row) < 2 or row[0] != 0 or row[-1] != s or any(b_ < a for a, b_ in zip(row[:-1], row[1:])):
            raise ValueError(f"cu_seqlens must be non-decreasing from 0 to the row length {s}, got {row}")
    out = [0]
    for r in range(b):
        for end in row[1:]:
            if r * s + end > out[-1]:
                out.append(r * s + end)
    return out


_EXP_FLOOR = -60.0
"""Log-decays are floored here before ``exp`` (exp(-60) ~ 9e-27, far below the fp32 resolution of any O(1) term):
this keeps the chunked form free of denormal floats, which are ~100x slower on CPUs."""


def _decay(x: torch.Tensor) -> torch.Tensor:
    """``exp(max(x, _EXP_FLOOR))``."""
    return torch.exp(x.clamp(min=_EXP_FLOOR))


def _chunk_plan(cu: List[int], chunk_size: int, device) -> Tuple[torch.Tensor, torch.Tensor, List[int]]:
    """Cut every document into chunks and order them step-major (chunk index inside the document first).

    Documents are sorted by chunk count (descending), so the documents still running at step ``n`` are a prefix
    of that order and the recurrent state can simply be truncated between steps.

    Returns:
        tok_idx: ``[NC, C]`` int64 flat token index of every chunk slot (``T`` = a zero dummy token for the
            padding after a document's end);
        inv: ``[T]`` int64 position of every token in the flattened ``[NC * C]`` chunk layout;
        steps: number of chunks at each step (non-increasing, sums to ``NC``).
    """
    C = chunk_size
    starts = torch.tensor(cu[:-1], dtype=torch.long)
    lens = torch.tensor(cu[1:], dtype=torch.long) - starts
    T = cu[-1]
    nch = (lens + C - 1) // C
    order = torch.argsort(nch, descending=True, stable=True)
    starts, lens, nch = starts[order], lens[order], nch[order]
    max_n = int(nch.max())
    active = nch[None, :] > torch.arange(max_n)[:, None]  # [max_n, n_docs]
    step_idx, doc_idx = active.nonzero(as_tuple=True)  # row-major: step-major, docs in sorted order
    steps = active.sum(1).tolist()
    chunk_start = starts[doc_idx] + step_idx * C
    chunk_len = torch.clamp(lens[doc_idx] - step_idx * C, max=C)
    slot = torch.arange(C)
    valid = slot[None, :] < chunk_len[:, None]
    tok_idx = torch.where(valid, chunk_start[:, None] + slot[None, :], torch.full_like(valid, T, dtype=torch.long))
    inv = torch.empty(T, dtype=torch.long)
    inv[tok_idx[valid]] = torch.arange(valid.numel())[valid.flatten()]
    return tok_idx.to(device), inv.to(device), steps


def chunk_kda_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    scale: Optional[float] = None, cu_seqlens: Optional[torch.Tensor] = None,
                    chunk_size: int = 64, use_qk_l2norm: bool = False) -> torch.Tensor:
    """Chunked Kimi delta rule in plain PyTorch (fp32 inside, differentiable, vectorised over chunks).

    Per head, with a ``[K, V]`` state ``S`` that starts at zero in every document::

        S = exp(g_t)[:, None] * S                   # per-key-channel decay
        S = S + k_t (beta_t * (v_t - k_t^T S))^T    # delta rule
        o_t = scale * q_t^T S

    Args:
        q, k: ``[b, s, H, K]``; v: ``[b, s, H, V]``.
        g: ``[b, s, H, K]`` log decay (<= 0), used in fp32.
        beta: ``[b, s, H]`` write strength.
        scale: query scale, default ``K ** -0.5``.
        cu_seqlens: optional int ``[n_docs + 1]`` boundaries along ``s`` (normally ``b = 1``, a packed row); the
            state restarts at every boundary. ``None``: every batch row is one document.
        chunk_size: chunk length ``C`` of the WY form (any positive value; it does not change the result).
        use_qk_l2norm: L2-normalise q and k in fp32 first (HF's ``use_qk_l2norm_in_kernel=True``).

    Returns:
        ``o``: ``[b, s, H, V]`` in ``q.dtype``.

    Each document is cut into chunks of ``C`` (the last one zero-padded), so chunks never straddle documents.
    Inside a chunk (cumulative decay ``G_i = sum_{t<=i} g_t``) the WY form solves
    ``(I + A) [U | W] = [beta v | beta k exp(G)]`` with ``A_ij = beta_i sum_d k_id k_jd exp(G_id - G_jd)``
    (``j < i``); then chunk by chunk ``u = U - W S``, ``o = scale (q exp(G)) S + scale (Aqk) u`` and
    ``S <- exp(G_C) S + (k exp(G_C - G))^T u``. The intra-chunk part is batched over all chunks of all
    documents; the inter-chunk recurrence loops over ``ceil(longest document / C)`` steps, batched over documents.
    """
    b, s, H, K = q.shape
    V = v.shape[-1]
    out_dtype = q.dtype
    if scale is None:
        scale = K ** -0.5
    if s == 0:
        return q.new_zeros(b, s, H, V)
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)

    C = int(chunk_size)
    T = b * s
    tok_idx, inv, steps = _chunk_plan(_flat_cu_seqlens(cu_seqlens, b, s), C, q.device)
    NC = tok_idx.shape[0]

    def to_chunks(x: torch.Tensor) -> torch.Tensor:  # [b, s, H, *] -> [NC, H, C, *] (dummy zero token appended)
        x = x.reshape(T, *x.shape[2:])
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])], 0)[tok_idx]  # [NC, C, H, *]
        return x.transpose(1, 2)

    qc, kc, vc, gc, bc = (to_chunks(t) for t in (q, k, v, g, beta))  # bc: [NC, H, C]
    qc = qc * scale
    gc = gc.cumsum(-2)  # [NC, H, C, K] cumulative log decay inside each chunk

    # pairwise decayed scores, materialised per key channel for exactness with unbounded gates:
    # E[i, j, d] = exp(G_id - G_jd) for j <= i (<= 1 as g <= 0), 0 above the diagonal
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = gc.unsqueeze(-2) - gc.unsqueeze(-3)  # [NC, H, C(i), C(j), K]
    # (clamping at 0 only touches the masked upper triangle, where diff >= 0 could overflow)
    kE = torch.exp(diff.clamp(_EXP_FLOOR, 0.0)) * causal[..., None] * kc.unsqueeze(-3)  # E * k_j
    scores = torch.matmul(kE, torch.stack([kc, qc], -1))  # [NC, H, C(i), C(j), 2]: (k_i | q_i) . E k_j
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    akk = (scores[..., 0] * bc.unsqueeze(-1)).masked_fill(~strict, 0.0)  # beta_i k_i.E.k_j, j < i
    aqk = scores[..., 1]  # scale q_i.E.k_j, j <= i

    eye = torch.eye(C, dtype=akk.dtype, device=akk.device)
    rhs = torch.cat([vc * bc.unsqueeze(-1), kc * bc.unsqueeze(-1) * _decay(gc)], -1)
    uw = torch.linalg.solve_triangular(akk + eye, rhs, upper=False, unitriangular=True)
    U, Wm = uw[..., :V], uw[..., V:]  # [NC, H, C, V], [NC, H, C, K]

    q_dec = qc * _decay(gc)  # [NC, H, C, K]
    g_last = gc[..., -1:, :]  # [NC, H, 1, K]
    k_dec = kc * _decay(g_last - gc)  # [NC, H, C, K], decay from each position to the chunk end
    state_decay = _decay(g_last).transpose(-1, -2)  # [NC, H, K, 1]

    S = q.new_zeros(steps[0], H, K, V)
    outs = []
    off = 0
    for n, m in enumerate(steps):
        S = S[:m]
        sl = slice(off, off + m)
        u = U[sl] - torch.matmul(Wm[sl], S)
        outs.append(torch.matmul(q_dec[sl], S) + torch.matmul(aqk[sl], u))
        if n + 1 < len(steps):
            S = state_decay[sl] * S + torch.matmul(k_dec[sl].transpose(-1, -2), u)
        off += m
    o = torch.cat(outs, 0).transpose(1, 2).reshape(NC * C, H, V)[inv]  # [T, H, V]
    return o.reshape(b, s, H, V).to(out_dtype)


def recurrent_kda_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, scale: Optional[float] = None,
                            cu_seqlens: Optional[torch.Tensor] = None, use_qk_l2norm: bool = False) -> torch.Tensor:
    """Token-by-token reference of :func:`chunk_kda_torch` (same arguments and layout, slow; for tests)."""
    b, s, H, K = q.shape
    V = v.shape[-1]
    out_dtype = q.dtype
    if scale is None:
        scale = K ** -0.5
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    resets = set(_flat_cu_seqlens(cu_seqlens, b, s)[:-1])
    qf, kf, vf, gf, bf = (t.reshape(b * s, *t.shape[2:]) for t in (q, k, v, g, beta))
    outs = []
    S = None
    for t in range(b * s):
        if t in resets:
            S = q.new_zeros(H, K, V)
        S = S * torch.exp(gf[t])[..., None]
        delta = bf[t][:, None] * (vf[t] - (kf[t][..., None] * S).sum(-2))
        S = S + kf[t][..., None] * delta[:, None, :]
        outs.append((qf[t][..., None] * S).sum(-2))
    return torch.stack(outs, 0).reshape(b, s, H, V).to(out_dtype)


def chunk_kda_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  scale: Optional[float] = None, cu_seqlens: Optional[torch.Tensor] = None,
                  chunk_size: int = 64, use_qk_l2norm: bool = True) -> torch.Tensor:
    """:func:`chunk_kda_torch` through flash-linear-attention's ``chunk_kda`` (CUDA + triton; same arguments).

    Packed documents are passed as FLA varlen (``B = 1`` with int64 ``cu_seqlens`` over the flattened tokens).
    ``g`` is handed over in fp32 (pre-computed decay, ``use_gate_in_kernel=False``). FLA supports chunk sizes 32
    and 64 only; other values fall back to 64 (the chunk size does not change the result).
    """
    missing = []
    if not torch.cuda.is_available() or not q.is_cuda:
        missing.append("CUDA tensors (a CUDA device)")
    try:
        import triton  # noqa: F401
    except ImportError:
        missing.append("triton")
    chunk_kda = None
    if not missing:
        try:
            from fla.ops.kda import chunk_kda
        except ImportError as e:  # pragma: no cover - depends on the install
            missing.append(f"flash-linear-attention (fla.ops.kda: {e})")
    if missing:
        raise RuntimeError("kda_backend='fla' needs " + ", ".join(missing)
                           + "; use kda_backend='torch' to run the PyTorch delta rule instead.")
    b, s, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K ** -0.5
    fla_chunk = chunk_size if chunk_size in (32, 64) else 64
    g = g.float()
    if cu_seqlens is None:
        o, _ = chunk_kda(q=q, k=k, v=v, g=g, beta=beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm,
                         chunk_size=fla_chunk)
        return o
    cu_list = _flat_cu_seqlens(cu_seqlens, b, s)
    cu = torch.tensor(cu_list, dtype=torch.long)
    q1, k1, v1, g1, b1 = (t.reshape(1, b * s, *t.shape[2:]) for t in (q, k, v, g, beta))
    o, _ = chunk_kda(q=q1, k=k1, v=v1, g=g1, beta=b1, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm,
                     cu_seqlens=cu.to(q.device), cu_seqlens_cpu=cu, chunk_size=fla_chunk)
    return o.reshape(b, s, H, V)
