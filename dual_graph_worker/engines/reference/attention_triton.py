"""Paged attention in Triton: capturable in CUDA graphs, lengths read from device tensors.

One program handles BLOCK_M query rows of one request and one KV head: with GQA the G query heads
of a KV head are folded into the row dimension (row m -> query w = m // G, head g = m % G), so a
KV block is loaded once for all of them. Query w of request b sits at position prefix[b] + w and
attends causally to positions [0, prefix[b] + w], reading slots through the request->token table.
W is a runtime argument (not a compile-time constant), so variable-width extends (prefill, lazy
catch-up) do not compile a kernel per width. The loop bound comes from prefix_lens on the device:
nothing host-side changes per step, so the same kernel serves decode (W=1), verify and draft extend
(W=K+1) and prefill (W=prompt length).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dual_graph_worker.engines.reference.attention import AttnBatch


@triton.jit
def _paged_attention_kernel(
    Q, K, V, O, ReqToTok, Rows, Prefix,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_rt, scale, W,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    mb = tl.program_id(2)
    row = tl.load(Rows + b)
    prefix = tl.load(Prefix + b)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_valid = offs_m < W * G
    w = offs_m // G
    head = kvh * G + offs_m % G
    tok = b * W + w
    offs_d = tl.arange(0, D)
    q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_valid[:, None], other=0.0)
    q_pos = prefix + w
    w_hi = tl.minimum((mb * BLOCK_M + BLOCK_M - 1) // G, W - 1)
    kv_end = prefix + w_hi + 1
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for start in range(0, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_end
        slots = tl.load(ReqToTok + row * stride_rt + offs_n, mask=n_valid, other=0)
        k = tl.load(K + slots[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                    mask=n_valid[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        allowed = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(qk - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                    mask=n_valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(O + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=m_valid[:, None])


class TritonPagedAttention:
    name = "triton"

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               req_to_token: torch.Tensor, batch: AttnBatch, scale: float) -> torch.Tensor:
        n, h, d = q.shape
        kvh = k_pool.shape[1]
        B, W = batch.req_rows.numel(), batch.width
        G = h // kvh
        out = torch.empty(n, h, d, dtype=q.dtype, device=q.device)
        block_m = max(16, min(64, triton.next_power_of_2(W * G)))
        block_n = 64 if d <= 128 else 32
        grid = (B, kvh, triton.cdiv(W * G, block_m))
        _paged_attention_kernel[grid](
            q, k_pool, v_pool, out, req_to_token, batch.req_rows, batch.prefix_lens,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
            v_pool.stride(0), v_pool.stride(1), out.stride(0), out.stride(1),
            req_to_token.stride(0), scale, W,
            G=G, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=4, num_stages=2,
        )
        return out.view(n, h * d)
