"""
One GPT, five ways to attend: MHA, GQA, MQA, MLA and LRKV (Low-Rank Key-Value attention).

The backbone is the paper's 128M model (a nanochat-style GPT): RoPE, parameter-free RMSNorm
before every sublayer and on queries and keys, a ReLU^2 MLP, untied embeddings, no biases.
Only the key/value side of attention changes between variants; every variant keeps H
full-rank query heads W_q and the output projection W_o.

Read top-down: the config and the pieces every variant uses (norm, RoPE, Attention); the five
variants, each a class whose docstring is its math and whose forward is what training runs,
followed by what decoding adds (the cache and the exact single-token step, each optimised step
beside the plain equation it equals); the GPT; KVCache, the per-layer memory that decoding
fills. At the end of each class, after its math: its checks, its legend label for analyze.py
and its conversion from per-head projections (convert.py, train.py --init_from).
"""

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
    n_head: int = 6
    n_embd: int = 768
    head_dim: int = 128
    attn: str = "mha"
    n_kv_head: int = 3  # gqa: key/value heads G, each shared by n_head // G query heads
    kv_lora_rank: int = 128  # mla: width d_c of the cached latent
    rope_head_dim: int = 64  # mla: width d_R of the decoupled RoPE key shared by all heads
    lrkv_rank: int = 46  # lrkv: rank r of each head's residual U_h B_h^T
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.attn not in ATTENTION:
            self.reject("attn", "one of " + ", ".join(ATTENTION))
        for field in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "head_dim"):
            if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
                self.reject(field, "a positive integer")
        if self.head_dim % 2:
            self.reject("head_dim", "even (RoPE rotates pairs of dimensions)")
        if not 1 < self.rope_theta < math.inf:  # NaN fails too
            self.reject("rope_theta", "a finite number > 1, so that RoPE's frequencies theta^(-2i/d) "
                                      "fall from 1")
        if self.n_embd != self.n_head * self.head_dim:
            product = self.n_head * self.head_dim
            self.reject("n_embd", f"n_head * head_dim = {self.n_head} * {self.head_dim} = {product}")
        ATTENTION[self.attn].check(self)

    def reject(self, field, allowed):
        raise ValueError(f"GPTConfig.{field} = {getattr(self, field)!r}: must be {allowed}")


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def rms(x):
    """The RMS over the last dim that norm(x) divides x by: norm(x) = x / rms(x)[..., None].
    As in F.rms_norm, bf16 and fp16 are computed in fp32 and with fp32's eps: their own eps
    (7.8e-3 for bf16) would outweigh the mean square of a small key."""
    x_hi = x.to(torch.promote_types(x.dtype, torch.float32))
    return x_hi.pow(2).mean(-1).add(torch.finfo(x_hi.dtype).eps).sqrt().to(x.dtype)


def rope_table(dim, max_len, theta):
    """(max_len, dim): row s is [cos(s theta_i) | sin(s theta_i)], for the dim / 2 frequencies theta_i."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x, rope):
    """Rotate the last rope_dim = rope.size(-1) dims of x (B, T, heads, D), dim i of them with
    dim i + rope_dim / 2, and pass the first D - rope_dim through. rope: (S, rope_dim) rows of
    rope_table, x's T tokens the last T of its S positions (all of them in training)."""
    cos, sin = rope[-x.size(1):, None, :].to(x.dtype).chunk(2, dim=-1)
    x_pass, x1, x2 = x.split((x.size(-1) - 2 * cos.size(-1), cos.size(-1), cos.size(-1)), dim=-1)
    return torch.cat((x_pass, x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)




# -----------------------------------------------------------------------------
# The attention variants

class Attention(nn.Module):
    """What every variant shares: H full-rank query heads W_q (normalised and rotated by
    `queries`), the output projection W_o, and `attend`, causal softmax attention.

    A variant is a subclass listed in the ATTENTION registry below. It defines forward (its
    training math; with a cache, decoding) and cache_shapes (what one token leaves in the cache).
    It is built as cls(config, layer), layer the block's index from 0, so that a variant may
    differ from layer to layer; GPT sums every count (parameters, FLOPs, cache) over the layers.
    Widths: every query and key head is qk_dim wide, every value head head_dim (W_o reads H of
    them). RoPE rotates the last rope_dim dims of each query and key head. Every parameter must
    be a 2-D matrix: train.py hands all of them to Muon, which orthogonalises matrices.
    After its math a variant may define: check (its knobs), reset_parameters (parameters outside
    an nn.Linear), attention_macs (values not head_dim wide), legend_label and legend_key
    (analyze.py), head_key_weights (diversity.py, where head_kv_weights cannot give the keys), and
    its conversion, head_kv_weights and load_head_kv_weights (convert.py)."""

    def __init__(self, config, layer, qk_dim=None, rope_dim=None):
        super().__init__()
        self.layer, self.n_head, self.head_dim = layer, config.n_head, config.head_dim
        self.qk_dim = qk_dim or config.head_dim
        self.rope_dim = rope_dim or config.head_dim
        self.W_q = nn.Linear(config.n_embd, config.n_head * self.qk_dim, bias=False)
        self.W_o = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                cache: "KVCache | None" = None) -> torch.Tensor:
        """This layer's attention output (B, T, d), W_o applied, for the normalised input x (B, T, d).
        rope: the rope_table rows of x's T positions. With a cache (a KVCache of cache_shapes), x
        continues the cached prefix: pass x's entries to cache.update, which appends them and
        returns every position's, and attend over those (attend(q, k, v, cache) applies the
        cache's mask); cache.rope has the rows of every cached position."""
        raise NotImplementedError

    def cache_shapes(self) -> dict[str, tuple[int, ...]]:
        """What one token leaves in the decoding cache, {name: shape}: KVCache holds a
        (B, max_len, *shape) buffer per name, and GPT.kv_cache_bytes counts them."""
        raise NotImplementedError

    def queries(self, x, rope):
        B, T, _ = x.shape
        return apply_rope(norm(self.W_q(x).view(B, T, self.n_head, self.qk_dim)), rope)  # (B, T, H, d_qk)

    def attend(self, q, k, v, cache=None):
        """softmax(q k^T / sqrt(d_qk)) v for q (B, T, H, d_qk) against k (B, S, H or G, d_qk) and
        v (B, S, H or G, d_v): the T queries are the last T of the S positions, so T == S is plain
        causal attention; or, where the cache that returned k and v has a mask (fast_decode.py's
        fixed-shape one), the positions it allows."""
        T, S, d_v = q.size(1), k.size(1), v.size(-1)
        # On a GPU flash attention needs one head dim for q, k and v: a narrower v (MLA's d_h
        # against its d_h + d_R) is zero-padded, and the padded output dims (all zero) dropped.
        if d_v < q.size(-1):
            v = F.pad(v, (0, q.size(-1) - d_v))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        gqa = k.size(1) != q.size(1)  # SDPA reads each of G key/value heads for H/G query heads
        mask = None if cache is None else cache.mask()
        if mask is None and T != S and T != 1:  # a chunk after a cached prefix
            mask = torch.arange(S, device=q.device) <= torch.arange(S - T, S, device=q.device)[:, None]
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return y.transpose(1, 2)[..., :d_v]

    def project_out(self, y):
        return self.W_o(y.flatten(2))

    # the defaults that a variant may override

    @classmethod
    def check(cls, config: "GPTConfig") -> None:
        """Reject (config.reject) any of the variant's own knobs that it cannot be built with.
        GPTConfig calls it after the checks that every variant shares."""

    def reset_parameters(self) -> None:
        """This layer's share of GPT.reset_parameters, which calls it layer after layer once it has
        drawn every nn.Linear in the model: zero W_o, so that the block starts as the identity.
        A variant with other parameters draws them here, from the global RNG, after super()."""
        nn.init.zeros_(self.W_o.weight)

    def attention_macs(self, seq_len: int) -> int:
        """Multiply-adds per token, forward, of q k^T and a v over seq_len keys, all heads (no
        discount for the causal mask): GPT.flops_per_token counts 6 FLOPs for each."""
        return self.n_head * (self.qk_dim + self.head_dim) * seq_len


