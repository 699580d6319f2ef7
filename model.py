"""
One GPT, five ways to attend: MHA, GQA, MQA, MLA and LRKV (Low-Rank Key-Value attention), on the
paper's 128M backbone (nanochat's): RoPE, parameter-free RMSNorm before every sublayer and on
queries and keys, a ReLU^2 MLP, untied embeddings, no biases. The variants differ in their keys
and values (and MLA in its query heads' width); README's notation names the symbols.

Read top-down: the config; norm and RoPE; Attention, what every variant shares; the five variants,
each a class whose docstring is its math and whose keys_values is what training computes; GPT; and
last KVCache, the decoding memory of the whole model. A class's decoding methods (cache_shapes, and
where it caches something else than its keys and values, cache_entries and cached_keys_values, under
a "Decoding" comment) say what it caches and how keys and values come back: skip them on a first read.
lib/decode.py has the exact single-token steps; lib/variants.py maps each --attn name to its class.
"""

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 2048
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 128 for fast matmuls
    n_layer: int = 12
    n_head: int = 6  # H
    n_embd: int = 768  # d
    head_dim: int = 128  # d_h
    attn: str = "mha"  # the attention variant, a name of lib/variants.py's ATTENTION
    # cross-layer attention (CLA): in each group of cla layers only the first computes keys and values
    cla: int = 1
    n_kv_head: int = 3  # gqa: key/value heads G, each shared by n_head // G query heads
    kv_lora_rank: int = 128  # mla: width d_c of the cached latent
    rope_head_dim: int = 64  # mla: width d_R of the decoupled RoPE key shared by all heads
    lrkv_rank: int = 46  # lrkv: rank r of each head's residual U_h B_h^T
    rope_theta: float = 10000.0

    def __post_init__(self):
        variants = attention_classes()
        if self.attn not in variants:
            self.reject("attn", "one of " + ", ".join(variants))
        for field in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "head_dim", "cla"):
            if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
                self.reject(field, "a positive integer")
        if self.n_layer % self.cla:
            self.reject("cla", f"a divisor of n_layer = {self.n_layer} (layers share in groups of cla)")
        if self.head_dim % 2:
            self.reject("head_dim", "even (RoPE rotates pairs of dimensions)")
        if not 1 < self.rope_theta < math.inf:  # NaN fails too
            self.reject("rope_theta", "a finite number > 1 (RoPE's frequencies theta^(-2i/d) fall from 1)")
        if self.n_embd != self.n_head * self.head_dim:
            self.reject("n_embd", f"n_head * head_dim = {self.n_head} * {self.head_dim}")
        variants[self.attn].check(self)

    def reject(self, field, allowed):
        raise ValueError(f"--{field}={getattr(self, field)!r}: must be {allowed}")


def attention_classes():
    """Every variant by the name --attn takes: lib/variants.py's ATTENTION, which lists this file's
    five and lib/rivals.py's four. Imported when first asked for, not at the top: it imports this file."""
    from lib.variants import ATTENTION
    return ATTENTION


def registered(table, attn):
    """A table keyed by variant class (lib/decode.py's steps, lib/convert.py's conversions): its entry
    for attn's class, else for the nearest parent that has one (along the MRO), else None."""
    return next((table[cls] for cls in type(attn).__mro__ if cls in table), None)


def norm(x):
    """x / rms(x): parameter-free RMSNorm over the last dim."""
    return F.rms_norm(x, (x.size(-1),))


def rms(x):
    """The RMS that norm divides by, sqrt(mean(x^2) + eps), (...,) for x (..., D), returned in x's
    dtype. As F.rms_norm does, it computes in fp32 with fp32's eps even for bf16 x (bf16's eps would
    swamp small keys), so a cached RMS is exactly the divisor that training's norm uses."""
    x_hi = x.to(torch.promote_types(x.dtype, torch.float32))
    return x_hi.pow(2).mean(-1).add(torch.finfo(x_hi.dtype).eps).sqrt().to(x.dtype)


