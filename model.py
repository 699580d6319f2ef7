"""
One GPT, five ways to attend: MHA, GQA, MQA, MLA and LRKV (Low-Rank Key-Value attention), on the
paper's 128M backbone (nanochat's): RoPE, parameter-free RMSNorm before every sublayer and on queries
and keys, a ReLU^2 MLP, untied embeddings, no biases. The variants differ only in their keys and
values (and MLA in its query heads' width); README's notation names the symbols.

Chapter 1, training: the config, norm and RoPE, the one attention rule (visible), Attention, the five
variants (each class: its math, then its decoding, then what analysis reads), and GPT.
Chapter 2, decoding: KVCache, the memory of the whole model, and GPT's generate. This file imports
torch alone; lib/attention/ builds on it (the rivals, the fast decoding steps, conversion).
"""

import importlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """Every knob of every variant: GPT(GPTConfig(**ckpt["model_args"])) builds any checkpoint."""
    block_size: int = 2048
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 128 for fast matmuls
    n_layer: int = 12
    n_head: int = 6  # H
    n_embd: int = 768  # d
    head_dim: int = 128  # d_h
    attn: str = "mha"  # the attention variant, a name of VARIANTS
    # Which layers compute keys and values (kv_source): with cla = N, the first of each group of N
    # layers (cross-layer attention); with yoco, the middle layer for the whole upper half
    cla: int = 1
    yoco: bool = False
    # Sliding windows (nanochat's letters): an S layer sees its last `window` positions, an L layer
    # all of them; window_pattern is tiled over the layers and the last layer is always L
    window: int | None = None  # W; None: every layer is L
    window_pattern: str = "SSSL"
    n_kv_head: int = 3  # gqa: key/value heads G, each shared by n_head // G query heads
    kv_lora_rank: int = 128  # mla: width d_c of the cached latent
    rope_head_dim: int = 64  # mla: width d_R of the decoupled RoPE key shared by all heads
    lrkv_rank: int = 46  # lrkv: rank r of each head's residual U_h B_h^T
    rope_theta: float = 10000.0
    # the rivals' knobs (lib/attention/rivals.py), at their papers' defaults
    gta_kv_heads: int = 3  # gta: tied key-value heads G, each read by n_head // G query heads
    gla_latent_heads: int = 2  # gla: latent heads, each read by n_head // them query heads (GLA-2)
    gla_latent_dim: int = 256  # gla: width d_c of each latent head, 2 d_h (GLA-2's 2 x 2 d_h = MLA's 4 d_h)
    tpa_q_rank: int = 6  # tpa: rank R_Q of the queries' sum of outer products
    tpa_kv_rank: int = 2  # tpa: rank R_K = R_V of the keys' and the values'
    mlra_latent_heads: int = 4  # mlra: latent heads, each read by every query head (MLRA-4)
    mlra_latent_dim: int = 128  # mlra: width of each latent head, d_h (MLRA-4's 4 x d_h = MLA's 4 d_h)

    def __post_init__(self):
        if self.attn not in VARIANTS:
            self.reject("attn", "one of " + ", ".join(VARIANTS))
        for field in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "head_dim", "cla"):
            if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
                self.reject(field, "a positive integer")
        if self.n_layer % self.cla:
            self.reject("cla", f"a divisor of n_layer = {self.n_layer} (layers share in groups of cla)")
        if self.yoco and self.n_layer % 2:
            self.reject("n_layer", "even with --yoco (its upper half reads the middle layer)")
        if self.window is not None and not 1 <= self.window <= self.block_size:
            self.reject("window", f"from 1 to block_size = {self.block_size}")
        if not self.window_pattern or set(self.window_pattern) - set("SL"):
            self.reject("window_pattern", "letters S (a layer sees its last --window positions) and L (all)")
        if self.head_dim % 2:
            self.reject("head_dim", "even (RoPE rotates pairs of dimensions)")
        if not 1 < self.rope_theta < math.inf:  # NaN fails too
            self.reject("rope_theta", "a finite number > 1 (RoPE's frequencies theta^(-2i/d) fall from 1)")
        if self.n_embd != self.n_head * self.head_dim:
            self.reject("n_embd", f"n_head * head_dim = {self.n_head} * {self.head_dim}")
        attention_class(self.attn).check(self)

    def reject(self, field, allowed):
        raise ValueError(f"--{field}={getattr(self, field)!r}: must be {allowed}")

    def kv_source(self, layer):
        """The layer whose keys and values `layer` attends with (itself where it computes its own)."""
        if self.yoco and layer >= self.n_layer // 2:
            return self.n_layer // 2
        return layer - layer % self.cla

    def layer_window(self, layer):
        """How many of the latest positions `layer` sees: window for an S layer, None for an L layer."""
        letter = self.window_pattern[layer % len(self.window_pattern)]
        return self.window if letter == "S" and layer < self.n_layer - 1 else None


