"""
One GPT, five ways to attend: MHA, GQA, MQA, MLA and LRKV (Low-Rank Key-Value attention), on the
paper's 128M backbone (nanochat's): RoPE, parameter-free RMSNorm before every sublayer and on
queries and keys, a ReLU^2 MLP, untied embeddings, no biases. Only keys and values differ.
Read top-down: the config, norm and RoPE, Attention, the five variants (docstring: math; forward:
training; cache entries: what decoding keeps), GPT, KVCache. lib/decode.py: the exact single-token steps.
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
    gta_kv_heads: int = 3  # gta: tied key-value heads G, each read by n_head // G query heads (GQA's G)
    gla_latent_heads: int = 2  # gla: latent heads, each read by n_head // them query heads (GLA-2)
    gla_latent_dim: int = 256  # gla: width d_c of each latent head, 2 d_h (GLA-2's 2 x 2 d_h = MLA's 4 d_h)
    tpa_q_rank: int = 6  # tpa: rank R_Q of the queries' sum of outer products (TPA's R_Q = 6)
    tpa_kv_rank: int = 2  # tpa: rank R_K = R_V of the keys' and the values' (TPA's R_K = R_V = 2)
    mlra_latent_heads: int = 4  # mlra: latent heads, each read by every query head (MLRA-4)
    mlra_latent_dim: int = 128  # mlra: width of each latent head, d_h (MLRA-4's 4 x d_h = MLA's 4 d_h)
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
            self.reject("rope_theta", "a finite number > 1 (RoPE's frequencies theta^(-2i/d) fall from 1)")
        if self.n_embd != self.n_head * self.head_dim:
            self.reject("n_embd", f"n_head * head_dim = {self.n_head} * {self.head_dim}")
        ATTENTION[self.attn].check(self)

    def reject(self, field, allowed):
        raise ValueError(f"GPTConfig.{field} = {getattr(self, field)!r}: must be {allowed}")


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def rms(x):
    """x / rms(x)[..., None] = norm(x): as F.rms_norm, in fp32 and fp32's eps (bf16's swamps small keys)."""
    x_hi = x.to(torch.promote_types(x.dtype, torch.float32))
    return x_hi.pow(2).mean(-1).add(torch.finfo(x_hi.dtype).eps).sqrt().to(x.dtype)


def rope_table(dim, max_len, theta):
    """(max_len, dim): row s is [cos(s theta_i) | sin(s theta_i)], for the dim / 2 frequencies theta_i."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x, rope):
    """Rotate x's (B, T, heads, D) last rope.size(-1) dims, i with i + half; its T are rope's last T rows."""
    cos, sin = rope[-x.size(1):, None, :].to(x.dtype).chunk(2, dim=-1)
    x_pass, x1, x2 = x.split((x.size(-1) - 2 * cos.size(-1), cos.size(-1), cos.size(-1)), dim=-1)
    return torch.cat((x_pass, x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


# The attention variants

class Attention(nn.Module):
    """H full-rank query heads W_q, the output projection W_o and causal softmax attention. A variant
    (in ATTENTION, built as cls(config, layer)) defines cache_shapes() {name: shape} of a token,
    cache_entries(x, rope) {name: (B, T, *shape)} of the new tokens, and keys_values(rope, **cached),
    every cached position's normalised, rotated keys (B, S, G, qk_dim) and values (B, S, G, head_dim),
    head h reading h G // H, which forward attends over, training and cached (LRKV and MLA train
    without their key RMS: own forward). RoPE turns the last rope_dim dims; every parameter is a
    matrix (Muon's). Optional: check, reset_parameters, attention_macs (README: Adding a variant)."""

    def __init__(self, config, layer, qk_dim=None, rope_dim=None):
        super().__init__()
        self.layer, self.n_head, self.head_dim = layer, config.n_head, config.head_dim
        self.qk_dim = qk_dim or config.head_dim
        self.rope_dim = rope_dim or config.head_dim
        self.W_q = nn.Linear(config.n_embd, config.n_head * self.qk_dim, bias=False)
        self.W_o = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)

    def forward(self, x, rope, cache=None):
        """W_o of the attention of x (B, T, d) at rope's positions; with a cache, after its prefix."""
        q, new = self.queries(x, rope), self.cache_entries(x, rope)
        y = self.attend(q, *self.keys_values(rope, **new)) if cache is None else cache.attend(self, q, new)
        return self.W_o(y.flatten(2))

    def queries(self, x, rope):
        B, T, _ = x.shape
        return apply_rope(norm(self.W_q(x).view(B, T, self.n_head, self.qk_dim)), rope)  # (B, T, H, d_qk)

    def attend(self, q, k, v):
        """softmax(q k^T / sqrt(d_qk)) v: q (B, T, H, d_qk), k, v (B, S, H or G, d_qk | d_v), q the last T."""
        T, S = q.size(1), k.size(1)
        mask = None
        if T not in (1, S):  # a chunk after a cached prefix sees all of it
            mask = torch.arange(S, device=q.device) <= torch.arange(S - T, S, device=q.device)[:, None]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        gqa = k.size(1) != q.size(1)  # SDPA reads each of G key/value heads for H/G query heads
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                           enable_gqa=gqa)
        return y.transpose(1, 2)

    @classmethod
    def check(cls, config: "GPTConfig") -> None:
        """Reject (config.reject) a knob of the variant's own that it cannot be built with."""

    def reset_parameters(self) -> None:
        """Zero W_o (the block starts as the identity); a variant draws its others after super()."""
        nn.init.zeros_(self.W_o.weight)

    def attention_macs(self, seq_len: int) -> int:
        """Multiply-adds per token, forward, of q k^T and a v over seq_len keys, all heads."""
        return self.n_head * (self.qk_dim + self.head_dim) * seq_len