def rope_table(dim, max_len, theta):
    """(max_len, dim): row s is [cos(s theta_i) | sin(s theta_i)], for the dim / 2 frequencies theta_i."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x, rope):
    """RoPE: rotate the last rope.size(-1) dims of x (B, T, heads, D), each token by its position's
    row of rope (T, rope_dim), the RoPE table's rows of x's T positions. A row is [cos | sin], half =
    rope.size(-1) / 2 wide each, so dims i and i + half turn together by the angle s theta_i:
    (x_i, x_{i+half}) -> (x_i cos + x_{i+half} sin, x_{i+half} cos - x_i sin), a turn by -s theta_i
    (either direction is RoPE: only the difference of two positions reaches a score). The first
    D - rope.size(-1) dims pass unrotated."""
    cos, sin = rope[:, None, :].to(x.dtype).chunk(2, dim=-1)  # (T, 1, half) each
    x_pass, x1, x2 = x.split((x.size(-1) - 2 * cos.size(-1), cos.size(-1), cos.size(-1)), dim=-1)
    return torch.cat((x_pass, x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


# The attention variants

class Attention(nn.Module):
    """What every variant shares: H query heads q_h = Rot(norm(x W_h^Q)), causal softmax attention
    over the variant's keys and values, and the output projection W_o. A variant defines
    keys_values(x, rope), the keys and values of the tokens x: G key/value heads, G = H where every
    head has its own (MHA, LRKV, MLA); and for decoding cache_shapes(), with cache_entries and
    cached_keys_values where it caches something else than its keys and values (README: Adding a
    variant). Every parameter is a matrix (Muon's).

    Cross-layer attention (CLA): in a group of config.cla layers the later ones keep only their
    queries and W_o and attend with the first layer's keys and values. In training the first layer
    hands them up (forward returns them; Block and GPT.forward pass them on as kv); in decoding the
    cache holds them, and KVCache.attend reads the first layer's entries (kv_layer's) through the
    attention that wrote them, whose weights rebuild the keys and values."""

    query_weights = ("W_q",)  # what makes the queries: a layer that shares keys keeps them

    def __init__(self, config, layer, qk_dim=None, rope_dim=None):
        super().__init__()
        self.layer, self.n_head, self.head_dim = layer, config.n_head, config.head_dim
        self.qk_dim = qk_dim or config.head_dim  # d_qk: a query or key head's width
        self.rope_dim = rope_dim or config.head_dim  # RoPE turns a query's and a key's last rope_dim dims
        self.kv_layer = layer - layer % config.cla  # the layer whose keys and values this one reads
        self.W_q = nn.Linear(config.n_embd, config.n_head * self.qk_dim, bias=False)
        self.W_o = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)

    def forward(self, x, rope, kv=None):
        """Training: each token of x (B, T, d) attends to itself and the tokens before it, at rope's
        positions. Returns W_o of the heads' outputs, and the keys and values attended over, which a
        later layer of a CLA group gets as kv (and attends with, computing only its queries)."""
        q = self.queries(x, rope)  # (B, T, H, d_qk)
        k, v = self.keys_values(x, rope) if self.owns_kv else kv
        return self.W_o(self.attend(q, k, v).flatten(2)), (k, v)

    def queries(self, x, rope):
        B, T, _ = x.shape
        return apply_rope(norm(self.W_q(x).view(B, T, self.n_head, self.qk_dim)), rope)  # (B, T, H, d_qk)

    def attend(self, q, k, v):
        """softmax(q k^T / sqrt(d_qk)) v, causal: q (B, T, H, d_qk) the last T of the S positions of
        k (B, S, G, d_qk) and v (B, S, G, d_v), query head h reading key/value head h G // H."""
        T, S = q.size(1), k.size(1)
        mask = None
        if T not in (1, S):  # a chunk after a cached prefix sees all of it
            mask = torch.arange(S, device=q.device) <= torch.arange(S - T, S, device=q.device)[:, None]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        gqa = k.size(1) != q.size(1)  # SDPA reads each of G key/value heads for H/G query heads
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                           enable_gqa=gqa)
        return y.transpose(1, 2)  # (B, T, H, d_v)

    @classmethod
    def check(cls, config: "GPTConfig") -> None:
        """Reject (config.reject) a knob of the variant's own that it cannot be built with."""

    def reset_parameters(self) -> None:
        """Zero W_o (the block starts as the identity); a variant draws its others after super()."""
        nn.init.zeros_(self.W_o.weight)

    def attention_macs(self, seq_len: int) -> int:
        """Multiply-adds per token, forward, of q k^T and a v over seq_len keys, all heads."""
        return self.n_head * (self.qk_dim + self.head_dim) * seq_len

    # Cross-layer attention (CLA): a layer that reads another's keys and values

    @property
    def owns_kv(self):
        """False in the later layers of a CLA group, which hold no key or value weights."""
        return self.kv_layer == self.layer

    def drop_keys_values(self):
        """Keep the queries' weights and W_o alone: this layer attends with kv_layer's keys and values."""
        for name, _ in [*self.named_children(), *self.named_parameters(recurse=False)]:
            if name not in (*self.query_weights, "W_o"):
                delattr(self, name)

    # Decoding: what a token leaves in the cache, and every position's keys and values from it

    def decode(self, x, rope, cache):
        """x's T new tokens (B, T, d) after the cache's prefix attend to every cached position and to
        one another: the layer writes their cache entries (if it owns its keys), then the cache attends
        (KVCache.attend rebuilds keys and values as training's; lib/decode.py's caches run exact steps)."""
        q = self.queries(x, rope)
        if self.owns_kv:
            cache.write(self, self.cache_entries(x, rope))
        return self.W_o(cache.attend(self, q).flatten(2))

    def cache_shapes(self):
        """{name: shape}: what one token leaves in the cache, by entry."""
        raise NotImplementedError(f"{type(self).__name__} defines no cache_shapes()")

    def cache_entries(self, x, rope):
        """The new tokens' entries {name: (B, T, *shape)}. By default their keys and values themselves."""
        k, v = self.keys_values(x, rope)
        return {"k": k, "v": v}

    def cached_keys_values(self, rope, **cached):
        """Every cached position's keys and values, as keys_values gives them, from the entries
        {name: (B, S, *shape)} and rope (S, rope_dim), their RoPE rows. By default the cached k and v."""
        return cached["k"], cached["v"]

    # What lib/diversity.py (the effective rank) and lib/convert.py (--init_from) read of the weights

    def head_kv_weights(self):
        """(W_K, W_V), each (H, d_h, d): head h's key is x @ W_K[h].T before the QK norm and RoPE, and
        its value x @ W_V[h].T, where a variant's keys and values are per-head projections of x."""
        raise ValueError(f"{type(self).__name__} gives no per-head key and value projections")

    def head_key_weights(self):
        """(H, d, d_qk): head h's key is x @ W[h] before the QK norm and RoPE. By default head_kv_weights'."""
        return self.head_kv_weights()[0].mT

    def head_qk_grams(self, pair_products):
        """All that the effective rank needs of the heads: [i, a, j, b] = (Q_i^T Q_j)[a, b] and the same
        of the keys, (H, d_qk, H, d_qk) each, for head h's query and key maps Q_h, K_h (d, d_qk), x @ Q_h
        and x @ K_h before the QK norm and RoPE, from W_q and head_key_weights, by pair_products
        (lib/diversity.py's) of maps stacked (H, d, d_qk)."""
        Q = self.W_q.weight.view(self.n_head, self.qk_dim, -1).mT  # (H, d, d_qk)
        return pair_products(Q), pair_products(self.head_key_weights())