def norm(x):
    """x / rms(x): parameter-free RMSNorm over the last dim."""
    return F.rms_norm(x, (x.size(-1),))


def rms(x):
    """The RMS that norm divides by, sqrt(mean(x^2) + eps), (...,) for x (..., D): as F.rms_norm, in
    fp32 with fp32's eps even for bf16 x, so that a cached RMS is exactly training's divisor."""
    x_hi = x.to(torch.promote_types(x.dtype, torch.float32))
    return x_hi.pow(2).mean(-1).add(torch.finfo(x_hi.dtype).eps).sqrt().to(x.dtype)


def rope_table(dim, max_len, theta):
    """(max_len, dim): row s is [cos(s theta_i) | sin(s theta_i)], for the dim / 2 frequencies theta_i."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x, rope):
    """RoPE on x (B, T, heads, D), each token turned by its row of rope (T, rope_dim). With half =
    rope_dim / 2, dims i and i + half of the last rope_dim turn together by the angle s theta_i:
    (x_i, x_{i+half}) -> (x_i cos + x_{i+half} sin, x_{i+half} cos - x_i sin). The first
    D - rope_dim dims pass unrotated."""
    cos, sin = rope[:, None, :].to(x.dtype).chunk(2, dim=-1)  # (T, 1, half) each
    x_pass, x1, x2 = x.split((x.size(-1) - 2 * cos.size(-1), cos.size(-1), cos.size(-1)), dim=-1)
    return torch.cat((x_pass, x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


def visible(q_pos, k_pos, window=None):
    """The one attention rule, for training, prefill and every decoding path: the query at position i
    sees the key at position j when j <= i (causal) and, in a layer with a window W, i - j < W. q_pos
    (T,) and k_pos (S,) are positions (a negative key position marks an empty cache slot, seen by
    none). Returns a (T, S) bool mask."""
    distance = q_pos[:, None] - k_pos[None, :]  # (T, S)
    seen = (distance >= 0) & (k_pos >= 0)
    return seen if window is None else seen & (distance < window)


# Chapter 1: training

class Attention(nn.Module):
    """What every variant shares: H query heads q_h = Rot(norm(x W_h^Q)), softmax attention over the
    keys and values that `visible` lets each query see, and the output projection W_o. A variant
    defines keys_values(x, rope), G key/value heads, and for decoding cache_shapes (README: Adding a
    variant). Every parameter is a matrix (Muon's). A layer attends with the keys and values of its
    kv_layer (config.kv_source: its own, or those of the layer it shares, then holding no key or value
    weights), with its own window (config.layer_window)."""

    query_weights = ("W_q",)  # what makes the queries: all that a layer that shares keys keeps, with W_o

    def __init__(self, config, layer, qk_dim=None, rope_dim=None):
        super().__init__()
        self.layer, self.n_head, self.head_dim = layer, config.n_head, config.head_dim
        self.qk_dim = qk_dim or config.head_dim  # d_qk: a query or key head's width
        self.rope_dim = rope_dim or config.head_dim  # RoPE turns a query's and a key's last rope_dim dims
        self.kv_layer, self.window = config.kv_source(layer), config.layer_window(layer)
        self.shared = any(config.kv_source(other) == layer != other for other in range(config.n_layer))
        self.W_q = nn.Linear(config.n_embd, config.n_head * self.qk_dim, bias=False)
        self.W_o = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)

    def forward(self, x, rope, kvs):
        """Training: x (B, T, d) at positions 0..T-1; kvs: {layer: its keys and values} where shared."""
        q = self.queries(x, rope)  # (B, T, H, d_qk)
        k, v = self.keys_values(x, rope) if self.owns_kv else kvs[self.kv_layer]
        if self.owns_kv and self.shared:  # kept only where another layer reads them: memory
            kvs[self.layer] = k, v
        positions = torch.arange(x.size(1))
        mask = None if self.window is None else visible(positions, positions, self.window)
        return self.W_o(self.attend(q, k, v, mask).flatten(2))

    def queries(self, x, rope):
        B, T, _ = x.shape
        return apply_rope(norm(self.W_q(x).view(B, T, self.n_head, self.qk_dim)), rope)  # (B, T, H, d_qk)

    def attend(self, q, k, v, mask=None):
        """softmax(q k^T / sqrt(d_qk)) v for q (B, T, H, d_qk), k (B, S, G, d_qk), v (B, S, G, d_v),
        query head h reading key/value head h G // H, where mask (T, S) allows; mask None: T = S
        and the plain causal rule, which SDPA's is_causal applies as `visible` would, faster."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.to(q.device),
                                           is_causal=mask is None, enable_gqa=k.size(1) != q.size(1))
        return y.transpose(1, 2)  # (B, T, H, d_v)

    @classmethod
    def check(cls, config):
        """Reject (config.reject) a knob of the variant's own that it cannot be built with."""

    def reset_parameters(self):
        """Zero W_o (the block starts as the identity); a variant draws its others after super()."""
        nn.init.zeros_(self.W_o.weight)

    def attention_macs(self, seq_len):
        """Multiply-adds per token, forward, of q k^T and a v over seq_len keys, all heads."""
        return self.n_head * (self.qk_dim + self.head_dim) * seq_len

    @property
    def owns_kv(self):
        return self.kv_layer == self.layer

    def drop_keys_values(self):
        """Keep only the queries' weights and W_o: this layer attends with kv_layer's keys and values."""
        for name, _ in [*self.named_children(), *self.named_parameters(recurse=False)]:
            if name not in (*self.query_weights, "W_o"):
                delattr(self, name)

    # Decoding: what a token leaves in the cache, and keys and values rebuilt from it
    def decode(self, x, rope, cache):
        """x's T new tokens (B, T, d) after the cache's prefix: the layer hands the cache their entries
        (if it owns its keys), then attends over every position its rule lets it see (KVCache.attend)."""
        q = self.queries(x, rope)
        if self.owns_kv:
            cache.write(self, self.cache_entries(x, rope))
        return self.W_o(cache.attend(self, q).flatten(2))

    def cache_shapes(self):
        """{name: shape}: what one token leaves in the cache, by entry."""
        raise NotImplementedError

    def cache_entries(self, x, rope):
        """The new tokens' entries {name: (B, T, *shape)}: by default their keys and values themselves."""
        k, v = self.keys_values(x, rope)
        return {"k": k, "v": v}

    def cached_keys_values(self, rope, **cached):
        """The keys and values, as keys_values gives them, of S cached positions from their entries
        {name: (B, S, *shape)} and their RoPE rows rope (S, rope_dim). By default the entries' k, v."""
        return cached["k"], cached["v"]

    # What analysis (lib/attention/diversity.py) and conversion (lib/attention/convert.py) read
    def head_kv_weights(self):
        """(W_K, W_V), each (H, d_h, d): head h's key is x @ W_K[h].T before the QK norm and RoPE, and
        its value x @ W_V[h].T, where a variant's keys and values are per-head projections of x."""
        raise ValueError(f"{type(self).__name__} gives no per-head key and value projections")

    def head_key_weights(self):
        """(H, d, d_qk): head h's key is x @ W[h] before the QK norm and RoPE."""
        return self.head_kv_weights()[0].mT

    def head_qk_grams(self, pair_products):
        """The Gram tensors [i, a, j, b] = (Q_i^T Q_j)[a, b] of the heads' query maps Q_h (d, d_qk) and
        the same of their key maps, (H, d_qk, H, d_qk) each, by diversity.py's pair_products."""
        Q = self.W_q.weight.view(self.n_head, self.qk_dim, -1).mT  # (H, d, d_qk)
        return pair_products(Q), pair_products(self.head_key_weights())


