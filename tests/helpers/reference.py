"""References written from the original XLNet: the float64 relative attention, whose relative term
goes through the literal reshape ``rel_shift`` of the original code, and the original (TF)
``_local_perm`` that the rank masks must reproduce."""

import math

import torch


def rel_shift_literal(x: torch.Tensor, klen: int) -> torch.Tensor:
    """XLNet's rel_shift on (qlen, R): reshape (R, qlen), drop a row, reshape (qlen, R-1), keep klen."""
    qlen, R = x.shape
    x = x.reshape(R, qlen)[1:].reshape(qlen, R - 1)
    return x[:, :klen]


def reference_attention(q, k, v, k_r, r_w_bias, r_r_bias, *, r_s_bias=None, seg_embed=None,
                        q_seg=None, k_seg=None, attn_mask=None, q_rank=None, k_rank=None,
                        self_visible=True, q_pos=None, qlen=None, scale=None, position_rounding=None):
    """Same contract as xlnet_fast.rel_attention, float64, loops over batch and heads.
    ``position_rounding``: a function applied to the position term as the fused kernels form it,
    ``bd * scale * log2(e)`` (their log2-domain products), e.g. a rounding to bf16."""
    B, M, H, D = q.shape
    K, R = k.shape[1], k_r.shape[1]
    qlen = M if qlen is None else qlen
    mlen = K - qlen
    scale = 1 / math.sqrt(D) if scale is None else scale
    pos = torch.arange(M).expand(B, M) if q_pos is None else q_pos.long()
    outs = []
    for b in range(B):
        heads = []
        for h in range(H):
            qb, kb, vb = q[b, :, h].double(), k[b, :, h].double(), v[b, :, h].double()
            krb = k_r[b if k_r.shape[0] > 1 else 0, :, h].double()
            ac = (qb + r_w_bias[h].double()) @ kb.T
            raw = (qb + r_r_bias[h].double()) @ krb.T  # (M, R)
            bd = torch.zeros(M, K, dtype=torch.float64)
            for i in range(M):
                p = int(pos[b, i])
                if p < 0:
                    continue
                full = torch.zeros(qlen, R, dtype=torch.float64)
                full = full.index_put((torch.tensor([p]),), raw[i][None])
                bd = bd.index_put((torch.tensor([i]),), rel_shift_literal(full, K)[p][None])
            if position_rounding is not None:
                to_kernel = scale * math.log2(math.e)
                bd = position_rounding(bd * to_kernel).double() / to_kernel
            score = ac + bd
            if seg_embed is not None:
                diff = (q_seg[b][:, None] != k_seg[b][None, :]).long()
                onehot = torch.nn.functional.one_hot(diff, 2).double()  # (M, K, 2)
                ef_s = (qb + r_s_bias[h].double()) @ seg_embed[:, h].double().T  # (M, 2)
                score = score + torch.einsum("ijs,is->ij", onehot, ef_s)
            score = score * scale
            blocked = torch.zeros(M, K, dtype=torch.bool)
            if attn_mask is not None:
                blocked = attn_mask[b].clone()
            if q_rank is not None:
                blocked = ~(k_rank[b][None, :].long() < q_rank[b][:, None].long())
                if self_visible:
                    for i in range(M):
                        if pos[b, i] >= 0:
                            blocked[i, mlen + int(pos[b, i])] = False
            for i in range(M):
                p = int(pos[b, i])
                if p < 0:
                    blocked[i] = True
                    continue
                for j in range(K):
                    if qlen + j - p >= R:
                        blocked[i, j] = True
            score = score.masked_fill(blocked, float("-inf"))
            prob = torch.softmax(score, -1)
            prob = torch.where(blocked.all(-1, keepdim=True), torch.zeros_like(prob), prob)
            heads.append(prob @ vb)
        outs.append(torch.stack(heads, 1))
    return torch.stack(outs, 0)