class GroupedQueryAttention(Attention):
    """GQA: G = config.n_kv_head key/value heads, each shared by H/G consecutive query heads,

        K_g = X W_g^K        V_g = X W_g^V        head h attends with K_g, V_g for g = h G // H

    MHA (G = H) and MQA (G = 1) are its subclasses, which change kv_heads alone (and the label).
    Cache per token: 2 G d_h (keys stored normalised and rotated, ready to use)."""

    def __init__(self, config, layer):
        super().__init__(config, layer)
        self.n_kv_head = self.kv_heads(config)
        self.W_k = nn.Linear(config.n_embd, self.n_kv_head * config.head_dim, bias=False)
        self.W_v = nn.Linear(config.n_embd, self.n_kv_head * config.head_dim, bias=False)

    @staticmethod
    def kv_heads(config):
        """G, the number of key/value heads."""
        return config.n_kv_head

    def forward(self, x, rope, cache=None):
        B, T, _ = x.shape
        q = self.queries(x, rope)  # (B, T, H, d_h)
        k = apply_rope(norm(self.W_k(x).view(B, T, self.n_kv_head, self.head_dim)), rope)  # (B, T, G, d_h)
        v = self.W_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if cache is not None:  # decoding: attend over every position's keys and values so far
            cached = cache.update(k=k, v=v)
            k, v = cached["k"], cached["v"]
        return self.project_out(self.attend(q, k, v, cache))

    # decoding: the cache holds what training computes, so forward above is the whole step

    def cache_shapes(self):
        return {"k": (self.n_kv_head, self.head_dim), "v": (self.n_kv_head, self.head_dim)}

    # checks, label, conversion

    @classmethod
    def check(cls, config):
        G = cls.kv_heads(config)  # MHA's and MQA's G never fail: only GQA reads n_kv_head
        if not (1 <= G <= config.n_head and config.n_head % G == 0):
            config.reject("n_kv_head", f"a divisor of n_head = {config.n_head}")

    @classmethod
    def legend_label(cls, config, peers):
        return f"GQA ({config.n_kv_head} KV heads)"

    @classmethod
    def legend_key(cls, config):
        return 4, config.n_kv_head

    def head_kv_weights(self):
        H, G, d_h = self.n_head, self.n_kv_head, self.head_dim
        return tuple(W.weight.view(G, d_h, -1).repeat_interleave(H // G, dim=0) for W in (self.W_k, self.W_v))

    def load_head_kv_weights(self, W_K, W_V, C=None):
        """Each key/value head is the mean of its group's H/G heads, as Ainslie et al. (2023)
        convert MHA to GQA; with G = H that is the identity. C changes nothing: for any C the
        mean W of a group's heads W_h minimises sum_h ||(W_h - M) C^(1/2)||_F^2, which is
        sum_h ||(W_h - W) C^(1/2)||_F^2 + (H/G) ||(W - M) C^(1/2)||_F^2 (the cross term holds
        sum_h (W_h - W) = 0)."""
        G, d_h = self.n_kv_head, self.head_dim
        for W, heads in ((self.W_k, W_K), (self.W_v, W_V)):
            W.weight.copy_(heads.view(G, -1, d_h, heads.size(-1)).mean(1).flatten(0, 1))


class MultiHeadAttention(GroupedQueryAttention):
    """Standard MHA: every query head has a key/value head of its own (G = H)."""

    @staticmethod
    def kv_heads(config):
        return config.n_head

    @classmethod
    def legend_label(cls, config, peers):
        return "Standard MHA"

    @classmethod
    def legend_key(cls, config):
        return 0, 0


class MultiQueryAttention(GroupedQueryAttention):
    """MQA: one key/value head shared by all query heads (G = 1)."""

    @staticmethod
    def kv_heads(config):
        return 1

    @classmethod
    def legend_label(cls, config, peers):
        return "MQA"

    @classmethod
    def legend_key(cls, config):
        return 2, 0


class LowRankKVAttention(Attention):
    """LRKV: every head's key and value projections are one matrix shared by all heads plus a
    rank-r residual of the head's own (the paper's eq. 6 and 7),

        W_h^K = W_shared^K + U_h^K (B_h^K)^T        W_h^V = W_shared^V + U_h^V (B_h^V)^T

    W_shared (d, d_h), U_h (d, r), B_h (d_h, r), so that for the inputs X (T, d)

        K_h = X W_shared^K + (X U_h^K)(B_h^K)^T = K_shared + R_h^K (B_h^K)^T

    and V_h likewise. Training builds every head's K_h and V_h and attends as MHA does. A decoder
    caches K_shared, V_shared (d_h each) and every head's R_h^K, R_h^V (r each), the paper's
    2 d_h + 2 H r per token, plus each head's key RMS (H numbers, +0.7% at 128M; see key_scores).
    The B_h are weights, not cache. r = 0 would be MQA; r = d_h gives each head a full-rank residual.

    In code, as in every nn.Linear, the weights are the transposes: W_shared_k.weight is
    (W_shared^K)^T (d_h, d), U_k.weight the (U_h^K)^T stacked (H r, d), and B_k the B_h^K stacked
    (H d_h, r): the weight of an nn.Linear from r to H d_h, a bare Parameter because it is drawn
    apart (reset_parameters). The heads' residuals R_g come in n_residual groups (residual_heads),
    each read by H / n_residual consecutive heads (per_head): H of them here, one a head."""

    def __init__(self, config, layer):
        super().__init__(config, layer)
        d, H, d_h, r = config.n_embd, config.n_head, config.head_dim, config.lrkv_rank
        self.lrkv_rank, self.n_residual = r, self.residual_heads(config)
        self.W_shared_k = nn.Linear(d, d_h, bias=False)
        self.W_shared_v = nn.Linear(d, d_h, bias=False)
        self.U_k = nn.Linear(d, self.n_residual * r, bias=False)
        self.U_v = nn.Linear(d, self.n_residual * r, bias=False)
        self.B_k = nn.Parameter(torch.empty(H * d_h, r))
        self.B_v = nn.Parameter(torch.empty(H * d_h, r))

    def reset_parameters(self):
        # W_shared and U_h have entries of variance 1/d, so B_h entries of std 0.1/sqrt(r) give
        # ||U_h B_h^T||_F ~ sqrt(d d_h r) / sqrt(d) * 0.1/sqrt(r) = 0.1 sqrt(d_h) ~ 0.1 ||W_shared||_F,
        # the paper's starting residual.
        super().reset_parameters()
        for factor in self.parameters(recurse=False):  # B_k, B_v: the only parameters outside an nn.Linear
            nn.init.normal_(factor, std=0.1 / math.sqrt(self.lrkv_rank))

    def forward(self, x, rope, cache=None):
        if cache is not None:
            return self.decode(x, rope, cache)
        B, T, _ = x.shape
        q = self.queries(x, rope)  # (B, T, H, d_h)
        k_shared, v_shared = self.W_shared_k(x), self.W_shared_v(x)  # (B, T, d_h): X W_shared
        r_k = self.U_k(x).view(B, T, self.n_residual, self.lrkv_rank)  # (B, T, H, r): R_h^K = X U_h^K
        r_v = self.U_v(x).view(B, T, self.n_residual, self.lrkv_rank)
        k = k_shared.unsqueeze(2) + self.residual(self.per_head(r_k), self.B_k)  # (B, T, H, d_h): K_h
        return self.project_out(self.attend(q, apply_rope(norm(k), rope), self.values(v_shared, r_v)))

    def residual(self, R, factor):
        """Every head's R_h B_h^T, factor being B_k or B_v: (B, S, H, r) -> (B, S, H, d_h)."""
        return torch.einsum("bshr,hdr->bshd", R, factor.view(self.n_head, self.head_dim, self.lrkv_rank))

    def values(self, v_shared, r_v):
        """Every head's V_h = V_shared + R_h^V (B_h^V)^T: (B, S, d_h), (B, S, H, r) -> (B, S, H, d_h)."""
        return v_shared.unsqueeze(2) + self.residual(self.per_head(r_v), self.B_v)

    @staticmethod
    def residual_heads(config):
        """n_residual, how many residuals R_g each token has: one a head."""
        return config.n_head

    def per_head(self, R):
        """The residual each head reads, (B, S, n_residual, r) -> (B, S, H, r): residual g read by
        heads g H / n_residual on; a view, and with one residual a head R itself."""
        B, S, G, r = R.shape
        return R.unsqueeze(3).expand(B, S, G, self.n_head // G, r).flatten(2, 3)

    # Decoding: the key half (key_shapes, key_entries, keys, key_scores) and the value half
    # (value_shapes, value_entries, values, attend_values) each cache and read entries of their
    # own, so that a variant keeping one half of LRKV overrides only the other's methods
    # (test_variant.py keeps the keys and gives every head MQA's shared value)

    def cache_shapes(self):
        return {**self.key_shapes(), **self.value_shapes()}

    def decode(self, x, rope, cache):
        """forward with a cache: the new tokens' key and value entries appended, then one new
        token's attention through key_scores and attend_values, without building any cached
        position's key or value, or several tokens' through every head's keys and values."""
        q = self.queries(x, rope)
        cached = cache.update(**self.key_entries(x, rope), **self.value_entries(x))  # every position's
        keys = {name: cached[name] for name in self.key_shapes()}
        values = {name: cached[name] for name in self.value_shapes()}
        rope = cache.rope[:next(iter(cached.values())).size(1)]  # the rows of every cached position
        if x.size(1) == 1:
            scores = self.key_scores(q, **keys, rope=rope)  # (B, H, S)
            mask = cache.mask()
            if mask is not None:  # a fixed-shape cache's unwritten positions (rho 0)
                scores = scores.masked_fill(~mask, float("-inf"))
            a = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # (B, H, S)
            return self.project_out(self.attend_values(a, **values))
        # A prompt or a chunk after a prefix: q, k and v d_h wide as in training. Eq. 7's
        # [V_shared | R_h^V] is d_h + r wide: flash attention refuses a v wider than q and k, and
        # at 128M's 174 so does every fast kernel, which leaves PyTorch's math one (all T x S
        # scores at once). Building V_h costs S H r d_h multiply-adds, as rebuilding the keys does.
        return self.project_out(self.attend(q, self.keys(**keys, rope=rope), self.values(**values)))

    # the key half

    def key_shapes(self):
        return {"k_shared": (self.head_dim,), "r_k": (self.n_residual, self.lrkv_rank), "rho": (self.n_head,)}

    def key_entries(self, x, rope):
        """The new tokens' rotated K_shared, R_h^K and rho_h, the RMS of K_h that the QK norm
        divides by: Rot_s(norm(K_h)) = (Rot_s K_shared + Rot_s(R_h^K (B_h^K)^T)) / rho_h, rotation
        being linear. rho is stored in the cache's dtype, like the keys."""
        B, T, _ = x.shape
        k_shared = self.W_shared_k(x)  # (B, T, d_h)
        r_k = self.U_k(x).view(B, T, self.n_residual, self.lrkv_rank)  # (B, T, H, r)
        rho = rms(k_shared.unsqueeze(2) + self.residual(self.per_head(r_k), self.B_k))  # (B, T, H)
        return {"k_shared": apply_rope(k_shared.unsqueeze(2), rope).squeeze(2), "r_k": r_k, "rho": rho}

    def keys(self, k_shared, r_k, rho, rope):
        """Every head's normalised, rotated key at all S cached positions (rope: their rows of the
        RoPE table), as training's: (B, S, H, d_h)."""
        residual = apply_rope(self.residual(self.per_head(r_k), self.B_k), rope)  # (B, S, H, d_h)
        return (k_shared.unsqueeze(2) + residual) / rho.unsqueeze(-1)

    def key_scores_reference(self, q, k_shared, r_k, rho, rope):
        """What key_scores computes, by the plain equation: every cached key built (keys), then
        score_{h,s} = q_h . k_{h,s} / sqrt(d_h). (B, H, S); the tests compare the two."""
        k = self.keys(k_shared, r_k, rho, rope)  # (B, S, H, d_h)
        return torch.einsum("bhd,bshd->bhs", q[:, 0], k) / math.sqrt(self.head_dim)

    def key_scores(self, q, k_shared, r_k, rho, rope):
        """One new token's attention scores over all S cached positions (rope: their rows of the
        RoPE table), the softmax's input (B, H, S), exact, without building any per-head key.
        Head h's key at s is Rot_s(K_s + B_h r_{h,s}) / rho_{h,s} (K_h, then the QK norm and RoPE;
        B_h = B_h^K, r = R^K), so for the normalised, rotated query q_h

            score_{h,s} = [ q_h . Rot_s(K_s) + (B_h^T Rot_s^T q_h) . r_{h,s} ] / rho_{h,s}

        This is the paper's eq. 6, q_h K_h^T = q_h K_shared^T + (q_h B_h^K)(R_h^K)^T, made exact:
        RoPE does not commute with B_h (a rotation of d_h dims cannot pass into r dims), so the
        rotation goes into the query side, position by position. The first term is MQA's, over
        the cached rotated K_shared. In the second, RoPE turns dims i and i' = i + d_h/2 by
        s theta_i, so with B_h[i] the i-th row of B_h

            B_h^T Rot_s^T q_h = sum_i cos(s theta_i) (q_i B_h[i] + q_i' B_h[i'])
                                    + sin(s theta_i) (q_i B_h[i'] - q_i' B_h[i])

        which for every s and h at once is the (S, d_h) table [cos | sin] times a (d_h, H r)
        matrix built from q and B^K, one per sequence: a GEMM, the rebuild's S H r d_h
        multiply-adds without its (S, H, d_h) tensors and their norm and rotation. No exact form
        does less with this cache: each score needs a d_h-wide rotated residual key of which the
        cache holds r numbers. The GEMM runs over chunks of positions (_residual_key_scores), so
        that its (S, H, r) result per sequence, as large as r_k itself, never leaves the caches."""
        H, d_h, r, half = self.n_head, self.head_dim, self.lrkv_rank, self.head_dim // 2
        q = q[:, 0] / math.sqrt(d_h)  # (N, H, d_h), the softmax's scale taken in
        N = q.size(0)  # the batch size: B is B_h here
        # dims i and i' = i + d_h/2 of q_h, and rows i and i' of B_h
        q1, q2 = q.view(N, H, 2, half).permute(2, 3, 0, 1).unsqueeze(-1)  # (d_h/2, N, H, 1)
        Bk1, Bk2 = self.B_k.view(H, 2, half, r).permute(1, 2, 0, 3).unsqueeze(2)  # (d_h/2, 1, H, r)
        M = torch.stack((q1 * Bk1 + q2 * Bk2, q1 * Bk2 - q2 * Bk1))  # (2, d_h/2, N, H, r): cos, sin terms
        M = M.view(d_h, N, H * r).transpose(0, 1)  # (N, d_h, H r): rope[s] @ M[n] is every B_h^T Rot_s^T q_h
        residual_term = self._residual_key_scores(rope.to(q.dtype), M, self.per_head(r_k))  # (N, S, H)
        return torch.baddbmm(residual_term.transpose(1, 2), q, k_shared.transpose(1, 2)) / rho.transpose(1, 2)

    def _residual_key_scores(self, rope, M, r_k):
        """(B_h^T Rot_s^T q_h) . r_{h,s} for every sequence n, position s and head h: (N, S, H),
        from the RoPE rows rope (S, d_h), M (N, d_h, H r) and r_k (N, S, H, r). All at once, the
        product rope @ M[n] would be an (N, S, H, r) tensor written to memory and read back, as
        large as r_k (145 MB at N = 16, S = 8,192, 128M, fp32): on a CPU that traffic, not the
        GEMM, took most of the time. Per chunk of positions it holds 4 MB on a CPU, which stays in
        the caches (the L3 here holds 32 MB) between the GEMM and the dot product with r_k, and r_k
        is read once, in its own layout. A GPU gets 32 MB chunks, a few per step, each a few kernel
        launches (an H200's L2 holds 50 MB)."""
        N, S, H, r = r_k.shape
        chunk_bytes = 2**25 if r_k.is_cuda else 2**22
        chunk = max(1, chunk_bytes // (N * H * r * r_k.element_size()))
        # the dot product over r in place in the GEMM's fresh result: no second chunk-sized tensor
        return torch.cat([(rope[s:s + chunk] @ M).view(N, -1, H, r).mul_(r_k[:, s:s + chunk]).sum(-1)
                          for s in range(0, S, chunk)], dim=1)

    # the value half

    def value_shapes(self):
        return {"v_shared": (self.head_dim,), "r_v": (self.n_residual, self.lrkv_rank)}

    def value_entries(self, x):
        """The new tokens' V_shared (B, T, d_h) and R_h^V (B, T, H, r)."""
        B, T, _ = x.shape
        r_v = self.U_v(x).view(B, T, self.n_residual, self.lrkv_rank)
        return {"v_shared": self.W_shared_v(x), "r_v": r_v}

    def attend_values_reference(self, a, **values):
        """What attend_values computes, by the plain equation: every head's cached V_h built
        (values, of the value half's entries), then a_h V_h. (B, 1, H, d_h); the tests compare the two."""
        return torch.einsum("bhs,bshd->bhd", a, self.values(**values)).unsqueeze(1)

    def attend_values(self, a, v_shared, r_v):
        """One new token's output (B, 1, H, d_h) from its attention a (B, H, S) over the cached
        values, by eq. 7: a_h V_h = a_h V_shared + (a_h R_h^V) (B_h^V)^T, as two products so that
        V_shared is never copied per head, B_h^V applied once, to the result. The a_h R_h^V are
        one GEMM with r_v in its own layout, (H, S) by (S, n_residual r) per sequence, of which head
        h keeps its own residual's r columns: a per-head gather of r_v (einsum's) would copy all of
        it, 145 MB at B = 16, S = 8,192, 128M, fp32, where the GEMM's n_residual-fold work is one
        pass over r_v at a GEMM's speed."""
        B, H, _ = a.shape
        y_shared = (a @ v_shared).unsqueeze(1)  # (B, 1, H, d_h)
        y_all = (a @ r_v.flatten(2)).view(B, H, self.n_residual, self.lrkv_rank)  # every head by every R_g
        heads = torch.arange(H, device=a.device)
        y_res = y_all[:, heads, heads * self.n_residual // H].unsqueeze(1)  # (B, 1, H, r): a_h R_h^V
        return y_shared + self.residual(y_res, self.B_v)

    # checks, label, conversion

    @classmethod
    def check(cls, config):
        if not 1 <= config.lrkv_rank <= config.head_dim:
            config.reject("lrkv_rank", f"between 1 and head_dim = {config.head_dim}")

    @classmethod
    def legend_label(cls, config, peers):
        return f"LRKV (r={config.lrkv_rank})"

    @classmethod
    def legend_key(cls, config):
        return 1, config.lrkv_rank

    def head_kv_weights(self):
        return (self.head_weights(self.W_shared_k, self.U_k, self.B_k),
                self.head_weights(self.W_shared_v, self.U_v, self.B_v))

    def head_weights(self, W_shared, U, factor):
        """Every head's W_h = W_shared + U_h B_h^T of one half, in nn.Linear's layout, W_h^T:
        (H, d_h, d)."""
        H, d_h, r = self.n_head, self.head_dim, self.lrkv_rank
        U_t = U.weight.view(self.n_residual, r, -1).repeat_interleave(H // self.n_residual, dim=0)
        return W_shared.weight + torch.einsum("hdr,hrc->hdc", factor.view(H, d_h, r), U_t)  # U_t (H, r, d)

    def load_head_kv_weights(self, W_K, W_V, C=None):
        """W_shared = the heads' mean, U_h B_h^T = the rank-r truncated SVD of W_h - W_shared, or
        with C its whitened truncated SVD, the closest on the inputs (shared_plus_low_rank), for
        keys and values alike. With r = d_h it is every head exactly, with or without C. The mean
        stays the shared part with C too: it is the optimal single projection in the norm of any C
        (GroupedQueryAttention.load_head_kv_weights), and the residuals take what it misses."""
        self.load_head_weights(W_K, self.W_shared_k, self.U_k, self.B_k, C)
        self.load_head_weights(W_V, self.W_shared_v, self.U_v, self.B_v, C)

    def load_head_weights(self, heads, W_shared, U, factor, C):
        """One half of load_head_kv_weights, heads (H, d_h, d) in nn.Linear's layout."""
        C = None if C is None else C.to(heads.device, torch.float64)
        mean, B_h, U_t, _ = shared_plus_low_rank(heads.double(), self.lrkv_rank, C)
        W_shared.weight.copy_(mean)
        U.weight.copy_(U_t.flatten(0, 1))
        factor.copy_(B_h.flatten(0, 1))


class MultiHeadLatentAttention(Attention):
    """MLA as DeepSeek-V2: keys and values come up from a normalised latent c = norm(x W_down) of
    width d_c, per head, through W_up; one decoupled RoPE key k_R = x W_kr of width d_R, shared
    by all heads, carries position:

        k_h = [c W_up,h^K | Rot(k_R)]        v_h = c W_up,h^V

    Each q/k head is [d_h position-free dims | d_R RoPE dims], d_h + d_R wide; values are d_h
    wide. Cache per token: c, the rotated k_R and every head's key RMS rho_h (one number each),
    d_c + d_R + H. The H rhos (+3.1% at 128M) spare a single-token step from applying W_up^K to
    the whole cache for the QK norm (decode_step)."""

    def __init__(self, config, layer):
        super().__init__(config, layer, qk_dim=config.head_dim + config.rope_head_dim,
                         rope_dim=config.rope_head_dim)
        d, H, d_h = config.n_embd, config.n_head, config.head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.W_down = nn.Linear(d, self.kv_lora_rank, bias=False)
        self.W_up_k = nn.Linear(self.kv_lora_rank, H * d_h, bias=False)
        self.W_up_v = nn.Linear(self.kv_lora_rank, H * d_h, bias=False)
        self.W_kr = nn.Linear(d, self.rope_dim, bias=False)

    def forward(self, x, rope, cache=None):
        if cache is not None:
            return self.decode(x, rope, cache)
        q = self.queries(x, rope)  # (B, T, H, d_h + d_R)
        c = norm(self.W_down(x))  # (B, T, d_c)
        # Rotating part of a vector leaves its RMS unchanged, so norm-after-rotate equals the
        # queries' rotate-after-norm
        k = self.keys(c, apply_rope(self.W_kr(x).unsqueeze(2), rope))
        return self.project_out(self.attend(q, norm(k), self.values(c)))

    def keys(self, c, k_rope):
        """Every head's key before the QK norm, [c W_up,h^K | k_R]: (B, S, H, d_h + d_R)."""
        B, S = c.shape[:2]
        k_nope = self.W_up_k(c).view(B, S, self.n_head, self.head_dim)
        return torch.cat((k_nope, k_rope.expand(B, S, self.n_head, self.rope_dim)), dim=-1)

    def values(self, c):
        """Every head's value c W_up,h^V: (B, S, d_c) -> (B, S, H, d_h)."""
        return self.W_up_v(c).view(*c.shape[:2], self.n_head, self.head_dim)

    # decoding

    def cache_shapes(self):
        return {"c": (self.kv_lora_rank,), "k_rope": (1, self.rope_dim), "rho": (self.n_head,)}

    def decode(self, x, rope, cache):
        """forward with a cache: the new tokens' latent, rotated RoPE key and key RMSs appended,
        then one new token's attention through decode_step, which builds no cached key or value,
        or several tokens' through every head's keys and values rebuilt, as in training."""
        q = self.queries(x, rope)
        c = norm(self.W_down(x))
        k_rope = apply_rope(self.W_kr(x).unsqueeze(2), rope)  # (B, T, 1, d_R)
        cached = cache.update(c=c, k_rope=k_rope, rho=rms(self.keys(c, k_rope)))
        c, k_rope, rho = cached["c"], cached["k_rope"], cached["rho"]  # every position's
        if x.size(1) > 1:
            return self.project_out(self.attend(q, norm(self.keys(c, k_rope)), self.values(c), cache))
        # a_h V_h = (a_h c) W_up,h^V exactly: W_up^V applied once, to the attended latent
        y = self.decode_step(q, c, k_rope, rho, cache.mask())  # (B, 1, H, d_c)
        W_up_v = self.W_up_v.weight.view(self.n_head, self.head_dim, self.kv_lora_rank)
        return self.project_out(torch.einsum("bthc,hdc->bthd", y, W_up_v))

    def decode_step_reference(self, q, c, k_rope, rho, mask=None):
        """What decode_step computes, by the plain equation: every cached key built and divided by
        its cached RMS, then softmax(q_h . k_{h,s} / sqrt(d_h + d_R)) applied to the latent.
        (B, 1, H, d_c); the tests compare the two."""
        k = self.keys(c, k_rope) / rho.unsqueeze(-1)  # (B, S, H, d_h + d_R)
        scores = torch.einsum("bhd,bshd->bhs", q[:, 0], k) / math.sqrt(self.qk_dim)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return (torch.softmax(scores, dim=-1) @ c).unsqueeze(1)

    def decode_step(self, q, c, k_rope, rho, mask=None):
        """One new token's attention over all S cached positions (mask: which of them it may
        see, None for all), exact, without building any key. Head h's key at s is
        [c_s W_up,h^K | k_R,s] / rho_{h,s}, rho the RMS of that concatenation, cached when s was
        new, so for the normalised, rotated query q_h = [q_h^nope | q_h^R]

            score_{h,s} = [ (q_h^nope (W_up,h^K)^T) . c_s + q_h^R . k_R,s ] / rho_{h,s}

        The first term is absorbed into the latent, as DeepSeek-V2 absorbs it: the scores cost
        d_c + d_R per head and position instead of d_h + d_R, and read only the cache. Without
        the cached rho, every step would apply W_up^K to the whole cache again (S d_c H d_h
        multiply-adds), just for the norm. Returns a_h c: (B, 1, H, d_c)."""
        H, d_h = self.n_head, self.head_dim
        q_nope, q_rope = q[:, 0].split((d_h, self.rope_dim), dim=-1)  # (B, H, d_h), (B, H, d_R)
        W_up_k = self.W_up_k.weight.view(H, d_h, self.kv_lora_rank)
        q_latent = (q_nope.unsqueeze(2) @ W_up_k).squeeze(2)  # (B, H, d_c)
        rope_term = q_rope @ k_rope[:, :, 0].transpose(1, 2)  # (B, H, S)
        scores = torch.baddbmm(rope_term, q_latent, c.transpose(1, 2))  # (B, H, S)
        scores = scores / (rho.transpose(1, 2) * math.sqrt(self.qk_dim))
        if mask is not None:  # a fixed-shape cache's unwritten positions (rho 0)
            scores = scores.masked_fill(~mask, float("-inf"))
        a = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # (B, H, S)
        return (a @ c).unsqueeze(1)

    # checks, label, analysis, conversion

    @classmethod
    def check(cls, config):
        if config.kv_lora_rank < 1:
            config.reject("kv_lora_rank", "a positive integer")
        if not (2 <= config.rope_head_dim <= config.head_dim and config.rope_head_dim % 2 == 0):
            config.reject("rope_head_dim", f"even, from 2 to head_dim = {config.head_dim}")

    @classmethod
    def legend_label(cls, config, peers):
        # d_c only where it tells the MLA runs apart
        several = len({peer.kv_lora_rank for peer in peers}) > 1
        return f"MLA (d_c={config.kv_lora_rank})" if several else "MLA"

    @classmethod
    def legend_key(cls, config):
        return 3, config.kv_lora_rank

    def head_key_weights(self):
        """(H, d, d_h + d_R): head h's key is x @ Wk[h] before the QK norm and RoPE, the latent's
        norm taken as identity. diversity.py's: MLA gives no per-head projections to convert."""
        W_up_k = self.W_up_k.weight.view(self.n_head, self.head_dim, self.kv_lora_rank)
        Wk_nope = torch.einsum("cx,hnc->hxn", self.W_down.weight, W_up_k)
        Wk_rope = self.W_kr.weight.t().expand(self.n_head, -1, -1)
        return torch.cat((Wk_nope, Wk_rope), dim=-1)

    def load_head_kv_weights(self, W_K, W_V, C=None):
        # MHA2MLA (Ji et al., 2025) first uptrains the source with RoPE on a few frequencies only
        raise ValueError("MLA is not converted to: its keys' d_h position-free dims need keys that RoPE "
                         "leaves alone, and per-head keys rotate every dim (docs/convert.md)")


# The variants, by the name that GPTConfig.attn (--attn) takes: the only list of them
ATTENTION = {
    "mha": MultiHeadAttention,
    "mqa": MultiQueryAttention,
    "gqa": GroupedQueryAttention,
    "mla": MultiHeadLatentAttention,
    "lrkv": LowRankKVAttention,
}


# -----------------------------------------------------------------------------
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
        self.attn = ATTENTION[config.attn](config, layer)
        self.mlp = MLP(config)

    def forward(self, x, rope, cache=None):
        x = x + self.attn(norm(x), rope, cache)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # one RoPE table for every layer, as wide as each q/k head's rotated part (Attention.rope_dim)
        rope = rope_table(self.blocks[0].attn.rope_dim, config.block_size, config.rope_theta)
        self.register_buffer("rope", rope, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """nanochat's init: unit-variance embeddings, a near-zero unembedding, inputs of every
        matrix at the variance of a 1/sqrt(fan_in) uniform, and zero output projections so that
        each block starts as the identity. Each attention layer zeroes its own W_o and draws what
        else it holds (Attention.reset_parameters), in layer order after all the rest: the RNG's
        order of draws is what makes a seed's init."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                bound = math.sqrt(3 / module.in_features)
                nn.init.uniform_(module.weight, -bound, bound)
        nn.init.normal_(self.wte.weight, std=1.0)
        nn.init.normal_(self.lm_head.weight, std=0.001)
        for block in self.blocks:
            block.attn.reset_parameters()  # zeroes W_o, then draws what else the variant holds
            nn.init.zeros_(block.mlp.W_out.weight)

    def forward(self, idx, targets=None, caches=None):
        """Logits (B, T, vocab) in fp32, and the mean cross-entropy if targets are given.
        With caches (one KVCache per layer, see new_caches), idx continues the cached prefix."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size = {self.config.block_size}")
        rope = caches[0].next_rope(T) if caches else self.rope[:T]  # the rows of idx's positions
        x = norm(self.wte(idx))
        for block, cache in zip(self.blocks, caches or [None] * len(self.blocks)):
            x = block(x, rope, cache)
        logits = self.lm_head(norm(x)).float()
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)

    def get_num_params(self):
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len=None):
        """Training FLOPs per token, forward and backward: 6 per weight of every matmul (each
        variant's own projections; the embedding is a lookup, not a matmul) plus 6 per
        multiply-add of attention itself, q k^T and a v over seq_len keys, as each layer counts
        them (Attention.attention_macs: no discount for the causal mask, the usual convention
        for MFU)."""
        T = seq_len or self.config.block_size
        matmul_params = self.get_num_params() - self.wte.weight.numel()
        return 6 * matmul_params + 6 * sum(block.attn.attention_macs(T) for block in self.blocks)

    # decoding

    def new_caches(self, batch_size, max_len, dtype=None, device=None):
        """One empty KVCache per layer for batch_size sequences of up to max_len tokens, in dtype,
        by default the weights' (a CPU without bf16 instructions emulates bf16, slowly: a caller
        that wants it says so)."""
        dtype = self.wte.weight.dtype if dtype is None else dtype
        device = self.wte.weight.device if device is None else device
        if max_len > self.config.block_size:  # the RoPE table has block_size rows
            raise ValueError(f"a KV cache of {max_len} tokens exceeds block_size = {self.config.block_size}")
        return [KVCache(batch_size, max_len, block.attn.cache_shapes(), dtype, device, self.rope[:max_len])
                for block in self.blocks]

    def kv_cache_bytes(self, batch_size, seq_len, dtype=None):
        """Bytes the decoding caches allocate, counted off the same caches built on the meta device."""
        caches = self.new_caches(batch_size, seq_len, dtype, device="meta")
        return sum(buf.numel() * buf.element_size() for cache in caches for buf in cache.buffers())

    def kv_cache_elements_per_token(self):
        """Cached elements per token, summed over the layers: n_layer 2 H d_h for MHA ..."""
        return sum(math.prod(shape) for block in self.blocks for shape in block.attn.cache_shapes().values())

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True, step=None,
                 vocab_size=None):
        """idx (B, T) continued by max_new_tokens sampled tokens: (B, T + max_new_tokens)."""
        new = self.stream(idx, max_new_tokens, temperature, top_k, use_cache, step, vocab_size)
        return torch.cat([idx, *new], dim=1)

    @torch.no_grad()
    def stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True, step=None,
               vocab_size=None):
        """Yield the max_new_tokens tokens (B, 1) that continue idx (B, T), one at a time, each as
        soon as it is drawn; temperature 0 is greedy. The model sees a context of at most
        block_size tokens, the last ones: a longer prompt is cropped to them, as nanoGPT's
        sample.py crops it, and a context that would outgrow block_size starts again from its most
        recent half. With the cache the context is read once (prefill) and then one token is fed
        per step; without it every step reads the whole context again. step(model, token,
        caches): what feeds each token after a prefill and returns its logits (B, vocab), by
        default the model itself (fast_decode.compiled_decode: the same step compiled).
        vocab_size: draw only ids below it, the tokenizer's, where the model's vocabulary is
        padded past it (GPT-2's 50257 to 50304)."""
        if step is not None and not use_cache:
            raise ValueError("a step feeds the KV cache: it needs use_cache=True")
        L = self.config.block_size
        # Past L, the context keeps its last L - L // 2 tokens (half, rounded up), through fresh
        # caches and a prefill of them. Keeping k tokens prefills k every L - k + 1 new tokens, about
        # one prefill token per generated token at half, and every token still sees at least half a
        # context; keeping more would cost more, fewer would leave the model less to see. Without
        # the cache the context is cropped at the same points: both see the same tokens.
        keep = L - L // 2
        start = max(0, idx.size(1) - L)  # where the context begins in idx
        max_len = min(L, idx.size(1) + max_new_tokens)  # every cache's: the longest the context gets
        device = idx.device.type
        autocast = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else self.lm_head.weight.dtype
        caches = None
        for _ in range(max_new_tokens):
            if idx.size(1) - start > L:
                start, caches = idx.size(1) - keep, None
            if caches is None:  # the whole context: the prompt, a new start, or any step without the cache
                caches = self.new_caches(idx.size(0), max_len, dtype) if use_cache else None
                logits = self(idx[:, start:], caches=caches)[0][:, -1]
            elif step is not None:
                logits = step(self, idx[:, -1:], caches)
            else:
                logits = self(idx[:, -1:], caches=caches)[0][:, -1]
            logits = logits[:, :vocab_size]
            if temperature == 0:
                next_token = logits.argmax(dim=-1, keepdim=True)
            else:
                # from the largest logit down, in fp32, so that a temperature too small for floating
                # point sends every other logit to -inf, leaving the likeliest token (greedy): the
                # logits themselves would overflow to inf, and softmax to nan. Below fp32's smallest
                # normal number a temperature would round to 0: it divides by that number instead.
                logits = logits.float()
                tiny = torch.finfo(torch.float32).tiny
                logits = (logits - logits.amax(-1, keepdim=True)) / max(temperature, tiny)
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, next_token), dim=1)
            yield next_token