class GroupedQueryAttention(Attention):
    """GQA: G = config.n_kv_head key/value heads K_g = X W_g^K, V_g = X W_g^V, query head h reading
    g = h G // H; MHA (G = H) and MQA (G = 1) change kv_heads alone. The cache holds the keys and
    values as they are: 2 G d_h numbers per token and layer."""

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
    """LRKV: every head's key and value projections are one matrix shared by all heads plus a rank-r
    residual of the head's own,

        W_h^K = W_shared^K + U_h^K (B_h^K)^T        W_h^V = W_shared^V + U_h^V (B_h^V)^T

    W_shared (d, d_h), U_h (d, r), B_h (d_h, r), so that for the inputs X (T, d)

        K_h = X W_shared^K + (X U_h^K)(B_h^K)^T = K_shared + R_h^K (B_h^K)^T

    and V_h likewise. Training builds every K_h and V_h and attends as MHA, each key normalised and
    rotated, k_h = Rot(norm(K_h)). 1 <= r <= d_h: r = d_h gives every head MHA's capacity; with no
    residual it is MQA. nn.Linear keeps transposes: W_shared_k.weight is (W_shared^K)^T, U_k.weight
    the (U_h^K)^T stacked, (H r, d); B_k holds the B_h^K stacked as they are, (H d_h, r)."""

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
        # B_h of std 0.1/sqrt(r): the paper's starting residual, ||U_h B_h^T||_F ~ 0.1 ||W_shared||_F
        super().reset_parameters()
        for factor in self.parameters(recurse=False):  # B_k, B_v, where the layer owns its keys
            nn.init.normal_(factor, std=0.1 / math.sqrt(self.lrkv_rank))

    def keys_values(self, x, rope):
        k_shared, v_shared = self.W_shared_k(x), self.W_shared_v(x)  # (B, T, d_h): X W_shared
        r_k, r_v = self.residual_coords(self.U_k, x), self.residual_coords(self.U_v, x)  # (B, T, H, r): X U_h
        k = k_shared.unsqueeze(2) + self.residual(r_k, self.B_k)  # (B, T, H, d_h): K_h
        return apply_rope(norm(k), rope), self.values(v_shared, r_v)

    def key_parts(self, x):
        """K_shared = X W_shared, R^K = X U_h and every head's K_h = K_shared + R_h^K (B_h^K)^T."""
        k_shared, r_k = self.W_shared_k(x), self.residual_coords(self.U_k, x)
        return k_shared, r_k, k_shared.unsqueeze(2) + self.residual(r_k, self.B_k)

    def residual_coords(self, U, x):
        """R_h = X U_h of every head (U: U_k or U_v), (B, T, d) -> (B, T, H, r)."""
        return U(x).view(*x.shape[:2], -1, self.lrkv_rank)

    def residual(self, R, factor):
        """Every head's R_h B_h^T (factor: B_k or B_v), (B, S, H, r) -> (B, S, H, d_h)."""
        return torch.einsum("bshr,hdr->bshd", R, factor.view(self.n_head, self.head_dim, self.lrkv_rank))

    def values(self, v_shared, r_v):
        """Every head's V_h = V_shared + R_h^V (B_h^V)^T, (B, S, d_h), (B, S, H, r) -> (B, S, H, d_h)."""
        return v_shared.unsqueeze(2) + self.residual(r_v, self.B_v)

    # Decoding. The cache holds the paper's 2 d_h + 2 H r numbers per token, and each head's key RMS
    # rho_h (H more, +0.7% at 128M). RoPE turns d_h dims, so it can be applied before caching to
    # K_shared (the same for every head) but not to the r-wide R_h^K: those are cached unrotated, and
    # each head's residual is rotated after B_h^K brings it back to d_h dims. The norm divides a whole
    # key by one number, so Rot_s(norm(K_h)) = (Rot_s K_shared + Rot_s(R_h^K (B_h^K)^T)) / rho_h:
    # with rho_h cached, decode.py's step (eq. 6 and 7) never builds a key.

    def cache_shapes(self):
        H, d_h, r = self.n_head, self.head_dim, self.lrkv_rank
        return {"k_shared": (d_h,), "r_k": (H, r), "rho": (H,), "v_shared": (d_h,), "r_v": (H, r)}

    def cache_entries(self, x, rope):
        k_shared, r_k, k = self.key_parts(x)
        return {"k_shared": apply_rope(k_shared.unsqueeze(2), rope).squeeze(2), "r_k": r_k, "rho": rms(k),
                "v_shared": self.W_shared_v(x), "r_v": self.residual_coords(self.U_v, x)}

    def cached_keys_values(self, rope, k_shared, r_k, rho, v_shared, r_v):
        return self.keys(k_shared, r_k, rho, rope), self.values(v_shared, r_v)

    def keys(self, k_shared, r_k, rho, rope):
        """Every head's normalised, rotated key at S cached positions, as training's: (B, S, H, d_h)."""
        residual = apply_rope(self.residual(r_k, self.B_k), rope)  # (B, S, H, d_h)
        return (k_shared.unsqueeze(2) + residual) / rho.unsqueeze(-1)

    def head_kv_weights(self):
        """Every head's W_h = W_shared + U_h B_h^T, keys' and values', transposed: (H, d_h, d) each."""
        H, d_h, r = self.n_head, self.head_dim, self.lrkv_rank
        halves = ((self.W_shared_k, self.U_k, self.B_k), (self.W_shared_v, self.U_v, self.B_v))
        return tuple(W.weight + torch.einsum("hdr,hrc->hdc", B.view(H, d_h, r), U.weight.view(H, r, -1))
                     for W, U, B in halves)


