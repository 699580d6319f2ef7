"""
Head diversity from the weights alone (the paper's section 4), shared by analyze.py, which draws
it from checkpoints, and train.py, which logs it at every evaluation.

Head h of a layer scores key token y against query token x through the bilinear operator
A_h = W_h^Q (W_h^K)^T (d x d), before the QK norm and RoPE. The head-similarity matrix G holds
the cosines of the A_h under the Frobenius inner product, and its effective rank says how many
distinct operators the layer's H heads amount to: 1 if all are the same, H if all are orthogonal.
What it reads of a variant is heads.head_qk_grams (the pair products of W_q's maps and of the
variant's key maps, lib/attention/heads.py); a layer that reads another's keys (--cla, --yoco), with no
keys of its own, is left out, and a variant that no table of heads.py lists has no rank (no_head_maps).
Everything is computed on the CPU in float64.
"""

import math

import numpy as np
import torch

from lib.attention.heads import has_head_maps, head_qk_grams
from lib.attention.layout import key_layers
from model import GPT


def pair_products(W):
    """[i, a, j, b] = (W_i^T W_j)[a, b] for the heads' maps W (H, D, d_qk), float64 (H, d_qk, H, d_qk):
    every pair's products out of one (H d_qk)^2 Gram matrix. In numpy: its W.T @ W computes only half
    of the symmetric product (BLAS syrk), about twice as fast as torch's."""
    H, D, d_qk = W.shape
    W = W.double().numpy().transpose(1, 0, 2).reshape(D, H * d_qk)
    return (W.T @ W).reshape(H, d_qk, H, d_qk)


def head_similarity(Wq, Wk):
    """G[i, j] = <A_i, A_j>_F / (||A_i||_F ||A_j||_F) for A_h = Wq[h] Wk[h]^T, Wq and Wk (H, d, d_qk)."""
    return gram_similarity(pair_products(Wq), pair_products(Wk))


def gram_similarity(Pq, Pk):
    """head_similarity from the pair products of the query and key maps (pair_products' layout).
    Section 4's trace form <A_i, A_j>_F = trace(Wk_i^T Wk_j Wq_j^T Wq_i) is the sum over (a, b) of
    (Wq_i^T Wq_j)[a, b] (Wk_i^T Wk_j)[a, b], so no d x d operator is ever built; and a variant whose
    heads are no linear maps of x (TPA: linear in x (x) x) gives its pair products itself."""
    inner = (np.asarray(Pq, dtype=np.float64) * np.asarray(Pk, dtype=np.float64)).sum((1, 3))
    norms = np.sqrt(inner.diagonal())
    return inner / np.outer(norms, norms)


def effective_rank(G, centered=False):
    """exp(-sum p_i log p_i) over the eigenvalues p_i of G normalised to sum 1 (section 4).
    centered: double-centre G first, as kernel PCA does, so that only how the heads spread
    around their mean operator counts; the centred G has at most H - 1 non-zero eigenvalues."""
    H = len(G)
    if centered:
        G = G - G.mean(0, keepdims=True) - G.mean(1, keepdims=True) + G.mean()
    eigenvalues = np.linalg.eigvalsh(G)
    # G is positive semi-definite with trace H (centred: at most H), so eigenvalues this small
    # are rounding: kept, they would count as directions, and when all heads are identical the
    # centred G is nothing but rounding
    p = eigenvalues[eigenvalues > 1e-9 * H]
    if len(p) == 0:
        # A zero (centred) G: the entropy is undefined, but its rank is 0, and an effective rank
        # lies between 1 and the rank for every other matrix, so 0 it is: no spread at all.
        return 0.0
    p = p / p.sum()
    return math.exp(-(p * np.log(p)).sum())


def no_head_maps(model):
    """One line saying that model's heads give no maps of x, naming its attention class, where no table
    of heads.py lists it (every layer's attention is of one class), else None: what train.py and
    analyze.py say in place of its effective rank."""
    attn = model.blocks[0].attn
    if has_head_maps(attn):
        return None
    return (f"{type(attn).__name__}'s heads give no maps of x (no entry in lib/attention/heads.py), so they "
            "have no effective rank")


@torch.no_grad()
def similarities(model):
    """G of each layer of key_layers, of a GPT whose attention weights are float64 on the CPU
    (analyze.py's checkpoint, or attention_model's copy of a running model's); None where its heads
    give no maps of x (no_head_maps)."""
    if no_head_maps(model):
        return None
    return [gram_similarity(*head_qk_grams(model.blocks[i].attn, pair_products)) for i in key_layers(model)]


def layer_ranks(similarity):
    """{"effective_rank": per layer, "effective_rank_centered": per layer} of similarities' Gs (the
    layers of key_layers), each None where similarities is: what analysis.json and train.py's
    evaluation records hold under these keys."""
    if similarity is None:
        return {"effective_rank": None, "effective_rank_centered": None}
    return {"effective_rank": [effective_rank(G) for G in similarity],
            "effective_rank_centered": [effective_rank(G, centered=True) for G in similarity]}


def attention_model(state_dict, config):
    """A shell of the GPT of config (on the meta device) holding a float64 CPU copy of state_dict's
    attention weights, whole tensors on any device; the rest is never read, so it stays where it is.
    The copy leaves the running model's weights untouched."""
    with torch.device("meta"):
        model = GPT(config)
    model.load_state_dict({k: v.detach().to("cpu", torch.float64) if ".attn." in k else v
                           for k, v in state_dict.items()}, assign=True)
    return model


def weight_ranks(state_dict, config):
    """layer_ranks of the GPT of config holding state_dict (whole tensors, on any device)."""
    return layer_ranks(similarities(attention_model(state_dict, config)))