class GroupedQueryAttention(Attention):
    """GQA: G = config.n_kv_head key/value heads K_g = X W_g^K, V_g = X W_g^V, query head h reading
    g = h G // H; MHA (G = H) and MQA (G = 1) change kv_heads alone. Cache: 2 G d_h, training's keys."""

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

    def cache_shapes(self):
        return {"k": (self.n_kv_head, self.head_dim), "v": (self.n_kv_head, self.head_dim)}

    def cache_entries(self, x, rope):
        B, T, _ = x.shape
        k = apply_rope(norm(self.W_k(x).view(B, T, self.n_kv_head, self.head_dim)), rope)  # (B, T, G, d_h)
        return {"k": k, "v": self.W_v(x).view(B, T, self.n_kv_head, self.head_dim)}

    def keys_values(self, rope, k, v):
        return k, v


class MultiHeadAttention(GroupedQueryAttention):
    """Standard MHA: every query head has a key/value head of its own (G = H)."""
    kv_heads = staticmethod(lambda config: config.n_head)


class MultiQueryAttention(GroupedQueryAttention):
    """MQA: one key/value head shared by all query heads (G = 1)."""
    kv_heads = staticmethod(lambda config: 1)


class LowRankKVAttention(Attention):
    """LRKV: every head's key and value projections are one matrix shared by all heads plus a
    rank-r residual of the head's own (the paper's eq. 6 and 7),

        W_h^K = W_shared^K + U_h^K (B_h^K)^T        W_h^V = W_shared^V + U_h^V (B_h^V)^T

    W_shared (d, d_h), U_h (d, r), B_h (d_h, r), so that for the inputs X (T, d)

        K_h = X W_shared^K + (X U_h^K)(B_h^K)^T = K_shared + R_h^K (B_h^K)^T

    and V_h likewise; training builds every K_h and V_h and attends as MHA does. The cache holds
    the rotated K_shared, V_shared and every R_h^K, R_h^V, the paper's 2 d_h + 2 H r per token, and
    each head's key RMS rho_h (+0.7% at 128M): Rot_s(norm(K_h)) = (Rot_s K_shared + Rot_s(R_h^K
    (B_h^K)^T)) / rho_h, so decode.py's step (eq. 6, 7) builds no cached key or value. r = 0 is MQA.
    Weights are nn.Linear's transposes: U_k.weight the (U_h^K)^T stacked, B_k the B_h^K stacked."""

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

    def forward(self, x, rope, cache=None):
        if cache is not None:
            return super().forward(x, rope, cache)
        # x's gradient sums its five projections' in the reverse of this order: a seed's run depends on it
        q = self.queries(x, rope)  # (B, T, H, d_h)
        k_shared, v_shared = self.W_shared_k(x), self.W_shared_v(x)  # (B, T, d_h): X W_shared
        r_k, r_v = self.residual_factor(self.U_k, x), self.residual_factor(self.U_v, x)  # (B, T, H, r)
        k = k_shared.unsqueeze(2) + self.residual(r_k, self.B_k)  # (B, T, H, d_h): K_h
        return self.W_o(self.attend(q, apply_rope(norm(k), rope), self.values(v_shared, r_v)).flatten(2))

    def residual_factor(self, U, x):
        """R_h = X U_h of every head, U being U_k or U_v: (B, T, d) -> (B, T, H, r)."""
        return U(x).view(*x.shape[:2], -1, self.lrkv_rank)

    def residual(self, R, factor):
        """Every head's R_h B_h^T, factor being B_k or B_v: (B, S, H, r) -> (B, S, H, d_h)."""
        return torch.einsum("bshr,hdr->bshd", R, factor.view(self.n_head, self.head_dim, self.lrkv_rank))

    def head_keys(self, x):
        """K_shared (B, T, d_h), R^K (B, T, H, r) and every head's K_h (B, T, H, d_h), before the QK norm."""
        k_shared, r_k = self.W_shared_k(x), self.residual_factor(self.U_k, x)
        return k_shared, r_k, k_shared.unsqueeze(2) + self.residual(r_k, self.B_k)

    def values(self, v_shared, r_v):
        """Every head's V_h = V_shared + R_h^V (B_h^V)^T: (B, S, d_h), (B, S, H, r) -> (B, S, H, d_h)."""
        return v_shared.unsqueeze(2) + self.residual(r_v, self.B_v)

    def cache_shapes(self):
        H, d_h, r = self.n_head, self.head_dim, self.lrkv_rank
        return {"k_shared": (d_h,), "r_k": (H, r), "rho": (H,), "v_shared": (d_h,), "r_v": (H, r)}

    def cache_entries(self, x, rope):
        k_shared, r_k, k = self.head_keys(x)  # rho: the RMS of K_h that the QK norm divides by
        return {"k_shared": apply_rope(k_shared.unsqueeze(2), rope).squeeze(2), "r_k": r_k, "rho": rms(k),
                "v_shared": self.W_shared_v(x), "r_v": self.residual_factor(self.U_v, x)}

    def keys(self, k_shared, r_k, rho, rope):
        """Every head's normalised, rotated key at the S cached positions, as training's: (B, S, H, d_h)."""
        residual = apply_rope(self.residual(r_k, self.B_k), rope)  # (B, S, H, d_h)
        return (k_shared.unsqueeze(2) + residual) / rho.unsqueeze(-1)

    def keys_values(self, rope, k_shared, r_k, rho, v_shared, r_v):
        # V_h, not eq. 7's [V_shared | R_h^V], d_h + r wide, which flash attention refuses
        return self.keys(k_shared, r_k, rho, rope), self.values(v_shared, r_v)