class MultiHeadLatentAttention(Attention):
    """MLA as DeepSeek-V2: keys and values come up per head, through W_up, from a normalised latent
    c = norm(x W_down) of width d_c; one decoupled RoPE key k_R = x W_kr of width d_R, shared by all
    heads, carries position:

        k_h = norm([c W_up,h^K | Rot(k_R)])        v_h = c W_up,h^V

    so q/k heads are d_h + d_R wide, a query head [q_h^nope | q_h^R] with RoPE on its last d_R dims;
    the QK norm takes the whole concatenation, so a key's RMS is per head though k_R is shared."""

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

    def attend(self, q, k, v, mask=None):
        # flash attention needs one head dim for q, k and v: v is zero-padded, the zero outputs dropped
        return super().attend(q, k, F.pad(v, (0, self.rope_dim)), mask)[..., :self.head_dim]

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

    def head_key_weights(self):
        """(H, d, d_h + d_R): head h's key is x @ Wk[h] before the QK norm and RoPE, the latent's norm
        taken as identity. MLA's keys are no per-head projections of x: nothing to convert from."""
        W_up_k = self.W_up_k.weight.view(self.n_head, self.head_dim, self.kv_lora_rank)
        Wk_nope = torch.einsum("cx,hnc->hxn", self.W_down.weight, W_up_k)
        return torch.cat((Wk_nope, self.W_kr.weight.t().expand(self.n_head, -1, -1)), dim=-1)