class GroupedQueryAttention(Attention):
    """GQA: G = config.n_kv_head key/value heads K_g = X W_g^K, V_g = X W_g^V, query head h reading
    g = h G // H; MHA (G = H) and MQA (G = 1) change kv_heads alone. The cache holds the keys and
    values as they are, 2 G d_h numbers per token and layer."""

    def __init__(self, config, layer):
        super().__init__(config, layer)
        self.n_kv_head = self.kv_heads(config)
        self.W_k = nn.Linear(config.n_embd, self.n_kv_head * config.head_dim, bias=False)
        self.W_v = nn.Linear(config.n_embd, self.n_kv_head * config.head_dim, bias=False)

    @staticmethod
    def kv_heads(config):
        return config.n_kv_head  # G

    @classmethod
    def check(cls, config):
        G = cls.kv_heads(config)  # MHA's and MQA's G never fail: only GQA reads n_kv_head
        if not (1 <= G <= config.n_head and config.n_head % G == 0):
            config.reject("n_kv_head", f"a divisor of n_head = {config.n_head}")

    def keys_values(self, x, rope):
        B, T, _ = x.shape
        k = apply_rope(norm(self.W_k(x).view(B, T, self.n_kv_head, self.head_dim)), rope)  # (B, T, G, d_h)
        return k, self.W_v(x).view(B, T, self.n_kv_head, self.head_dim)

    def cache_shapes(self):
        return {"k": (self.n_kv_head, self.head_dim), "v": (self.n_kv_head, self.head_dim)}

    def head_kv_weights(self):
        H, G, d_h = self.n_head, self.n_kv_head, self.head_dim
        return tuple(W.weight.view(G, d_h, -1).repeat_interleave(H // G, dim=0) for W in (self.W_k, self.W_v))


class MultiHeadAttention(GroupedQueryAttention):
    """Standard MHA: every query head has a key/value head of its own (G = H)."""

    @staticmethod
    def kv_heads(config):
        return config.n_head


class MultiQueryAttention(GroupedQueryAttention):
    """MQA: one key/value head shared by all query heads (G = 1)."""

    @staticmethod
    def kv_heads(config):
        return 1


class LowRankKVAttention(Attention):
    """LRKV: every head's key and value projections are one matrix shared by all heads plus a
    rank-r residual of the head's own,

        W_h^K = W_shared^K + U_h^K (B_h^K)^T        W_h^V = W_shared^V + U_h^V (B_h^V)^T

    W_shared (d, d_h), U_h (d, r), B_h (d_h, r), so that for the inputs X (T, d)

        K_h = X W_shared^K + (X U_h^K)(B_h^K)^T = K_shared + R_h^K (B_h^K)^T

    and V_h likewise. Training builds every K_h and V_h and attends as MHA does, each key
    normalised and rotated as every key here is, k_h = Rot(norm(K_h)). 1 <= r <= d_h: r = d_h gives
    every head MHA's capacity, and with no residual (U_h B_h^T = 0) it is MQA. In the weights:
    W_shared_k.weight is (W_shared^K)^T and U_k.weight the (U_h^K)^T stacked, (H r, d), as nn.Linear
    keeps the transpose; B_k is a plain parameter, the B_h^K stacked as they are, (H d_h, r)."""

    def __init__(self, config, layer):
        super().__init__(config, layer)
        d, H, d_h, r = config.n_embd, config.n_head, config.head_dim, config.lrkv_rank
        self.lrkv_rank = r
        self.W_shared_k = nn.Linear(d, d_h, bias=False)
        self.W_shared_v = nn.Linear(d, d_h, bias=False)
        self.U_k = nn.Linear(d, H * r, bias=False)
        self.U_v = nn.Linear(d, H * r, bias=False)
        self.B_k = nn.Parameter(torch.empty(H * d_h, r))
        self.B_v = nn.Parameter(torch.empty(H * d_h, r))

    @classmethod
    def check(cls, config):
        if not 1 <= config.lrkv_rank <= config.head_dim:
            config.reject("lrkv_rank", f"between 1 and head_dim = {config.head_dim}")

    def reset_parameters(self):
        # W_shared, U_h entries of variance 1/d, B_h of std 0.1/sqrt(r): the paper's starting residual
        # ||U_h B_h^T||_F ~ sqrt(d d_h r) / sqrt(d) * 0.1/sqrt(r) = 0.1 sqrt(d_h) ~ 0.1 ||W_shared||_F
        super().reset_parameters()
        for factor in self.parameters(recurse=False):  # B_k, B_v: the only parameters outside an nn.Linear
            nn.init.normal_(factor, std=0.1 / math.sqrt(self.lrkv_rank))

    def keys_values(self, x, rope):
        k_shared, v_shared = self.W_shared_k(x), self.W_shared_v(x)  # (B, T, d_h): X W_shared
        r_k, r_v = self.residual_coords(self.U_k, x), self.residual_coords(self.U_v, x)  # (B, T, H, r): X U_h
        k = k_shared.unsqueeze(2) + self.residual(r_k, self.B_k)  # (B, T, H, d_h): K_h
        return apply_rope(norm(k), rope), self.values(v_shared, r_v)

    def residual_coords(self, U, x):
        """R_h = X U_h of every head, U being U_k or U_v: each token's r coordinates of head h's
        residual in the basis B_h, (B, T, d) -> (B, T, H, r)."""
        return U(x).view(*x.shape[:2], -1, self.lrkv_rank)

    def residual(self, R, factor):
        """Every head's residual R_h B_h^T, factor being B_k or B_v: (B, S, H, r) -> (B, S, H, d_h)."""
        return torch.einsum("bshr,hdr->bshd", R, factor.view(self.n_head, self.head_dim, self.lrkv_rank))

    def values(self, v_shared, r_v):
        """Every head's V_h = V_shared + R_h^V (B_h^V)^T: (B, S, d_h), (B, S, H, r) -> (B, S, H, d_h)."""
        return v_shared.unsqueeze(2) + self.residual(r_v, self.B_v)

    def head_kv_weights(self):
        """Every head's W_h = W_shared + U_h B_h^T, keys' and values', transposed: (H, d_h, d) each."""
        H, d_h, r = self.n_head, self.head_dim, self.lrkv_rank
        halves = ((self.W_shared_k, self.U_k, self.B_k), (self.W_shared_v, self.U_v, self.B_v))
        return tuple(W.weight + torch.einsum("hdr,hrc->hdc", B.view(H, d_h, r), U.weight.view(H, r, -1))
                     for W, U, B in halves)

    # Decoding. The cache holds K_shared rotated (Rot_s K_shared is the same for every head), V_shared,
    # and every R_h^K and R_h^V unrotated (RoPE turns d_h dims, R_h^K has r): the paper's 2 d_h + 2 H r
    # numbers per token. It also holds each head's key RMS rho_h (+0.7% at 128M): the norm divides a
    # whole key by one number, so Rot_s(norm(K_h)) = (Rot_s K_shared + Rot_s(R_h^K (B_h^K)^T)) / rho_h.
    # The plain cached path could recompute rho_h from the K_h it rebuilds; decode.py's step builds
    # none. From these parts it computes a new token's scores (the paper's eq. 6, made exact under
    # RoPE) and its output a_h V_h = a_h V_shared + (a_h R_h^V)(B_h^V)^T (eq. 7).

    def cache_shapes(self):
        H, d_h, r = self.n_head, self.head_dim, self.lrkv_rank
        return {"k_shared": (d_h,), "r_k": (H, r), "rho": (H,), "v_shared": (d_h,), "r_v": (H, r)}

    def cache_entries(self, x, rope):
        k_shared, r_k, k = self.key_parts(x)  # rho: the RMS of K_h that the QK norm divides by
        return {"k_shared": apply_rope(k_shared.unsqueeze(2), rope).squeeze(2), "r_k": r_k, "rho": rms(k),
                "v_shared": self.W_shared_v(x), "r_v": self.residual_coords(self.U_v, x)}

    def key_parts(self, x):
        """K_shared (B, T, d_h), R^K (B, T, H, r) and every head's K_h (B, T, H, d_h), before the QK norm."""
        k_shared, r_k = self.W_shared_k(x), self.residual_coords(self.U_k, x)
        return k_shared, r_k, k_shared.unsqueeze(2) + self.residual(r_k, self.B_k)

    def cached_keys_values(self, rope, k_shared, r_k, rho, v_shared, r_v):
        return self.keys(k_shared, r_k, rho, rope), self.values(v_shared, r_v)

    def keys(self, k_shared, r_k, rho, rope):
        """Every head's normalised, rotated key at the S cached positions, as training's: (B, S, H, d_h)."""
        residual = apply_rope(self.residual(r_k, self.B_k), rope)  # (B, S, H, d_h)
        return (k_shared.unsqueeze(2) + residual) / rho.unsqueeze(-1)


class MultiHeadLatentAttention(Attention):
    """MLA as DeepSeek-V2: keys and values come up per head, through W_up, from a normalised latent
    c = norm(x W_down) of width d_c; one decoupled RoPE key k_R = x W_kr of width d_R, shared by all
    heads, carries position:

        k_h = norm([c W_up,h^K | Rot(k_R)])        v_h = c W_up,h^V

    so that q/k heads are d_h + d_R wide: a query head is likewise [q_h^nope | q_h^R], RoPE turning
    its last d_R dims (rope_dim). The QK norm takes the whole concatenation, so a key's RMS is per
    head though k_R is shared."""

    def __init__(self, config, layer):
        super().__init__(config, layer, qk_dim=config.head_dim + config.rope_head_dim,
                         rope_dim=config.rope_head_dim)
        d, H, d_h = config.n_embd, config.n_head, config.head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.W_down = nn.Linear(d, self.kv_lora_rank, bias=False)
        self.W_up_k = nn.Linear(self.kv_lora_rank, H * d_h, bias=False)
        self.W_up_v = nn.Linear(self.kv_lora_rank, H * d_h, bias=False)
        self.W_kr = nn.Linear(d, self.rope_dim, bias=False)

    @classmethod
    def check(cls, config):
        if config.kv_lora_rank < 1:
            config.reject("kv_lora_rank", "a positive integer")
        if not (2 <= config.rope_head_dim <= config.head_dim and config.rope_head_dim % 2 == 0):
            config.reject("rope_head_dim", f"even, from 2 to head_dim = {config.head_dim}")

    def keys_values(self, x, rope):
        c = norm(self.W_down(x))  # (B, T, d_c)
        # rotating leaves the RMS unchanged: norm-after-rotate is the queries' rotate-after-norm
        k = self.keys(c, apply_rope(self.W_kr(x).unsqueeze(2), rope))  # (B, T, H, d_h + d_R)
        return norm(k), self.values(c)

    def keys(self, c, k_rope):
        """Every head's key before the QK norm, [c W_up,h^K | k_R]: (B, S, H, d_h + d_R)."""
        B, S = c.shape[:2]
        k_nope = self.W_up_k(c).view(B, S, self.n_head, self.head_dim)
        return torch.cat((k_nope, k_rope.expand(B, S, self.n_head, self.rope_dim)), dim=-1)

    def values(self, c):
        """Every head's value c W_up,h^V: (B, S, d_c) -> (B, S, H, d_h)."""
        return self.W_up_v(c).view(*c.shape[:2], self.n_head, self.head_dim)

    def attend(self, q, k, v):
        # flash attention needs one head dim for q, k and v: v is zero-padded, the zero outputs dropped
        return super().attend(q, k, F.pad(v, (0, self.rope_dim)))[..., :self.head_dim]

    def head_key_weights(self):
        """(H, d, d_h + d_R): head h's key is x @ Wk[h] before the QK norm and RoPE, the latent's norm
        taken as identity. MLA's keys are no per-head projections of x: nothing to convert from."""
        W_up_k = self.W_up_k.weight.view(self.n_head, self.head_dim, self.kv_lora_rank)
        Wk_nope = torch.einsum("cx,hnc->hxn", self.W_down.weight, W_up_k)
        return torch.cat((Wk_nope, self.W_kr.weight.t().expand(self.n_head, -1, -1)), dim=-1)

    # Decoding. The cache holds c, the rotated k_R and each head's key RMS (+3.1% at 128M), which
    # spares decode.py's step (W_up^K absorbed into the query) applying W_up^K to the cache.

    def cache_shapes(self):
        return {"c": (self.kv_lora_rank,), "k_rope": (1, self.rope_dim), "rho": (self.n_head,)}

    def cache_entries(self, x, rope):
        c = norm(self.W_down(x))
        k_rope = apply_rope(self.W_kr(x).unsqueeze(2), rope)  # (B, T, 1, d_R)
        return {"c": c, "k_rope": k_rope, "rho": rms(self.keys(c, k_rope))}

    def cached_keys_values(self, rope, c, k_rope, rho):
        return self.keys(c, k_rope) / rho.unsqueeze(-1), self.values(c)


# The model

class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.W_in = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.W_out = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        return self.W_out(F.relu(self.W_in(x)).square())


class Block(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.attn = attention_classes()[config.attn](config, layer)
        if not self.attn.owns_kv:
            self.attn.drop_keys_values()
        self.mlp = MLP(config)

    def forward(self, x, rope, cache=None, kv=None):
        """x after the block, and the keys and values its attention attended over in training (kv:
        those of its CLA group's first layer, given to the later ones)."""
        if cache is None:
            y, kv = self.attn(norm(x), rope, kv)
        else:
            y = self.attn.decode(norm(x), rope, cache)
        x = x + y
        return x + self.mlp(norm(x)), kv


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        rope = rope_table(self.blocks[0].attn.rope_dim, config.block_size, config.rope_theta)  # every layer's
        self.register_buffer("rope", rope, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """nanochat's init: unit-variance embeddings, a near-zero unembedding, every matrix uniform of
        variance 1/fan_in, zero output projections. The random draws happen in this order, each
        attention layer's own last, so that a seed gives the same weights every time."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                bound = math.sqrt(3 / module.in_features)  # variance 1 / fan_in
                nn.init.uniform_(module.weight, -bound, bound)
        nn.init.normal_(self.wte.weight, std=1.0)
        nn.init.normal_(self.lm_head.weight, std=0.001)
        for block in self.blocks:
            block.attn.reset_parameters()  # zeroes W_o, then draws what else the variant holds
            nn.init.zeros_(block.mlp.W_out.weight)

    def forward(self, idx, targets=None, cache=None):
        """Logits (B, T, vocab) in fp32 and, given targets, the loss. With a cache (new_cache), idx's
        T tokens come after the cache's prefix, and the cache keeps them."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size = {self.config.block_size}")
        rope = self.rope[:T] if cache is None else cache.next_rope(T)  # the RoPE rows of idx's positions
        x = norm(self.wte(idx))
        kv = None  # in training, the keys and values that a CLA group's later layers attend with
        for block in self.blocks:
            x, kv = block(x, rope, cache, kv)
        if cache is not None:
            cache.advance(T)
        logits = self.lm_head(norm(x)).float()
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)

    def get_num_params(self):
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len=None):
        """Training FLOPs a token: 6 a matmul weight (not wte's), 6 an attention_macs (MFU's: not causal)."""
        T = seq_len or self.config.block_size
        matmul_params = self.get_num_params() - self.wte.weight.numel()
        return 6 * matmul_params + 6 * sum(block.attn.attention_macs(T) for block in self.blocks)

    def new_cache(self, batch_size, max_len, dtype=None, device=None):
        """An empty KVCache for batch_size sequences of up to max_len tokens, dtype the weights'."""
        dtype, device = dtype or self.wte.weight.dtype, device or self.wte.weight.device
        if max_len > self.config.block_size:  # the RoPE table has block_size rows
            raise ValueError(f"a KV cache of {max_len} tokens exceeds block_size = {self.config.block_size}")
        shapes = [block.attn.cache_shapes() if block.attn.owns_kv else {} for block in self.blocks]
        return KVCache(shapes, batch_size, max_len, dtype, device, self.rope[:max_len])

    def kv_cache_bytes(self, batch_size, seq_len, dtype=None):
        """Bytes a decoding cache allocates, counted off the same cache built on the meta device."""
        return sum(buf.nbytes for buf in self.new_cache(batch_size, seq_len, dtype, device="meta").buffers())

    def kv_cache_elements_per_token(self):
        """Cached elements per token, summed over the layers (n_layer 2 H d_h for MHA)."""
        return sum(math.prod(shape) for block in self.blocks if block.attn.owns_kv
                   for shape in block.attn.cache_shapes().values())

    def last_logits(self, token, cache):
        """The plain cached step: the logits (B, vocab) of token (B, 1) after the cache's prefix."""
        return self(token, cache=cache)[0][:, -1]

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True, step=None,
                 vocab_size=None):
        """idx (B, T) continued by max_new_tokens sampled tokens: (B, T + max_new_tokens)."""
        new = self.stream(idx, max_new_tokens, temperature, top_k, use_cache, step, vocab_size)
        return torch.cat([idx, *new], dim=1)

    @torch.no_grad()
    def stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True, step=None,
               vocab_size=None):
        """Yield the max_new_tokens tokens (B, 1) that continue idx (B, T), as they are drawn
        (temperature 0: greedy). The model sees at most its last block_size tokens; when the text
        outgrows that, it starts again from the most recent half of it, prefilled into a new cache.
        With the cache, each token after a prefill is fed by step(model, token, cache) -> (logits,
        cache), which may hand back another cache over the same buffers (lib/decode.py's); the
        default is last_logits, the plain cached path. vocab_size: draw only ids below it."""
        if step is not None and not use_cache:
            raise ValueError("a step feeds the KV cache: it needs use_cache=True")
        L = self.config.block_size
        # Keeping k tokens when the text outgrows L costs a prefill of k every L - k + 1 tokens: keeping
        # half costs about one token's prefill a token, and every token sees at least half a context
        keep = L - L // 2
        start = max(0, idx.size(1) - L)  # where the context begins in idx
        max_len = min(L, idx.size(1) + max_new_tokens)  # the cache's: the longest the context gets
        device = idx.device.type
        autocast = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else self.lm_head.weight.dtype
        cache = None
        for _ in range(max_new_tokens):
            if idx.size(1) - start > L:
                start, cache = idx.size(1) - keep, None
            if cache is None:  # the whole context: the prompt, a new start, or any step without the cache
                cache = self.new_cache(idx.size(0), max_len, dtype) if use_cache else None
                logits = self(idx[:, start:], cache=cache)[0][:, -1]
            elif step is None:
                logits = self.last_logits(idx[:, -1:], cache)
            else:
                logits, cache = step(self, idx[:, -1:], cache)
            logits = logits[:, :vocab_size]
            if temperature == 0:
                next_token = logits.argmax(dim=-1, keepdim=True)
            else:
                # from the largest logit down, in fp32: a tiny temperature sends the others to -inf (greedy),
                # not the logits to inf and softmax to nan; below fp32's tiny it divides by tiny
                logits = logits.float() - logits.float().amax(-1, keepdim=True)
                logits = logits / max(temperature, torch.finfo(torch.float32).tiny)
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, next_token), dim=1)
            yield next_token