def original_local_perm(inputs, is_masked, perm_size, order, sep_id, cls_id):
    """The original `_local_perm` (TF), transcribed op by op, with a given row shuffle `order`.

    ``inputs``, ``is_masked`` ``(L,)``; ``order`` a permutation of ``range(perm_size)``; ``sep_id``,
    ``cls_id`` the functional tokens (the original reads them from globals). Returns the dense
    ``perm_mask (L, L)`` (True = blocked) and ``target_tokens (L,)``.
    """
    seq_len = inputs.shape[0]
    index = torch.arange(seq_len)
    index = index.reshape(-1, perm_size).T
    index = index[order]  # tf.random_shuffle over the first dim
    index = index.T.reshape(-1)
    non_func_tokens = ~((inputs == sep_id) | (inputs == cls_id))
    non_mask_tokens = (~is_masked) & non_func_tokens
    masked_or_func_tokens = ~non_mask_tokens
    smallest_index = -torch.ones(seq_len, dtype=torch.long)
    rev_index = torch.where(non_mask_tokens, smallest_index, index)
    target_tokens = masked_or_func_tokens & non_func_tokens
    self_rev_index = torch.where(target_tokens, rev_index, rev_index + 1)
    perm_mask = (self_rev_index[:, None] <= rev_index[None, :]) & masked_or_func_tokens
    return perm_mask, target_tokens


def philox4x32(counter, key, rounds: int):
    """Philox4x32 (Salmon et al., SC'11) on int64 tensors holding uint32 values: ``counter`` a list
    of four tensors, ``key`` two ints; returns the four output words."""
    mask = 0xFFFFFFFF

    def mulhilo(a: int, c):  # the 64-bit product a * c as (high, low) words, exact in int64 pieces
        low = a * (c & 0xFFFF)  # < 2**48
        mid = a * (c >> 16) + (low >> 16)  # < 2**49
        return mid >> 16, ((mid << 16) | (low & 0xFFFF)) & mask

    c0, c1, c2, c3 = (c.long() & mask for c in counter)
    k0, k1 = key
    for _ in range(rounds):
        (hi0, lo0), (hi1, lo1) = mulhilo(0xD2511F53, c0), mulhilo(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
    return c0, c1, c2, c3


def dropout_keep_reference(seed: int, B: int, H: int, M: int, K: int, threshold: int) -> torch.Tensor:
    """The kernels' documented dropout stream, (B, H, M, K) bool by launch row: element (row m, key j)
    of batch*head ``bh`` keeps when byte ``u = 8 * ((m % 16) // 8) + 2 * ((j % 32) // 8) + j % 2``
    (little-endian over the four words) of Philox4x32-7 at counter
    ``(4 * (j // 32) + (j % 8) // 2, 8 * (m // 16) + m % 8, bh + 2**16 * (seed >> 32 & 0xFFFF),
    seed & 0xFFFFFFFF)``, key 0 (the 48-bit seed rides in the counter), is at least ``threshold``."""
    bh = torch.arange(B * H).view(-1, 1, 1)
    m = torch.arange(M).view(1, -1, 1)
    j = torch.arange(K).view(1, 1, -1)
    call = 4 * (j // 32) + (j % 8) // 2
    row_pair = 8 * (m // 16) + m % 8
    shape = (B * H, M, K)
    words = philox4x32([call.expand(shape), row_pair.expand(shape), (bh + ((seed >> 32) & 0xFFFF) * 2**16).expand(shape),
                        torch.full(shape, seed & 0xFFFFFFFF, dtype=torch.long)], (0, 0), rounds=7)
    u = 8 * ((m % 16) // 8) + 2 * ((j % 32) // 8) + j % 2
    word = torch.stack(words).gather(0, (u // 4).expand(shape).unsqueeze(0))[0]
    byte = (word >> (8 * (u % 4))) & 0xFF
    return (byte >= threshold).view(B, H, M, K)