# Every variant by the name --attn takes, in one place: the paper's five above and the field's four
# rivals, which lib/attention/rivals.py writes on this file's Attention. A rival is named by its path
# and imported when a model of it is built, so that this file imports torch alone.
VARIANTS = {
    "mha": MultiHeadAttention,
    "mqa": MultiQueryAttention,
    "gqa": GroupedQueryAttention,
    "mla": MultiHeadLatentAttention,
    "lrkv": LowRankKVAttention,
    "gta": "lib.attention.rivals.GroupedTiedAttention",
    "gla": "lib.attention.rivals.GroupedLatentAttention",
    "tpa": "lib.attention.rivals.TensorProductAttention",
    "mlra": "lib.attention.rivals.MultiHeadLowRankAttention",
}


def attention_class(name):
    variant = VARIANTS[name]
    if isinstance(variant, str):
        module, _, class_name = variant.rpartition(".")
        variant = getattr(importlib.import_module(module), class_name)
    return variant


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
        self.attn = attention_class(config.attn)(config, layer)
        if not self.attn.owns_kv:
            self.attn.drop_keys_values()
        self.mlp = MLP(config)

    def forward(self, x, rope, cache=None, kvs=None):
        y = self.attn(norm(x), rope, kvs) if cache is None else self.attn.decode(norm(x), rope, cache)
        x = x + y
        return x + self.mlp(norm(x))


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
        variance 1/fan_in, zero output projections; in this order, so a seed gives the same weights."""
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
        kvs = {}  # in training, each layer's keys and values, for the layers that share them
        for block in self.blocks:
            x = block(x, rope, cache, kvs)
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

    # Chapter 2: decoding

    def new_cache(self, batch_size, max_len, dtype=None, device=None):
        """An empty KVCache for batch_size sequences of up to max_len tokens, dtype the weights'."""
        dtype, device = dtype or self.wte.weight.dtype, device or self.wte.weight.device
        if max_len > self.config.block_size:  # the RoPE table has block_size rows
            raise ValueError(f"a KV cache of {max_len} tokens exceeds block_size = {self.config.block_size}")
        return KVCache([block.attn for block in self.blocks], batch_size, max_len, dtype, device,
                       self.rope[:max_len])

    def kv_cache_bytes(self, batch_size, seq_len, dtype=None):
        """Bytes a decoding cache allocates, counted off the same cache built on the meta device."""
        return sum(buf.nbytes for buf in self.new_cache(batch_size, seq_len, dtype, device="meta").buffers())

    def kv_cache_elements_per_token(self):
        """Cached elements per token, summed over the layers (n_layer 2 H d_h for MHA), before windows."""
        return sum(math.prod(shape) for block in self.blocks if block.attn.owns_kv
                   for shape in block.attn.cache_shapes().values())

    def last_logits(self, token, cache):
        """The plain cached step: the logits (B, vocab) of token (B, 1) after the cache's prefix."""
        return self(token, cache=cache)[0][:, -1]