class KVCache:
    """Decoding's memory, one for the whole model: for each layer that owns keys and values, a buffer
    (B, max_len, *shape) per entry of its cache_shapes, and one position pos, to which every layer
    is filled. A forward through the cache writes its T tokens' entries at positions pos, ...,
    pos + T - 1, layer by layer (write), each layer attending over the keys and values of its own
    entries or, in a CLA group's later layers, of the group's first layer's (attend, through read),
    and then moves pos on (advance). rope: the RoPE rows of positions 0, ..., max_len - 1."""

    def __init__(self, shapes, batch_size, max_len, dtype, device, rope):
        self.pos, self.max_len, self.rope = 0, max_len, rope
        # per layer {name: (B, max_len, *shape)}; none for a layer that reads another's
        self.layers = [{name: torch.zeros(batch_size, max_len, *shape, dtype=dtype, device=device)
                        for name, shape in layer.items()} for layer in shapes]
        # writers[layer]: the attention that wrote the layer's entries. Its weights turn them back
        # into keys and values (cached_keys_values), for its own queries and for a CLA group's later
        # layers. dtypes[layer]: {name: the dtype each entry was computed in}. The buffers may hold
        # another dtype (bf16 under fp32 weights, say); read casts the entries back, so they are
        # rounded once, when stored, and the math after them runs as it does without a cache.
        self.writers, self.dtypes = {}, {}

    def buffers(self):
        return [buf for layer in self.layers for buf in layer.values()]

    def next_rope(self, T):
        """The RoPE rows (T, rope_dim) of the next T positions, which a forward writes."""
        if self.pos + T > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens, {self.pos + T} were asked for")
        return self.rope[self.pos:self.pos + T]

    def write(self, attn, entries):
        """Write attn's new entries {name: (B, T, *shape)} into its layer, at positions pos to pos + T - 1."""
        for name, x in entries.items():
            self.layers[attn.layer][name][:, self.pos:self.pos + x.size(1)] = x
        self.writers[attn.layer] = attn
        self.dtypes[attn.layer] = {name: x.dtype for name, x in entries.items()}

    def read(self, layer, T):
        """A layer's entries at every position through the T being written: {name: (B, pos + T, *shape)}."""
        dtypes = self.dtypes[layer]
        return {name: buf[:, :self.pos + T].to(dtypes[name]) for name, buf in self.layers[layer].items()}

    def attend(self, attn, q):
        """The plain cached path: attn's new queries q (B, T, H, d_qk) attend over the keys and values
        of every position so far, which the attention that wrote them rebuilds from its entries
        (cached_keys_values): attn's own, or in CLA its group's first layer's (kv_layer)."""
        # source: the attention that wrote the entries, attn itself or, in CLA, the group's first
        # layer, of the same class (every layer is one variant): its attend is attn's
        T, source = q.size(1), self.writers[attn.kv_layer]
        keys_values = source.cached_keys_values(self.rope[:self.pos + T], **self.read(attn.kv_layer, T))
        return source.attend(q, *keys_values)

    def advance(self, T):
        self.pos += T

    def repeat(self, n):
        """A cache of n copies of each sequence, in a row, at the same position: one prompt, prefilled
        once, continued n ways (eval.py scores the choices of a question so)."""
        repeated = copy.copy(self)
        repeated.layers = [{name: buf.repeat_interleave(n, dim=0) for name, buf in layer.items()}
                           for layer in self.layers]
        return repeated
