"""
Each variant's heads as maps of the input x, which diversity.py (the paper's head diversity) and
convert.py (--init_from) read: the per-head key and value projections of the variants that have them,
else the heads' key maps, else (TPA, whose heads are no linear maps of x) the Gram tensors themselves.

Three tables keyed by variant class, each entry a function of one attention layer, looked up along the
class's MRO (a subclass inherits its parent's) as decode.py's STEPS are:

  HEAD_KV_WEIGHTS   (W_K, W_V), each (H, d_h, d): head h's key is x @ W_K[h].T before the QK norm and
                    RoPE, its value x @ W_V[h].T
  HEAD_KEY_WEIGHTS  (H, d, d_qk): head h's key is x @ W[h] before the QK norm and RoPE; by default
                    HEAD_KV_WEIGHTS' keys, transposed
  HEAD_QK_GRAMS     (pair_products) -> the pair products of the heads' query maps and of their key maps
                    (diversity.pair_products' layout); by default of W_q's maps and HEAD_KEY_WEIGHTS'

A layer that reads another's keys (layout.py) has no key weights: diversity.py leaves it out, and
convert.py converts only the layers that own keys. An entry is optional: a variant in no table
(has_head_maps) gives no maps of x, so it has no effective rank, which train.py and analyze.py say in
its place, and --init_from has nothing to convert from.
"""

import torch

from lib.attention import rivals
from model import GroupedQueryAttention, LowRankKVAttention, MultiHeadLatentAttention


def registered(table, attn):
    """A table keyed by variant class (the three below): its entry for attn's class, else for the nearest
    parent that has one (along the MRO), else None."""
    return next((table[cls] for cls in type(attn).__mro__ if cls in table), None)


def has_head_maps(attn):
    """Whether a table below lists attn's class (or a parent): whether its heads give maps of x."""
    tables = (HEAD_KV_WEIGHTS, HEAD_KEY_WEIGHTS, HEAD_QK_GRAMS)
    return any(registered(table, attn) is not None for table in tables)


def head_kv_weights(attn):
    own = registered(HEAD_KV_WEIGHTS, attn)
    if own is None:
        raise ValueError(f"{type(attn).__name__} gives no per-head key and value projections")
    return own(attn)


def head_key_weights(attn):
    own = registered(HEAD_KEY_WEIGHTS, attn)
    return own(attn) if own is not None else head_kv_weights(attn)[0].mT


def head_qk_grams(attn, pair_products):
    if not has_head_maps(attn):
        raise ValueError(f"{type(attn).__name__}'s heads give no maps of x (no entry in "
                         "lib/attention/heads.py)")
    own = registered(HEAD_QK_GRAMS, attn)
    if own is not None:
        return own(attn)
    Q = attn.W_q.weight.view(attn.n_head, attn.qk_dim, -1).mT  # (H, d, d_qk)
    return pair_products(Q), pair_products(head_key_weights(attn))


def grouped_head_kv_weights(attn):
    """GQA's G heads, each repeated for its H/G query heads (MHA, MQA: G = H, 1)."""
    H, G, d_h = attn.n_head, attn.n_kv_head, attn.head_dim
    return tuple(W.weight.view(G, d_h, -1).repeat_interleave(H // G, dim=0) for W in (attn.W_k, attn.W_v))


def lrkv_head_kv_weights(attn):
    """Every head's W_h = W_shared + U_h B_h^T, keys' and values', transposed: (H, d_h, d) each."""
    H, d_h, r = attn.n_head, attn.head_dim, attn.lrkv_rank
    halves = ((attn.W_shared_k, attn.U_k, attn.B_k), (attn.W_shared_v, attn.U_v, attn.B_v))
    return tuple(W.weight + torch.einsum("hdr,hrc->hdc", B.view(H, d_h, r), U.weight.view(H, r, -1))
                 for W, U, B in halves)


def mla_head_key_weights(attn):
    """(H, d, d_h + d_R): head h's key x @ Wk[h] before the QK norm and RoPE, the latent's norm taken as
    identity. MLA's keys are no per-head projections of x: convert.py has nothing to convert from."""
    W_up_k = attn.W_up_k.weight.view(attn.n_head, attn.head_dim, attn.kv_lora_rank)
    Wk_nope = torch.einsum("cx,hnc->hxn", attn.W_down.weight, W_up_k)
    return torch.cat((Wk_nope, attn.W_kr.weight.t().expand(attn.n_head, -1, -1)), dim=-1)


HEAD_KV_WEIGHTS = {GroupedQueryAttention: grouped_head_kv_weights, LowRankKVAttention: lrkv_head_kv_weights}
HEAD_KEY_WEIGHTS = {MultiHeadLatentAttention: mla_head_key_weights,
                    rivals.GroupedTiedAttention: rivals.gta_head_key_weights,
                    rivals.GroupedLatentAttention: rivals.gla_head_key_weights,
                    rivals.MultiHeadLowRankAttention: rivals.mlra_head_key_weights}
HEAD_QK_GRAMS = {rivals.TensorProductAttention: rivals.tpa_head_qk_grams}
