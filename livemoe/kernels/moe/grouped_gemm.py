"""Triton grouped GEMMs over align blocks (see align.py): every program owns BLOCK_M (token, slot) pairs of
one expert, read through `sorted_token_ids` (gather fused: no permuted copy of the activations).

Pair index p = token * top_k + slot; pair-indexed buffers ([T*k, .]) are written at row p, so the k copies
of a token can be summed afterwards in a fixed order (deterministic, no atomics).

Kernels (all fp32 accumulation):
  gate_up_swiglu  act[p] = silu(x[t] W_g^T) * (x[t] W_u^T)              (+ the pre-activation for backward)
  gather_gemm     out[p] = scale[p] * A[p // a_div] B_e^T               (GEMM2 forward, dx backward)
  down_backward   dact[p] = w[p] * dy[t] W_d, then SwiGLU backward and the routing-weight grad partials
  expert_grad     dW_e = sum over the pairs p of expert e of A[p // a_div]^T B[p // b_div]
"""
import triton
import triton.language as tl


@triton.jit
def _block_tile(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped launch order: GROUP_M consecutive align blocks share each weight tile while it is in L2."""
    pid = tl.program_id(0)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit
def _block_pairs(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr):
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return pairs, pairs < num_pairs


@triton.jit
def gathered_dot(a_ptr, rows, valid, stride_am, stride_ak, b_ptr, offs_n, n_ok, stride_bn, stride_bk, K,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """acc[m, n] = sum_k A[rows[m], k] * B[offs_n[n], k] in fp32: the gathered main loop of a tile (b_ptr
    already points at the expert's matrix)."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def gate_up_swiglu_kernel(x_ptr, w_ptr, act_ptr, preact_ptr, sorted_ids_ptr, expert_ids_ptr,
                          num_pairs, top_k, H, I, num_pid_m,
                          stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_am, stride_pm,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr, SAVE_PREACT: tl.constexpr, PRECISION: tl.constexpr):
    pid_m, pid_n = _block_tile(num_pid_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:  # past the last used block
        return
    pairs, valid = _block_pairs(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M)
    rows = (pairs // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < I
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    wg_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    wu_ptrs = wg_ptrs + I * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        k_ok = offs_k < H - k * BLOCK_K
        a = tl.load(x_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(wg_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        wu = tl.load(wu_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g = tl.dot(a, wg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, wu, acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        wg_ptrs += BLOCK_K * stride_wk
        wu_ptrs += BLOCK_K * stride_wk
    out_dtype = act_ptr.dtype.element_ty
    # round the pre-activations to the storage dtype first, as the reference's F.linear does
    gate = acc_g.to(out_dtype).to(tl.float32)
    up = acc_u.to(out_dtype).to(tl.float32)
    act = gate * tl.sigmoid(gate) * up
    p64 = pairs.to(tl.int64)
    mask = valid[:, None] & n_ok[None, :]
    tl.store(act_ptr + p64[:, None] * stride_am + offs_n[None, :], act.to(out_dtype), mask=mask)
    if SAVE_PREACT:
        pre_ptrs = preact_ptr + p64[:, None] * stride_pm + offs_n[None, :]
        tl.store(pre_ptrs, gate.to(out_dtype), mask=mask)
        tl.store(pre_ptrs + I, up.to(out_dtype), mask=mask)


@triton.jit
def gather_gemm_kernel(a_ptr, b_ptr, out_ptr, scale_ptr, sorted_ids_ptr, expert_ids_ptr,
                       num_pairs, a_div, N, K, num_pid_m,
                       stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, SCALE_ROWS: tl.constexpr, PRECISION: tl.constexpr):
    """out[p, n] = scale[p] * sum_k A[p // a_div, k] * B[e, n, k] for the pairs p of each align block."""
    pid_m, pid_n = _block_tile(num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pairs, valid = _block_pairs(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M)
    rows = (pairs // a_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = gathered_dot(a_ptr, rows, valid, stride_am, stride_ak, b_ptr + expert * stride_be, offs_n, n_ok,
                        stride_bn, stride_bk, K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    out_dtype = out_ptr.dtype.element_ty
    if SCALE_ROWS:  # the reference rounds the product before weighting it
        acc = acc.to(out_dtype).to(tl.float32) * tl.load(scale_ptr + pairs, mask=valid, other=0.0)[:, None]
    p64 = pairs.to(tl.int64)
    tl.store(out_ptr + p64[:, None] * stride_om + offs_n[None, :], acc.to(out_dtype), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def down_backward_kernel(dy_ptr, w_ptr, preact_ptr, topk_w_ptr, dpre_ptr, act_ptr, dw_part_ptr,
                         sorted_ids_ptr, expert_ids_ptr, num_pairs, top_k, H, I, num_pid_m,
                         stride_dym, stride_dyk, stride_we, stride_wh, stride_wi, stride_pm, stride_am,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
    """g[p] = dy[t] W_d (over H, one I tile); then dact = w[p] g, the SwiGLU backward into dpre [T*k, 2I],
    act [T*k, I] recomputed for dW_down, and the routing-weight grad partial sum_i g * act per I tile."""
    pid_m, pid_n = _block_tile(num_pid_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pairs, valid = _block_pairs(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M)
    rows = (pairs // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    acc = gathered_dot(dy_ptr, rows, valid, stride_dym, stride_dyk, w_ptr + expert * stride_we, offs_n, n_ok,
                        stride_wi, stride_wh, H, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    p64 = pairs.to(tl.int64)
    mask = valid[:, None] & n_ok[None, :]
    pre_ptrs = preact_ptr + p64[:, None] * stride_pm + offs_n[None, :]
    gate = tl.load(pre_ptrs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    dsilu = sig * (1.0 + gate * (1.0 - sig))  # d silu / d gate: gate and sig die here
    up = tl.load(pre_ptrs + I, mask=mask, other=0.0).to(tl.float32)
    out_dtype = act_ptr.dtype.element_ty
    act = (silu * up).to(out_dtype)
    tl.store(act_ptr + p64[:, None] * stride_am + offs_n[None, :], act, mask=mask)
    tl.store(dw_part_ptr + pid_n * num_pairs + pairs, tl.sum(acc * act.to(tl.float32), axis=1), mask=valid)
    dact = acc * tl.load(topk_w_ptr + pairs, mask=valid, other=0.0)[:, None]
    dpre_ptrs = dpre_ptr + p64[:, None] * stride_pm + offs_n[None, :]
    tl.store(dpre_ptrs + I, (dact * silu).to(out_dtype), mask=mask)
    tl.store(dpre_ptrs, (dact * up * dsilu).to(out_dtype), mask=mask)


@triton.jit
def expert_grad_kernel(a_ptr, b_ptr, scale_ptr, out_ptr, sorted_ids_ptr, seg_start_ptr, counts_ptr,
                       a_div, b_div, M, N, stride_am, stride_bm, stride_oe, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SCALE_A: tl.constexpr, PRECISION: tl.constexpr):
    """out[e, m, n] = sum over the pairs p of expert e of scale[p] A[p // a_div, m] B[p // b_div, n].

    One program per (output tile, expert), looping over the expert's pairs: every expert's tile is written
    (zeros for an expert no token chose), and nothing is accumulated across programs (deterministic)."""
    expert = tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    start = tl.load(seg_start_ptr + expert)
    count = tl.load(counts_ptr + expert)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, count, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_ok = offs_k < count
        pairs = tl.load(sorted_ids_ptr + start + offs_k, mask=k_ok, other=0)
        rows_a = (pairs // a_div).to(tl.int64)
        rows_b = (pairs // b_div).to(tl.int64)
        a = tl.load(a_ptr + rows_a[None, :] * stride_am + offs_m[:, None], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        if SCALE_A:
            s = tl.load(scale_ptr + pairs, mask=k_ok, other=0.0)
            a = (a.to(tl.float32) * s[None, :]).to(a.dtype)
        b = tl.load(b_ptr + rows_b[:, None] * stride_bm + offs_n[None, :], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    out_ptrs = out_ptr + expert.to(tl.int64) * stride_oe + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