class MultiHeadLatentAttention(Attention):
    """MLA as DeepSeek-V2: keys and values come up per head, through W_up, from a normalised latent
    c = norm(x W_down) of width d_c; one decoupled RoPE key k_R = x W_kr of width d_R, shared by all
    heads, carries position:

        k_h = [c W_up,h^K | Rot(k_R)]        v_h = c W_up,h^V

    q/k heads d_h + d_R wide. Cache per token: c, the rotated k_R and each head's key RMS (+3.1%),
    which spares decode.py's step (W_up^K absorbed into the query) applying W_up^K to the cache."""

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

    def forward(self, x, rope, cache=None):
        if cache is not None:
            return super().forward(x, rope, cache)
        q = self.queries(x, rope)  # (B, T, H, d_h + d_R)
        c = norm(self.W_down(x))  # (B, T, d_c)
        # rotating leaves the RMS unchanged: norm-after-rotate is the queries' rotate-after-norm
        k = self.keys(c, apply_rope(self.W_kr(x).unsqueeze(2), rope))
        return self.W_o(self.attend(q, norm(k), self.values(c)).flatten(2))

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

    def cache_shapes(self):
        return {"c": (self.kv_lora_rank,), "k_rope": (1, self.rope_dim), "rho": (self.n_head,)}

    def cache_entries(self, x, rope):
        c = norm(self.W_down(x))
        k_rope = apply_rope(self.W_kr(x).unsqueeze(2), rope)  # (B, T, 1, d_R)
        return {"c": c, "k_rope": k_rope, "rho": rms(self.keys(c, k_rope))}

    def keys_values(self, rope, c, k_rope, rho):
        return self.keys(c, k_rope) / rho.unsqueeze(-1), self.values(c)


# The variants, by the name that GPTConfig.attn (--attn) takes; lib/rivals.py adds its four (lib/__init__.py)
ATTENTION = {"mha": MultiHeadAttention, "mqa": MultiQueryAttention, "gqa": GroupedQueryAttention,
             "mla": MultiHeadLatentAttention, "lrkv": LowRankKVAttention}


