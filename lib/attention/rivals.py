"""
The field's strongest rivals of LRKV for a small KV cache, each written through the interface that a
reader uses to add a variant (model.Attention's docstring; model.VARIANTS gives each its --attn name):

    gta   GTA, Grouped-Tied Attention: per group one tied key-value state, plus one shared RoPE key
          (Zadouri, Strauss, Dao, "Hardware-Efficient Attention for Fast Decoding", arXiv 2505.21487)
    gla   GLA, Grouped Latent Attention: MLA's latent split into latent heads, each read by its own
          group of query heads (the same paper)
    tpa   TPA, Tensor Product Attention: queries, keys and values each a sum of rank-R outer products
          of a head factor and a feature factor (Zhang et al., arXiv 2501.06425)
    mlra  MLRA, Multi-Head Low-Rank Attention: MLA's latent split into latent heads, each read by every
          query head, the heads' outputs summed (Liu et al., ICLR 2026, arXiv 2603.02188)

Each class follows model.py's conventions: the backbone's QK norm (parameter-free RMSNorm on every query
and key head) and RoPE, the queries of Attention.queries (TPA: its own factorised ones), no biases,
every parameter a 2-D matrix drawn by GPT.reset_parameters. What diversity.py and convert.py read of
each (its heads as maps of x) is a function beside it, which lib/attention/heads.py lists. Each latent
is normalised by the parameter-free norm, as model.py's MLA normalises its latent (the papers' RMSNorm
weight and their sqrt(d / d_c) scale are absorbed into the next matrix). Each defines keys_values, what
training attends over; under "Decoding", cache_shapes, cache_entries and cached_keys_values; and an
exact single-token step (`<name>_step`, beside its class; lib/attention/decode.py's STEPS lists it),
which reads the compressed cache and builds no cached position's key or value, and equals
decode.reference_step, the plain equation: the class's attend over cached_keys_values. Their knobs
are fields of model.GPTConfig, so flags of train.py.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from lib.attention.ring import masked_softmax
from model import Attention, apply_rope, norm, rms


def sum_of_squares(x):
    """sum over the last dim of x^2, in fp32 at least (as model.rms computes): (..., D) -> (...)."""
    return x.to(torch.promote_types(x.dtype, torch.float32)).pow(2).sum(-1)


def rms_of(sum_sq, width, dtype):
    """model.rms of a vector of `width` dims from its sum of squares: sqrt(mean + eps), eps that of
    the fp32-or-wider dtype rms computes in."""
    return (sum_sq / width + torch.finfo(sum_sq.dtype).eps).sqrt().to(dtype)


# -----------------------------------------------------------------------------
# GTA

class GroupedTiedAttention(Attention):
    """GTA, Grouped-Tied Attention (arXiv 2505.21487, its GTA section and figure; the authors'
    modeling_llama_GTA.py): each of G = config.gta_kv_heads groups of H/G query heads has one tied
    state S_g = x W_g^KV (d_h wide) that serves as the group's value and, in its first d_h/2 dims,
    as the position-free half of its key; the key's RoPE half is one key k^R = x W^KR (d_h/2 wide)
    shared by all heads, as MLA's decoupled RoPE key:

        k_g = [S_g[:d_h/2] | Rot(k^R)]        v_g = S_g        head h reads group g = h G // H

    Queries are MHA's, RoPE on their last d_h/2 dims: q_h = [q_h^nope | Rot(q_h^R)]. With the QK norm
    of this backbone k_g is divided by its RMS, which the cached entries give (gta_step): nothing
    else is cached. Cache per token: G d_h + d_h/2, the paper's tied KV plus its one RoPE key (G d_h
    + d_h/2 = 448 at 128M, 29.2% of MHA; GQA with the same G caches 2 G d_h)."""

    def __init__(self, config, layer):
        super().__init__(config, layer, rope_dim=config.head_dim // 2)
        self.n_kv_head = config.gta_kv_heads
        self.W_kv = nn.Linear(config.n_embd, self.n_kv_head * config.head_dim, bias=False)  # S_g
        self.W_kr = nn.Linear(config.n_embd, self.rope_dim, bias=False)  # k^R

    def keys_values(self, x, rope):
        kv, k_rope = self.tied_state(x), self.rope_key(x, rope)
        return self.keys(kv, k_rope), kv  # the tied state is the value too

    def tied_state(self, x):
        """Every group's S_g: (B, T, d) -> (B, T, G, d_h)."""
        return self.W_kv(x).view(*x.shape[:2], self.n_kv_head, self.head_dim)

    def rope_key(self, x, rope):
        """The rotated k^R: (B, T, d) -> (B, T, 1, d_h/2)."""
        return apply_rope(self.W_kr(x).unsqueeze(2), rope)

    def keys(self, kv, k_rope):
        """Every group's normalised, rotated key [S_g[:d_h/2] | Rot k^R] / rms: (B, S, G, d_h).
        Rotating k^R first leaves the RMS of the concatenation as it is."""
        nope = kv[..., :self.head_dim - self.rope_dim]
        return norm(torch.cat((nope, k_rope.expand(*kv.shape[:3], self.rope_dim)), dim=-1))

    # Decoding: the cache holds S_g and the rotated k^R, no more

    def cache_shapes(self):
        return {"kv": (self.n_kv_head, self.head_dim), "k_rope": (1, self.rope_dim)}

    def cache_entries(self, x, rope):
        return {"kv": self.tied_state(x), "k_rope": self.rope_key(x, rope)}

    def cached_keys_values(self, rope, kv, k_rope):
        return self.keys(kv, k_rope), kv

    @classmethod
    def check(cls, config):
        if config.n_head % config.gta_kv_heads:  # GPTConfig checks each knob's type and sign
            config.reject("gta_kv_heads", f"a divisor of n_head = {config.n_head}")
        if config.head_dim % 4:
            config.reject("head_dim", "a multiple of 4 for gta (RoPE rotates pairs of its last d_h/2 dims)")