def masked_softmax(scores, mask, dtype):
    """softmax of scores (B, H, S) over the positions that mask (None: all, or (1, S) bool) allows, in
    fp32. An empty slot's score may be 0 / 0 (LRKV's and MLA's rho is 0 there): -inf overwrites it."""
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)


class KVCache:
    """Decoding's memory, one for the whole model, at one position pos: the entries of positions
    0..pos-1 that some layer can still see. A layer that owns its keys keeps a buffer (B, length,
    *shape) for each entry of its cache_shapes, length the widest span of the layers reading it:
    max_len where one of them sees every position, else the widest window W, and the buffer is a ring
    whose slot p % W holds position p. A forward of T tokens writes each owner's entries, each layer
    attends over its kv_layer's entries with its own window, and advance moves pos on. rope: the RoPE
    rows of positions 0..max_len-1."""

    def __init__(self, attns, batch_size, max_len, dtype, device, rope):
        self.pos, self.max_len, self.rope = 0, max_len, rope
        # writers[layer]: the attention that owns the layer's entries, whose weights turn them back
        # into keys and values (cached_keys_values) for every layer that reads them
        self.writers = {attn.layer: attn for attn in attns if attn.owns_kv}
        span = {layer: max(min(a.window or max_len, max_len) for a in attns if a.kv_layer == layer)
                for layer in self.writers}
        self.layers = [{name: torch.zeros(batch_size, span[a.layer], *shape, dtype=dtype, device=device)
                        for name, shape in a.cache_shapes().items()} if a.owns_kv else {} for a in attns]
        # dtypes[layer]: {name: the dtype its entries were computed in}, noted by write. A buffer may
        # hold another dtype (bf16 under fp32 weights, say); read casts back, so entries are rounded
        # once, when stored, and the math after them runs as it does without a cache.
        self.dtypes, self.pending = {}, {}  # pending: see write

    def buffers(self):
        return [buf for layer in self.layers for buf in layer.values()]

    def length(self, layer):  # how many positions the layer's buffers hold
        return next(iter(self.layers[layer].values())).size(1)

    def next_rope(self, T):
        """The RoPE rows (T, rope_dim) of the next T positions, which a forward writes."""
        if self.pos + T > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens, {self.pos + T} were asked for")
        return self.rope[self.pos:self.pos + T]

    def write(self, attn, entries):
        """Store attn's new entries {name: (B, T, *shape)}, of positions pos..pos+T-1. On a ring, a
        chunk of T > 1 tokens would overwrite positions its own first queries still see: it waits in
        pending, read beside the ring, until advance stores it."""
        layer, T = attn.layer, next(iter(entries.values())).size(1)
        self.dtypes[layer] = {name: x.dtype for name, x in entries.items()}
        if T > 1 and self.pos + T > self.length(layer):
            self.pending[layer] = entries
        else:
            self.store(layer, entries)

    def store(self, layer, entries):
        """Put entries of positions pos, pos + 1, ... into their slots, the last `length` of them."""
        T, length = next(iter(entries.values())).size(1), self.length(layer)
        slots = torch.arange(self.pos, self.pos + T)[-length:] % length
        for name, x in entries.items():
            buf = self.layers[layer][name]
            buf[:, slots] = x[:, -length:].to(buf.dtype)

    def slot_positions(self, layer, pos):
        """(length,): the position each slot holds once 0..pos-1 are written (the latest p with
        p % length = slot), negative for a slot not written yet."""
        slots = torch.arange(self.length(layer), device=self.rope.device)
        return pos - 1 - (pos - 1 - slots) % self.length(layer)

    def read(self, layer, T):
        """The layer's entries {name: (B, S, *shape)} through position pos + T - 1, and their positions
        (S,): the slots written, then any pending chunk."""
        ahead = 0 if layer in self.pending else T  # positions already in the slots
        held = min(self.pos + ahead, self.length(layer))
        dtypes = self.dtypes[layer]
        entries = {name: buf[:, :held].to(dtypes[name]) for name, buf in self.layers[layer].items()}
        positions = self.slot_positions(layer, self.pos + ahead)[:held]
        if layer in self.pending:
            entries = {name: torch.cat((x, self.pending[layer][name]), 1) for name, x in entries.items()}
            positions = torch.cat((positions, torch.arange(self.pos, self.pos + T, device=positions.device)))
        return entries, positions

    def attend(self, attn, q):
        """The plain cached path: attn's new queries q (B, T, H, d_qk) attend over the keys and values
        that the writer of its kv_layer rebuilds from the entries, where `visible` allows."""
        entries, positions = self.read(attn.kv_layer, q.size(1))
        k, v = self.writers[attn.kv_layer].cached_keys_values(self.rope[positions], **entries)
        here = torch.arange(self.pos, self.pos + q.size(1), device=positions.device)
        return attn.attend(q, k, v, visible(here, positions, attn.window))

    def advance(self, T):
        for layer, entries in self.pending.items():
            self.store(layer, entries)
        self.pos, self.pending = self.pos + T, {}