def registered(table, attn):
    """table's entry for attn's class or its nearest parent (MRO), else None: decode.py's, convert.py's."""
    return next((table[cls] for cls in type(attn).__mro__ if cls in table), None)


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
        rope = rope_table(self.blocks[0].attn.rope_dim, config.block_size, config.rope_theta)  # every layer's
        self.register_buffer("rope", rope, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """nanochat's init: unit-variance embeddings, a near-zero unembedding, every matrix 1/sqrt(fan_in)
        uniform, zero output projections; each attention layer's draws last (a seed's init: the order)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                bound = math.sqrt(3 / module.in_features)  # variance 1 / fan_in
                nn.init.uniform_(module.weight, -bound, bound)
        nn.init.normal_(self.wte.weight, std=1.0)
        nn.init.normal_(self.lm_head.weight, std=0.001)
        for block in self.blocks:
            block.attn.reset_parameters()  # zeroes W_o, then draws what else the variant holds
            nn.init.zeros_(block.mlp.W_out.weight)

    def forward(self, idx, targets=None, caches=None):
        """Logits (B, T, vocab) in fp32 and, given targets, the loss; with caches, after their prefix."""
        T = idx.size(1)
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
        """Training FLOPs a token: 6 a matmul weight (not wte's), 6 an attention_macs (MFU's: not causal)."""
        T = seq_len or self.config.block_size
        matmul_params = self.get_num_params() - self.wte.weight.numel()
        return 6 * matmul_params + 6 * sum(block.attn.attention_macs(T) for block in self.blocks)

    def new_caches(self, batch_size, max_len, dtype=None, device=None):
        """One empty KVCache per layer for batch_size sequences of max_len tokens, dtype the weights'."""
        dtype, device = dtype or self.wte.weight.dtype, device or self.wte.weight.device
        if max_len > self.config.block_size:  # the RoPE table has block_size rows
            raise ValueError(f"a KV cache of {max_len} tokens exceeds block_size = {self.config.block_size}")
        return [KVCache(batch_size, max_len, block.attn.cache_shapes(), dtype, device, self.rope[:max_len])
                for block in self.blocks]

    def kv_cache_bytes(self, batch_size, seq_len, dtype=None):
        """Bytes the decoding caches allocate, counted off the same caches built on the meta device."""
        caches = self.new_caches(batch_size, seq_len, dtype, device="meta")
        return sum(buf.numel() * buf.element_size() for cache in caches for buf in cache.buffers())

    def kv_cache_elements_per_token(self):
        """Cached elements per token, summed over the layers (n_layer 2 H d_h for MHA)."""
        return sum(math.prod(shape) for block in self.blocks for shape in block.attn.cache_shapes().values())

    def last_logits(self, token, caches):
        """The plain cached step: the logits (B, vocab) of token (B, 1) after the cached prefix."""
        return self(token, caches=caches)[0][:, -1]

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True, step=None,
                 vocab_size=None):
        """idx (B, T) continued by max_new_tokens sampled tokens: (B, T + max_new_tokens)."""
        new = self.stream(idx, max_new_tokens, temperature, top_k, use_cache, step, vocab_size)
        return torch.cat([idx, *new], dim=1)

    @torch.no_grad()
    def stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True, step=None,
               vocab_size=None):
        """Yield the max_new_tokens tokens (B, 1) that continue idx (B, T) as drawn (temperature 0: greedy),
        from the last block_size tokens, from their recent half when they would outgrow them; cached, each
        token fed by step(model, token, caches) -> logits (default GPT.last_logits). vocab_size: ids below."""
        if step is not None and not use_cache:
            raise ValueError("a step feeds the KV cache: it needs use_cache=True")
        L = self.config.block_size
        # k kept past L: a prefill of k every L - k + 1 tokens; at half, ~1 a token, each sees half a context
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
            else:
                logits = (step or GPT.last_logits)(self, idx[:, -1:], caches)
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


class KVCache(nn.Module):
    """One layer's decoding memory: a (B, max_len, *shape) buffer a name, filled to pos; rope: their rows."""

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

    def update(self, **new):
        """Append the new tokens' entries; return all so far, {name: (B, pos, *shape)}, in their dtype."""
        end = self.pos + next(iter(new.values())).size(1)
        for name, x in new.items():
            getattr(self, name)[:, self.pos:end] = x
        self.pos = end
        return {name: getattr(self, name)[:, :end].to(x.dtype) for name, x in new.items()}

    def attend(self, attn, q, new):
        """The plain cached path: append new, then attend q over every position's keys_values so far."""
        cached = self.update(**new)
        return attn.attend(q, *attn.keys_values(self.rope[:self.pos], **cached))