def gta_head_key_weights(attn):
    """(H, d, d_h): head h's key before the QK norm and RoPE is x @ Wk[h] = [S_g[:d_h/2] | k^R]."""
    G, d_h, half = attn.n_kv_head, attn.head_dim, attn.head_dim - attn.rope_dim
    W_nope = attn.W_kv.weight.view(G, d_h, -1)[:, :half].repeat_interleave(attn.n_head // G, dim=0)
    W_rope = attn.W_kr.weight.expand(attn.n_head, -1, -1)
    return torch.cat((W_nope, W_rope), dim=1).transpose(1, 2)


def gta_step(attn, q, cached, rope, mask):
    """One new token's attention output (B, 1, H, d_h) over all S cached positions, from the tied
    state as cached. For the normalised, rotated query q_h = [q_h^nope | q_h^R] of a head of group g

        score_{h,s} = ( q_h^nope . S_{g,s}[:d_h/2] + q_h^R . Rot_s k^R_s ) / (rho_{g,s} sqrt(d_h))
        y_h = sum_s softmax_s(score_h)_s S_{g,s}

    rho_{g,s}^2 = (|S_{g,s}[:d_h/2]|^2 + |k^R_s|^2) / d_h (+ eps, as model.rms), from the same rows:
    each cached position is read once, for its key half and its value, as GTA reads its tied state,
    and no key is built. The H/G heads of a group share their group's rows (no copy per head)."""
    kv, k_rope = cached["kv"], cached["k_rope"][:, :, 0]  # (B, S, G, d_h), (B, S, d_h/2)
    B, S, G, d_h = kv.shape
    half = d_h - attn.rope_dim
    q = q[:, 0].view(B, G, attn.n_head // G, d_h)  # (B, G, H/G, d_h): the heads of each group
    scores = torch.einsum("bgjd,bsgd->bgjs", q[..., :half], kv[..., :half])
    scores = scores + torch.einsum("bgjd,bsd->bgjs", q[..., half:], k_rope)
    sum_sq = sum_of_squares(kv[..., :half]) + sum_of_squares(k_rope).unsqueeze(-1)  # (B, S, G)
    rho = rms_of(sum_sq, d_h, q.dtype)
    scores = scores / (rho.permute(0, 2, 1).unsqueeze(2) * math.sqrt(d_h))
    a = masked_softmax(scores, mask, q.dtype)  # (B, G, H/G, S)
    return torch.einsum("bgjs,bsgd->bgjd", a, kv).reshape(B, 1, attn.n_head, d_h)


# -----------------------------------------------------------------------------
# GLA and MLRA: MLA's latent split into latent heads

class LatentHeadsAttention(Attention):
    """What GLA and MLRA share: a latent of n latent heads, c = [c_1 | ... | c_n] = x W_down, each
    latent head c_i (d_c wide) normalised apart (the papers' RMSNorm per latent head), every key and
    value up-projected from one latent head by a (d_c x d_h) matrix of its own, and one decoupled RoPE
    key k^R = x W^KR (d_R wide) shared by all heads, as MLA's. Each q/k head is [d_h position-free
    dims | d_R RoPE dims]. n_up: the up-projections per latent head (W_up^K and W_up^V hold
    n n_up of them); the subclasses say which query heads read which latent head, and how."""

    def __init__(self, config, layer, n_latent, latent_dim, n_up):
        super().__init__(config, layer, qk_dim=config.head_dim + config.rope_head_dim,
                         rope_dim=config.rope_head_dim)
        d, d_h = config.n_embd, config.head_dim
        self.n_latent, self.latent_dim, self.n_up = n_latent, latent_dim, n_up
        self.W_down = nn.Linear(d, n_latent * latent_dim, bias=False)
        # the n n_up up-projections W_up,i,j (d_c -> d_h) stacked: an nn.Linear from d_c, whose init
        # draws them at d_c's fan-in
        self.W_up_k = nn.Linear(latent_dim, n_latent * n_up * d_h, bias=False)
        self.W_up_v = nn.Linear(latent_dim, n_latent * n_up * d_h, bias=False)
        self.W_kr = nn.Linear(d, self.rope_dim, bias=False)

    def latent(self, x):
        """The normalised latent heads c_i: (B, T, d) -> (B, T, n, d_c)."""
        return norm(self.W_down(x).view(*x.shape[:2], self.n_latent, self.latent_dim))

    def up(self, W):
        """W_up's blocks W_up,i,j^T, (n, n_up, d_h, d_c), i the latent head."""
        return W.weight.view(self.n_latent, self.n_up, self.head_dim, self.latent_dim)

    def up_project(self, c, W):
        """c_i W_up,i,j for every latent head i and its n_up projections j: (B, S, n, n_up, d_h)."""
        return torch.einsum("bsic,ijdc->bsijd", c, self.up(W))

    def with_rope_key(self, k_nope, k_rope):
        """[k_nope | Rot k^R] for keys (B, S, ..., d_h) and the rotated k^R (B, S, 1, d_R)."""
        k_rope = k_rope.view(*k_rope.shape[:2], *[1] * (k_nope.dim() - 3), self.rope_dim)
        return torch.cat((k_nope, k_rope.expand(*k_nope.shape[:-1], self.rope_dim)), dim=-1)

    def keys_values(self, x, rope):
        c = self.latent(x)  # (B, T, n, d_c)
        k_rope = apply_rope(self.W_kr(x).unsqueeze(2), rope)  # (B, T, 1, d_R)
        return norm(self.keys(c, k_rope)), self.values(c)

    def attend(self, q, k, v, mask=None):
        # flash attention needs one head dim for q, k and v: v is zero-padded, the zero outputs dropped
        return super().attend(q, k, F.pad(v, (0, self.rope_dim)), mask)[..., :self.head_dim]

    # Decoding: the cache holds the latent heads, the rotated k^R and each key's RMS

    def cache_shapes(self):
        return {"c": (self.n_latent, self.latent_dim), "k_rope": (1, self.rope_dim), "rho": self.rho_shape()}

    def cache_entries(self, x, rope):
        c, k_rope = self.latent(x), apply_rope(self.W_kr(x).unsqueeze(2), rope)  # (B, T, 1, d_R)
        return {"c": c, "k_rope": k_rope, "rho": rms(self.keys(c, k_rope))}  # rho: each new key's RMS

    def cached_keys_values(self, rope, c, k_rope, rho):
        return self.keys(c, k_rope) / rho.unsqueeze(-1), self.values(c)

    @classmethod
    def check(cls, config):  # GPTConfig checks each knob's type and sign
        if not (2 <= config.rope_head_dim <= config.head_dim and config.rope_head_dim % 2 == 0):
            config.reject("rope_head_dim", f"even, from 2 to head_dim = {config.head_dim}")


def split_query(attn, q):
    """The position-free part q_h^nope and the RoPE part q_h^R of one new token's normalised, rotated
    queries q (B, 1, H, d_h + d_R): the steps absorb W_up^K into the first, as decode.py's mla_step."""
    return q[:, 0].split((attn.head_dim, attn.rope_dim), dim=-1)  # (B, H, d_h), (B, H, d_R)


class GroupedLatentAttention(LatentHeadsAttention):
    """GLA, Grouped Latent Attention (arXiv 2505.21487, its GLA section; the authors'
    modeling_llama_GLA.py): MLA's latent split into n_c = config.gla_latent_heads latent heads
    c_j = norm(x W_down,j) of d_c = config.gla_latent_dim each; head h reads only the latent head of
    its group, j = h n_c // H, through its own up-projections:

        k_h = [c_j W_up,h^K | Rot(k^R)]        v_h = c_j W_up,h^V

    GLA-2, the paper's default: two latent heads of 2 d_h, so that the cache matches MLA's at
    d_c = 4 d_h while each latent head can live on its own device under tensor parallelism. Cache per
    token: n_c d_c + d_R (the paper's 2 x 2 d_h + d_h/2 = 4.5 d_h = 576 at 128M, 37.5% of MHA),
    plus every head's key RMS, H numbers, as MLA here caches them (582, 37.9%)."""

    def __init__(self, config, layer):
        n = config.gla_latent_heads
        super().__init__(config, layer, n, config.gla_latent_dim, n_up=config.n_head // n)

    def keys(self, c, k_rope):
        """Every head's key before the QK norm, [c_j W_up,h^K | Rot k^R]: (B, S, H, d_h + d_R)."""
        return self.with_rope_key(self.up_project(c, self.W_up_k).flatten(2, 3), k_rope)

    def values(self, c):
        """Every head's value c_j W_up,h^V: (B, S, H, d_h)."""
        return self.up_project(c, self.W_up_v).flatten(2, 3)

    def rho_shape(self):
        return (self.n_head,)

    @classmethod
    def check(cls, config):
        super().check(config)
        if config.n_head % config.gla_latent_heads:
            config.reject("gla_latent_heads", f"a divisor of n_head = {config.n_head}")


def gla_head_key_weights(attn):
    """(H, d, d_h + d_R): head h's key is x @ Wk[h] before the QK norm and RoPE, the latent norm taken as
    identity (MLA's)."""
    W_down = attn.W_down.weight.view(attn.n_latent, attn.latent_dim, -1)  # (n, d_c, d)
    W_nope = torch.einsum("icx,ijdc->ijxd", W_down, attn.up(attn.W_up_k)).flatten(0, 1)  # (H, d, d_h)
    return torch.cat((W_nope, attn.W_kr.weight.t().expand(attn.n_head, -1, -1)), dim=-1)


def gla_step(attn, q, cached, rope, mask):
    """One new token's attention output (B, 1, H, d_h), exact, from the cached latent heads, RoPE key
    and key RMSs, building no key or value (the paper's GLA decoding: MLA's absorption, per latent
    head). For head h of latent head j, with its normalised, rotated query [q_h^nope | q_h^R],

        score_{h,s} = [ (q_h^nope (W_up,h^K)^T) . c_{j,s} + q_h^R . k^R_s ] / (rho_{h,s} sqrt(d_h + d_R))
        y_h = (sum_s a_{h,s} c_{j,s}) (W_up,h^V)^T

    the heads of a latent head reading its cached rows together, W_up^V applied once, to the
    attended latent."""
    c, k_rope, rho = cached["c"], cached["k_rope"][:, :, 0], cached["rho"]  # (B, S, n, d_c), (B, S, d_R)
    # rho: (B, S, H)
    B, S, n, _ = c.shape
    q_nope, q_rope = split_query(attn, q)
    q_latent = torch.einsum("bijd,ijdc->bijc", q_nope.view(B, n, attn.n_up, -1), attn.up(attn.W_up_k))
    scores = torch.einsum("bijc,bsic->bijs", q_latent, c).flatten(1, 2)  # (B, H, S)
    scores = scores + q_rope @ k_rope.transpose(1, 2)
    a = masked_softmax(scores / (rho.transpose(1, 2) * math.sqrt(attn.qk_dim)), mask, q.dtype)
    attended = torch.einsum("bijs,bsic->bijc", a.view(B, n, attn.n_up, S), c)  # (B, n, H/n, d_c)
    return torch.einsum("bijc,ijdc->bijd", attended, attn.up(attn.W_up_v)).reshape(B, 1, attn.n_head, -1)


class MultiHeadLowRankAttention(LatentHeadsAttention):
    """MLRA, Multi-Head Low-Rank Attention (Liu et al., ICLR 2026, arXiv 2603.02188, its method
    section; the authors' model/mlra_4.py): MLA's latent split into n = config.mlra_latent_heads latent heads
    c_i = norm(x W_down,i) of d_c = config.mlra_latent_dim each, and every query head attends to each
    of them apart, through up-projections of its own, the n results summed:

        k_{i,h} = [c_i W_up,i,h^K | Rot(k^R)]        v_{i,h} = c_i W_up,i,h^V
        o_h = (1 / sqrt(n)) sum_i softmax(q_h k_{i,h}^T / sqrt(d_h + d_R)) V_{i,h}

    a softmax per latent head and query head; 1/sqrt(n) the authors' output scale. MLRA-4, the
    paper's default: four latent heads of d_h (MLA's d_c = 4 d_h in four), which 4-way tensor
    parallelism shards one a device. Cache per token: n d_c + d_R (the paper's 4 d_h + d_h/2 = 4.5 d_h
    = 576 at 128M, 37.5% of MHA, 1.5 d_h a device at 4-way TP), plus the RMS of every key, n H
    numbers (one per latent head and query head, as MLA here caches H): 600, 39.1%."""

    def __init__(self, config, layer):
        super().__init__(config, layer, config.mlra_latent_heads, config.mlra_latent_dim, n_up=config.n_head)

    def keys(self, c, k_rope):
        """Every (latent head, query head)'s key before the QK norm: (B, S, n, H, d_h + d_R)."""
        return self.with_rope_key(self.up_project(c, self.W_up_k), k_rope)

    def values(self, c):
        """Every (latent head, query head)'s value c_i W_up,i,h^V: (B, S, n, H, d_h)."""
        return self.up_project(c, self.W_up_v)

    def attend(self, q, k, v, mask=None):
        # k (B, S, n, H, d_qk), v (B, S, n, H, d_h): the n latent heads' attentions as n H heads of one
        # causal attention, (i, h) at i H + h, each query head repeated for its n latent heads; then
        # o_h, their sum over i
        B, S, n, H, _ = k.shape
        y = super().attend(q.repeat(1, 1, n, 1), k.flatten(2, 3), v.flatten(2, 3), mask)  # (B, T, n H, d_h)
        return y.view(B, q.size(1), n, H, self.head_dim).sum(2) / math.sqrt(n)

    def rho_shape(self):
        return (self.n_latent, self.n_head)

    def attention_macs(self, seq_len):  # q k^T and a v once per latent head (lib/training/recipe.py)
        return self.n_latent * self.n_head * (self.qk_dim + self.head_dim) * seq_len


def mlra_head_key_weights(attn):
    """(H, d, d_h + d_R): the sum over the latent heads of head h's key weights, the latent norms taken
    as identity. Head h scores with n bilinear operators A_{i,h} = W_h^Q (W_{i,h}^K)^T, one per latent
    head, each in its own softmax: diversity.py's one operator per head is their sum
    sum_i A_{i,h} = W_h^Q (sum_i W_{i,h}^K)^T, whose RoPE part is n W^KR."""
    W_down = attn.W_down.weight.view(attn.n_latent, attn.latent_dim, -1)  # (n, d_c, d)
    W_nope = torch.einsum("icx,ihdc->hxd", W_down, attn.up(attn.W_up_k))  # (H, d, d_h)
    W_rope = attn.n_latent * attn.W_kr.weight.t().expand(attn.n_head, -1, -1)
    return torch.cat((W_nope, W_rope), dim=-1)


def mlra_step(attn, q, cached, rope, mask):
    """One new token's attention output (B, 1, H, d_h), exact, from the cached latent heads, RoPE key
    and key RMSs, building no key or value (the paper's MLA-style decoding, per latent head):
    for each latent head i and query head h

        score_{i,h,s} = [ (q_h^nope (W_up,i,h^K)^T) . c_{i,s} + q_h^R . k^R_s ]
                        / (rho_{i,h,s} sqrt(d_h + d_R))
        o_h = (1 / sqrt(n)) sum_i (sum_s a_{i,h,s} c_{i,s}) (W_up,i,h^V)^T"""
    c, k_rope, rho = cached["c"], cached["k_rope"][:, :, 0], cached["rho"]  # (B, S, n, d_c), (B, S, d_R)
    # rho: (B, S, n, H)
    q_nope, q_rope = split_query(attn, q)
    q_latent = torch.einsum("bhd,ihdc->bihc", q_nope, attn.up(attn.W_up_k))  # (B, n, H, d_c)
    scores = torch.einsum("bihc,bsic->bihs", q_latent, c) + (q_rope @ k_rope.transpose(1, 2)).unsqueeze(1)
    a = masked_softmax(scores / (rho.permute(0, 2, 3, 1) * math.sqrt(attn.qk_dim)), mask, q.dtype)
    attended = torch.einsum("bihs,bsic->bihc", a, c)  # (B, n, H, d_c)
    y = torch.einsum("bihc,ihdc->bhd", attended, attn.up(attn.W_up_v)) / math.sqrt(attn.n_latent)
    return y.unsqueeze(1)


# -----------------------------------------------------------------------------
# TPA

class TensorProductAttention(Attention):
    """TPA, Tensor Product Attention (Zhang et al., arXiv 2501.06425, section 3): each token's queries,
    keys and values, (H, d_h) each, are sums of R outer products of a head factor a_r(x) (H) and a
    feature factor b_r(x) (d_h), both linear in the token, RoPE on the feature factor:

        Q_t = (1/R_Q) sum_r a_r^Q(x_t) (x) Rot_t b_r^Q(x_t)     a_r^Q(x) = x W_r^{aQ}, b_r^Q(x) = x W_r^{bQ}
        K_t = (1/R_K) sum_r a_r^K(x_t) (x) Rot_t b_r^K(x_t)
        V_t = (1/R_V) sum_r a_r^V(x_t) (x) b_r^V(x_t)

    (the authors' 1/R scales; RoPE on b commutes with the sum, Rot being linear and the same for every
    r). R_Q = config.tpa_q_rank, R_K = R_V = config.tpa_kv_rank: the paper's default TPA, R_Q = 6,
    R_K = R_V = 2. The queries replace W_q: TPA has no query projection W_q of H full-rank heads (the
    one place it steps outside Attention's "H full-rank query heads"). The QK norm normalises every
    head's q_h and k_h, as for every variant here. Cache per token: the key and value factors,
    (R_K + R_V)(H + d_h) (section 3's KV caching; 536 at 128M, 34.9% of MHA); the keys' RMS comes
    from the factors (tpa_step)."""

    def __init__(self, config, layer):
        super().__init__(config, layer)
        del self.W_q  # the queries are factorised too
        d, H, d_h = config.n_embd, config.n_head, config.head_dim
        self.q_rank, self.kv_rank = config.tpa_q_rank, config.tpa_kv_rank
        self.W_aq = nn.Linear(d, self.q_rank * H, bias=False)  # a_r^Q, r-major: (R_Q, H)
        self.W_bq = nn.Linear(d, self.q_rank * d_h, bias=False)  # b_r^Q: (R_Q, d_h)
        self.W_ak = nn.Linear(d, self.kv_rank * H, bias=False)
        self.W_bk = nn.Linear(d, self.kv_rank * d_h, bias=False)
        self.W_av = nn.Linear(d, self.kv_rank * H, bias=False)
        self.W_bv = nn.Linear(d, self.kv_rank * d_h, bias=False)

    def factors(self, x, W_a, W_b):
        """A token's head factors (B, T, R, H) and feature factors (B, T, R, d_h)."""
        B, T, _ = x.shape
        return W_a(x).view(B, T, -1, self.n_head), W_b(x).view(B, T, -1, self.head_dim)

    @staticmethod
    def product(a, b):
        """(1/R) sum_r a_r (x) b_r: head factors (B, S, R, H), feature factors (B, S, R, d_h) ->
        (B, S, H, d_h)."""
        return torch.einsum("bsrh,bsrd->bshd", a, b) / a.size(2)

    query_weights = ("W_aq", "W_bq")

    def queries(self, x, rope):
        return apply_rope(norm(self.product(*self.factors(x, self.W_aq, self.W_bq))), rope)  # (B, T, H, d_h)

    def keys_values(self, x, rope):
        a_k, b_k = self.factors(x, self.W_ak, self.W_bk)
        a_v, b_v = self.factors(x, self.W_av, self.W_bv)
        return self.keys(a_k, apply_rope(b_k, rope)), self.product(a_v, b_v)

    def keys(self, a_k, b_k):
        """Every head's normalised, rotated key from the factors, b^K rotated: (B, S, H, d_h)."""
        return norm(self.product(a_k, b_k))

    # Decoding: the cache holds the key factors, b^K rotated, and the value factors

    def cache_shapes(self):
        R, H, d_h = self.kv_rank, self.n_head, self.head_dim
        return {"a_k": (R, H), "b_k": (R, d_h), "a_v": (R, H), "b_v": (R, d_h)}

    def cache_entries(self, x, rope):
        a_k, b_k = self.factors(x, self.W_ak, self.W_bk)
        a_v, b_v = self.factors(x, self.W_av, self.W_bv)
        return {"a_k": a_k, "b_k": apply_rope(b_k, rope), "a_v": a_v, "b_v": b_v}

    def cached_keys_values(self, rope, a_k, b_k, a_v, b_v):
        return self.keys(a_k, b_k), self.product(a_v, b_v)


def tpa_head_qk_grams(attn):
    """diversity.py's pair products of the heads' query and key maps, (H, d_h, H, d_h) each, without
    pair_products, which takes linear maps of x stacked, and TPA's heads are none. A TPA
    head's q_h(x) = (1/R) sum_r (x . alpha_{r,h}) (x B_r) is no linear map of x (alpha_{r,h} the
    row of W_r^{aQ} for head h, B_r = W_r^{bQ} (d x d_h)): it is linear in x (x) x, as
    q_h = (x (x) x) M_h with M_h the symmetric (d^2 x d_h) lift, M_h[(i,j)] = (1/2R) sum_r
    (alpha_{r,h}[i] B_r[j] + alpha_{r,h}[j] B_r[i]), and a head's score q_h(x) . k_h(y) is the
    bilinear form M_h N_h^T between x (x) x and y (x) y: its operator A_h. The pair products
    M_h^T M_h' that diversity.head_similarity takes come without any d^2-sized matrix:

        M_h^T M_h' = (1/2R^2) sum_{r,r'} [ (alpha_{r,h} . alpha_{r',h'}) B_r^T B_{r'}
                                           + (B_r^T alpha_{r',h'}) (B_{r'}^T alpha_{r,h})^T ]"""
    return lifted_gram(attn, attn.W_aq, attn.W_bq), lifted_gram(attn, attn.W_ak, attn.W_bk)


def lifted_gram(attn, W_a, W_b):
    H, d_h = attn.n_head, attn.head_dim
    alpha = W_a.weight.double().view(-1, H, W_a.in_features)  # (R, H, d)
    B = W_b.weight.double().view(-1, d_h, W_b.in_features)  # (R, d_h, d): B_r^T
    R = alpha.size(0)
    aa = torch.einsum("rhx,sgx->rhsg", alpha, alpha)  # alpha_{r,h} . alpha_{s,g}
    bb = torch.einsum("rax,sbx->rasb", B, B)  # (B_r^T B_s)[a, b]
    ba = torch.einsum("rax,sgx->rasg", B, alpha)  # (B_r^T alpha_{s,g})[a]
    gram = torch.einsum("rhsg,rasb->hagb", aa, bb) + torch.einsum("rasg,sbrh->hagb", ba, ba)
    return gram / (2 * R * R)  # float64, as diversity.py computes


def tpa_step(attn, q, cached, rope, mask):
    """One new token's attention output (B, 1, H, d_h) over all S cached positions, from the cached
    factors alone (section 3's KV caching): for the normalised, rotated query q_h

        q_h . K_{s,h} = (1/R_K) sum_r a^K_{r,s}[h] (q_h . Rot_s b^K_{r,s})

    and the RMS of K_{s,h}, which the QK norm divides it by, from the factors' Gram matrix,
    |K_{s,h}|^2 = (1/R_K^2) sum_{r,r'} a^K_{r,s}[h] a^K_{r',s}[h] (b^K_{r,s} . b^K_{r',s}) (RoPE keeps
    dot products at one position); the output likewise, y_h = (1/R_V) sum_r (sum_s a_{h,s} a^V_{r,s}[h])
    b^V_{r,s}. Per position it reads the R_K + R_V factor pairs and builds no key or value."""
    a_k, b_k, a_v, b_v = cached["a_k"], cached["b_k"], cached["a_v"], cached["b_v"]  # (B, S, R, H | d_h)
    R, d_h = a_k.size(2), attn.head_dim
    qb = torch.einsum("bhd,bsrd->bhsr", q[:, 0], b_k)  # q_h . Rot_s b^K_{r,s}
    dots = torch.einsum("bhsr,bsrh->bhs", qb, a_k) / R
    hi = torch.promote_types(b_k.dtype, torch.float32)  # the RMS in fp32 at least, as model.rms
    gram = torch.einsum("bsrd,bstd->bsrt", b_k.to(hi), b_k.to(hi))  # (B, S, R, R)
    sum_sq = torch.einsum("bsrh,bsrt,bsth->bsh", a_k.to(hi), gram, a_k.to(hi)) / (R * R)  # |K_{s,h}|^2
    rho = rms_of(sum_sq, d_h, q.dtype)  # (B, S, H)
    a = masked_softmax(dots / (rho.transpose(1, 2) * math.sqrt(d_h)), mask, q.dtype)  # (B, H, S)
    weights = a.unsqueeze(-1) * a_v.permute(0, 3, 1, 2)  # (B, H, S, R): a_{h,s} a^V_{r,s}[h]
    return (torch.einsum("bhsr,bsrd->bhd", weights, b_v) / a_v.size(2)).unsqueeze(1)