# -----------------------------------------------------------------------------
# Decoding memory

class KVCache(nn.Module):
    """One layer's decoding memory: a (B, max_len, *shape) buffer per cached name, filled up to
    pos, and rope, the (max_len, rope_dim) RoPE table of its positions. It grows by what it is
    given (a prompt, a chunk, a token): update appends it and returns every position's entries so
    far, all of which the new tokens may see, causally (mask() is None). fast_decode.py turns
    filled caches into fixed-shape ones for torch.compile, with the same three methods."""

    def __init__(self, batch_size, max_len, shapes, dtype, device=None, rope=None):
        super().__init__()
        self.pos, self.max_len, self.rope = 0, max_len, rope
        for name, shape in shapes.items():
            buf = torch.zeros(batch_size, max_len, *shape, dtype=dtype, device=device)
            self.register_buffer(name, buf, persistent=False)

    def next_rope(self, T):
        """The RoPE rows (T, rope_dim) of the next T positions, which update will fill."""
        if self.pos + T > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens, {self.pos + T} were asked for")
        return self.rope[self.pos:self.pos + T]

    def mask(self):
        """Which of the positions update returns the new tokens may see: here all, causally."""
        return None

    def update(self, **new):
        """Append the new tokens' entries; return every name's entries so far, {name: (B, pos, *shape)},
        in the caller's dtype."""
        end = self.pos + next(iter(new.values())).size(1)
        out = {}
        for name, x in new.items():
            buf = getattr(self, name)
            buf[:, self.pos:end] = x
            out[name] = buf[:, :end].to(x.dtype)
        self.pos = end
        return out


# -----------------------------------------------------------------------------
# Conversion's math: LRKV's closest shared-plus-low-rank factors (convert.py, analyze.py)

def shared_plus_low_rank(W, r, C=None):
    """H per-head projections as W_h = W_shared + U_h B_h^T, all in nn.Linear's layout: W (H, d_h, d)
    holds the W_h^T; returns W_shared^T (d_h, d), their mean, and each head's rank-r residual as
    B (H, d_h, r) and U^T (H, r, d), B_h U_h^T the closest to its deviation D_h = W_h^T - W_shared^T
    in one of two norms; also the singular values S (H, d_h) of the D_h in that norm, largest first.
    - Without C, Frobenius: the residual is the truncated SVD of D_h (Eckart-Young).
    - With C, the (d, d) covariance E[x x^T] of the heads' inputs, the error on those inputs,
      E||(D_h - B_h U_h^T) x||^2 = ||(D_h - B_h U_h^T) C^(1/2)||_F^2: the residual is the truncated SVD
      P_r S_r Q_r^T of D_h C^(1/2) mapped back by C^(-1/2) (whitened, as SVD-LLM, Palu and CARE
      compress k_proj and v_proj), and it misses by the singular values of D_h C^(1/2) it drops.
    Both are P_r P_r^T D_h, P_r the top r left singular vectors of D_h as the norm sees it
    (P_r S_r Q_r^T C^(-1/2) = P_r P_r^T D_h C^(1/2) C^(-1/2)), which needs no inverse of C. A
    singular C, with directions the inputs never take, has none; along such a direction every
    residual is as good as another on the inputs, and P_r P_r^T D_h is the one closest to D_h (it
    keeps D_h's part in the r output directions kept), so r = d_h stays exact, where a
    pseudo-inverse would drop that part and an eigenvalue floor would change the answer.
    Each singular value of the residual is split evenly, sqrt into both factors: their product
    does not care, and balanced factors have equal norms, so an optimiser that uptrains them
    moves each by the same share of itself."""
    mean = W.mean(0)
    D = W - mean  # (H, d_h, d)
    if C is not None:
        eigenvalues, V = torch.linalg.eigh(C)
        # a dead direction's eigenvalue 0 comes out of eigh as +-rounding: sqrt needs it >= 0
        seen = D @ (V * eigenvalues.clamp(min=0).sqrt() @ V.mT)  # (H, d_h, d): D_h C^(1/2)
    P, S, _ = torch.linalg.svd(D if C is None else seen, full_matrices=False)  # (H, d_h, d_h), (H, d_h)
    P_r = P[..., :r]
    # P_r^T D_h = Y sigma Z^T: (H, r, r), (H, r), (H, r, d)
    Y, sigma, Zt = torch.linalg.svd(P_r.mT @ D, full_matrices=False)
    root = sigma.sqrt()
    return mean, P_r @ Y * root[:, None, :], root[..., None] * Zt, S

