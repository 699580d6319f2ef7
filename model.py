"""One GPT, five ways to attend: MHA, GQA, MQA, MLA and LRKV (Low-Rank Key-Value attention), on the paper's
128M backbone (nanochat's: RoPE, weightless RMSNorm on the embeddings, before each sublayer and on queries
and keys, ReLU^2 MLP, untied embeddings, no biases). Training, then decoding; symbols: README's notation."""

import importlib
import math
from dataclasses import dataclass, fields

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
    cla: int = 1  # cla, yoco, window, window_pattern: lib/attention/layout.py's (shared keys, windows)
    yoco: bool = False
    window: int | None = None
    window_pattern: str = "SSSL"
    n_kv_head: int = 3  # gqa: key/value heads G, each shared by n_head // G query heads
    kv_lora_rank: int = 128  # mla: width d_c of the cached latent
    rope_head_dim: int = 64  # mla: width d_R of the decoupled RoPE key shared by all heads
    lrkv_rank: int = 46  # lrkv: rank r of each head's residual U_h B_h^T
    rope_theta: float = 10000.0
    gta_kv_heads: int = 3  # gta ... mlra: the rivals' knobs (lib/attention/rivals.py), papers' defaults
    gla_latent_heads: int = 2
    gla_latent_dim: int = 256
    tpa_q_rank: int = 6
    tpa_kv_rank: int = 2
    mlra_latent_heads: int = 4
    mlra_latent_dim: int = 128

    def __post_init__(self):  # every field checked (check_config, at the file's end, which a reader may skip)
        check_config(self)

    def reject(self, field, allowed):
        raise ValueError(f"--{field}={getattr(self, field)!r}: must be {allowed}")


def norm(x):
    return F.rms_norm(x, (x.size(-1),))  # x / rms(x) over the last dim: RMSNorm without a weight


def rms(x):
    """norm's divisor sqrt(mean(x^2) + eps), (...,) of x (..., D), computed in fp32 as F.rms_norm does."""
    x_hi = x.to(torch.promote_types(x.dtype, torch.float32))
    return x_hi.pow(2).mean(-1).add(torch.finfo(x_hi.dtype).eps).sqrt().to(x.dtype)


def rope_table(dim, max_len, theta):
    """(max_len, dim): row s is [cos(s theta_i) | sin(s theta_i)], theta_i = theta^(-2i/dim), i < dim / 2."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x, rope):
    """RoPE on x (B, T, heads, D) by rope's rows (T, rope_dim), one per token (or (B, T, rope_dim): each row
    its own): x's last rope_dim dims are two halves x1, x2, and each pair (x1_i, x2_i) turns by
    -s theta_i, s the token's position (nanochat's sign; scores see relative positions alone, either way)."""
    half = rope.size(-1) // 2
    cos, sin = rope.unsqueeze(-2).to(x.dtype).chunk(2, dim=-1)  # (..., T, 1, half) each: the same every head
    x_pass, x1, x2 = x.split((x.size(-1) - 2 * half, half, half), dim=-1)  # the first D - rope_dim dims pass
    return torch.cat((x_pass, x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


class Attention(nn.Module):
    """What every variant shares: H query heads q_h = Rot(norm(x W_h^Q)), causal softmax attention, W_o. A
    variant defines keys_values(x, rope): keys (B, T, G, d_qk), values (B, T, G, d_v = d_h) of its G heads."""

    def __init__(self, config, layer, qk_dim=None, rope_dim=None):
        super().__init__()
        self.layer, self.n_head, self.head_dim = layer, config.n_head, config.head_dim
        self.qk_dim = qk_dim or config.head_dim  # d_qk: a query or key head's width
        self.rope_dim = rope_dim or config.head_dim  # the last dims of a q/k head that RoPE turns (MLA: d_R)
        self.W_q = nn.Linear(config.n_embd, config.n_head * self.qk_dim, bias=False)
        self.W_o = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)

    def forward(self, x, rope, memory=None):
        """x (B, T, d), rope its rows. memory: None in training (causal over its own keys), else a KVCache
        (decoding) or a layout's (layout.py: --cla, --yoco, --window), whose attend finds the keys."""
        q = self.queries(x, rope)  # (B, T, H, d_qk)
        y = self.attend(q, *self.keys_values(x, rope)) if memory is None else memory.attend(self, q, x, rope)
        return self.W_o(y.flatten(2))

    def queries(self, x, rope):
        B, T, _ = x.shape
        return apply_rope(norm(self.W_q(x).view(B, T, self.n_head, self.qk_dim)), rope)  # (B, T, H, d_qk)

    def attend(self, q, k, v, mask=None):
        """softmax(q k^T / sqrt(d_qk)) v of q (B, T, H, d_qk), k (B, S, G, d_qk), v (B, S, G, d_v), head h
        reading head h G // H, where mask (T, S), (B, 1, T, S) allows (none: causal, T = S, or all: T = 1)."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.to(q.device),
                                           is_causal=mask is None and q.size(2) > 1,
                                           enable_gqa=k.size(1) != q.size(1))
        return y.transpose(1, 2)  # (B, T, H, d_v)

    # Decoding (KVCache.attend). A variant's cache_shapes(): {name: shape}, what a token leaves in the cache;
    # cache_entries(x, rope): the T new tokens' entries {name: (B, T, *shape)}, rope their T rows (by default
    # k and v); cached_keys_values(rope, **entries): keys and values rebuilt from S positions, rope S rows.

    def cache_entries(self, x, rope):
        k, v = self.keys_values(x, rope)
        return {"k": k, "v": v}

    def cached_keys_values(self, rope, **cached):
        return cached["k"], cached["v"]


class GroupedQueryAttention(Attention):
    """GQA: G = config.n_kv_head key/value heads k_g = Rot(norm(X W_g^K)), v_g = X W_g^V, query head h
    reading g = h G // H; MHA (G = H) and MQA (G = 1) pass their G. It caches K and V: 2 G d_h numbers."""

    def __init__(self, config, layer, n_kv_head=None):
        super().__init__(config, layer)
        self.n_kv_head = n_kv_head or config.n_kv_head  # G
        self.W_k = nn.Linear(config.n_embd, self.n_kv_head * config.head_dim, bias=False)
        self.W_v = nn.Linear(config.n_embd, self.n_kv_head * config.head_dim, bias=False)

    def keys_values(self, x, rope):
        B, T, _ = x.shape
        k = apply_rope(norm(self.W_k(x).view(B, T, self.n_kv_head, self.head_dim)), rope)  # (B, T, G, d_h)
        return k, self.W_v(x).view(B, T, self.n_kv_head, self.head_dim)

    def cache_shapes(self):
        return {"k": (self.n_kv_head, self.head_dim), "v": (self.n_kv_head, self.head_dim)}


class MultiHeadAttention(GroupedQueryAttention):
    """Standard MHA: every query head has a key/value head of its own (G = H)."""
    def __init__(self, config, layer):
        super().__init__(config, layer, n_kv_head=config.n_head)


class MultiQueryAttention(GroupedQueryAttention):
    """MQA: one key/value head shared by all query heads (G = 1)."""
    def __init__(self, config, layer):
        super().__init__(config, layer, n_kv_head=1)


class LowRankKVAttention(Attention):
    """LRKV: every head's key and value projections are one matrix shared by all heads plus a rank-r
    residual of the head's own,

        W_h^K = W_shared^K + U_h^K (B_h^K)^T        W_h^V = W_shared^V + U_h^V (B_h^V)^T

    W_shared (d, d_h), U_h (d, r), B_h (d_h, r), so that for the inputs X (T, d)

        K_h = X W_shared^K + (X U_h^K)(B_h^K)^T = K_shared + R_h^K (B_h^K)^T

    and V_h likewise. Training builds every K_h and V_h and attends as MHA, k_h = Rot(norm(K_h)). r = d_h
    gives every head MHA's capacity; with no residual it is MQA."""

    def __init__(self, config, layer):
        super().__init__(config, layer)
        d, H, d_h, r = config.n_embd, config.n_head, config.head_dim, config.lrkv_rank
        self.lrkv_rank = r
        self.W_shared_k = nn.Linear(d, d_h, bias=False)  # weight (d_h, d): (W_shared^K)^T
        self.W_shared_v = nn.Linear(d, d_h, bias=False)
        self.U_k = nn.Linear(d, H * r, bias=False)  # weight (H r, d): the (U_h^K)^T stacked, head after head
        self.U_v = nn.Linear(d, H * r, bias=False)
        self.B_k = nn.Parameter(torch.zeros(H * d_h, r))  # (H d_h, r): the B_h^K stacked (drawn below)
        self.B_v = nn.Parameter(torch.zeros(H * d_h, r))

    def reset_parameters(self):  # std 0.1 / sqrt(r); U, W_shared of variance 1/d: U_h B_h^T ~ 0.1 W_shared
        for name in ("B_k", "B_v"):
            if hasattr(self, name):  # layout.py removes them from a layer that reads another's keys (--cla)
                nn.init.normal_(getattr(self, name), std=0.1 / math.sqrt(self.lrkv_rank))

    def keys_values(self, x, rope):
        k_shared, v_shared = self.W_shared_k(x), self.W_shared_v(x)  # (B, T, d_h): X W_shared
        r_k, r_v = self.residual_coords(self.U_k, x), self.residual_coords(self.U_v, x)  # (B, T, H, r): X U_h
        k = k_shared.unsqueeze(2) + self.residual(r_k, self.B_k)  # (B, T, H, d_h): K_h
        return apply_rope(norm(k), rope), self.values(v_shared, r_v)

    def residual_coords(self, U, x):  # every head's R_h = X U_h (U: U_k or U_v), (B, T, H, r)
        return U(x).view(*x.shape[:2], -1, self.lrkv_rank)

    def residual(self, R, B_heads):  # every head's R_h B_h^T (B_heads: B_k or B_v): (B, S, H, r) -> d_h
        return torch.einsum("bshr,hdr->bshd", R, B_heads.view(self.n_head, self.head_dim, self.lrkv_rank))

    def values(self, v_shared, r_v):  # every head's V_h = V_shared + R_h^V (B_h^V)^T: (B, S, H, d_h)
        return v_shared.unsqueeze(2) + self.residual(r_v, self.B_v)

    # Decoding. The cache holds the paper's 2 d_h + 2 H r numbers (K_shared turned by RoPE, R_h^K, V_shared,
    # R_h^V) and each head's key RMS rho_h (+0.7% at 128M: decode.py's step needs it, never forming k_h).
    # RoPE turns d_h-wide vectors, so R_h^K is turned only once B_h^K widens it; as RoPE is linear,
    #     k_h = Rot_s(norm(K_h)) = (Rot_s K_shared + Rot_s(R_h^K (B_h^K)^T)) / rho_h    (up to rounding)

    def cache_shapes(self):
        H, d_h, r = self.n_head, self.head_dim, self.lrkv_rank
        return {"k_shared": (d_h,), "r_k": (H, r), "rho": (H,), "v_shared": (d_h,), "r_v": (H, r)}

    def cache_entries(self, x, rope):
        k_shared, r_k = self.W_shared_k(x), self.residual_coords(self.U_k, x)
        k = k_shared.unsqueeze(2) + self.residual(r_k, self.B_k)  # (B, T, H, d_h): K_h, for its RMS
        return {"k_shared": apply_rope(k_shared.unsqueeze(2), rope).squeeze(2), "r_k": r_k, "rho": rms(k),
                "v_shared": self.W_shared_v(x), "r_v": self.residual_coords(self.U_v, x)}

    def cached_keys_values(self, rope, k_shared, r_k, rho, v_shared, r_v):
        return self.keys(k_shared, r_k, rho, rope), self.values(v_shared, r_v)

    def keys(self, k_shared, r_k, rho, rope):  # every head's key as training's k_h, (B, S, H, d_h)
        k_residual = apply_rope(self.residual(r_k, self.B_k), rope)  # Rot_s(R_h^K (B_h^K)^T)
        return (k_shared.unsqueeze(2) + k_residual) / rho.unsqueeze(-1)


class MultiHeadLatentAttention(Attention):
    """MLA after DeepSeek-V2 (its queries full-rank here): keys and values come up per head, through W_up,
    from a normalised latent c = norm(x W_down) of width d_c; one decoupled RoPE key k_R = x W_kr of width
    d_R, shared by all heads, carries position:

        k_h = norm([c W_up,h^K | Rot(k_R)])        v_h = c W_up,h^V

    so q/k heads are d_h + d_R wide, a query head [q_h^nope | q_h^R] with RoPE on its last d_R dims;
    the QK norm takes the whole concatenation, so a key's RMS is per head though k_R is shared."""

    def __init__(self, config, layer):  # q/k heads d_qk = d_h + d_R wide, RoPE on their last d_R dims
        super().__init__(config, layer, qk_dim=config.head_dim + config.rope_head_dim,
                         rope_dim=config.rope_head_dim)
        self.kv_lora_rank, d, H, d_h = config.kv_lora_rank, config.n_embd, config.n_head, config.head_dim
        self.W_down = nn.Linear(d, self.kv_lora_rank, bias=False)
        self.W_up_k = nn.Linear(self.kv_lora_rank, H * d_h, bias=False)
        self.W_up_v = nn.Linear(self.kv_lora_rank, H * d_h, bias=False)
        self.W_kr = nn.Linear(d, self.rope_dim, bias=False)

    def keys_values(self, x, rope):
        c = norm(self.W_down(x))  # (B, T, d_c)
        k = self.keys(c, apply_rope(self.W_kr(x).unsqueeze(2), rope))  # (B, T, H, d_h + d_R)
        return norm(k), self.values(c)  # normed after k_R turns, queries before: the same (Rot keeps the RMS)

    def keys(self, c, k_rope):  # every head's key before the QK norm, [c W_up,h^K | k_R]: (B, S, H, d_qk)
        k_nope = self.W_up_k(c).view(*c.shape[:2], self.n_head, self.head_dim)
        return torch.cat((k_nope, k_rope.expand(*k_nope.shape[:3], self.rope_dim)), dim=-1)

    def values(self, c):  # every head's value c W_up,h^V: (B, S, d_c) -> (B, S, H, d_h)
        return self.W_up_v(c).view(*c.shape[:2], self.n_head, self.head_dim)

    def attend(self, q, k, v, mask=None):  # flash wants one head dim: v zero-padded, its zero outputs cut
        return super().attend(q, k, F.pad(v, (0, self.rope_dim)), mask)[..., :self.head_dim]

    # Decoding. The cache holds c, the turned k_R and each head's key RMS (+3.1% at 128M: decode.py's step)

    def cache_shapes(self):
        return {"c": (self.kv_lora_rank,), "k_rope": (1, self.rope_dim), "rho": (self.n_head,)}

    def cache_entries(self, x, rope):
        c = norm(self.W_down(x))
        k_rope = apply_rope(self.W_kr(x).unsqueeze(2), rope)  # (B, T, 1, d_R)
        return {"c": c, "k_rope": k_rope, "rho": rms(self.keys(c, k_rope))}

    def cached_keys_values(self, rope, c, k_rope, rho):  # k_R was turned as it was stored: rope unused
        return self.keys(c, k_rope) / rho.unsqueeze(-1), self.values(c)


LIB = "lib.attention."  # the layers' package; VARIANTS names a rival by its path under it
VARIANTS = {"mha": MultiHeadAttention, "mqa": MultiQueryAttention, "gqa": GroupedQueryAttention,
            "mla": MultiHeadLatentAttention, "lrkv": LowRankKVAttention,
            "gta": LIB + "rivals.GroupedTiedAttention", "gla": LIB + "rivals.GroupedLatentAttention",
            "tpa": LIB + "rivals.TensorProductAttention", "mlra": LIB + "rivals.MultiHeadLowRankAttention"}


def attention_class(name):
    if not isinstance(VARIANTS[name], str):
        return VARIANTS[name]
    module, class_name = VARIANTS[name].rsplit(".", 1)  # a rival's module is imported the first time
    return getattr(importlib.import_module(module, __package__), class_name)


class Block(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.attn = attention_class(config.attn)(config, layer)
        self.mlp = nn.ModuleDict(dict(W_in=nn.Linear(config.n_embd, 4 * config.n_embd, bias=False),
                                      W_out=nn.Linear(4 * config.n_embd, config.n_embd, bias=False)))

    def forward(self, x, rope, memory=None):
        x = x + self.attn(norm(x), rope, memory)
        return x + self.mlp.W_out(F.relu(self.mlp.W_in(norm(x))).square())  # the ReLU^2 MLP


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        rope = rope_table(self.blocks[0].attn.rope_dim, config.block_size, config.rope_theta)  # MLA: d_R
        self.register_buffer("rope", rope, persistent=False)
        self.layout = None  # shared keys (--cla, --yoco) and windows (--window): lib/attention/layout.py
        if config.cla > 1 or config.yoco or config.window is not None:
            self.layout = importlib.import_module(LIB + "layout", __package__).Layout(config, self)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """nanochat's init, in this order (a seed, the same weights): embeddings N(0, 1), the unembedding
        near zero, every matrix uniform of variance 1/fan_in, W_o and W_out zero (each block the identity)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                bound = math.sqrt(3 / module.in_features)  # variance 1 / fan_in
                nn.init.uniform_(module.weight, -bound, bound)
        nn.init.normal_(self.wte.weight, std=1.0)
        nn.init.normal_(self.lm_head.weight, std=0.001)
        for block in self.blocks:
            nn.init.zeros_(block.attn.W_o.weight)
            if hasattr(block.attn, "reset_parameters"):  # the variant draws what else it holds (LRKV's B_h)
                block.attn.reset_parameters()
            nn.init.zeros_(block.mlp.W_out.weight)

    def forward(self, idx, targets=None, cache=None):
        """Logits (B, T, vocab) in fp32, the loss given targets; with a cache, idx comes after its prefix."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size = {self.config.block_size}")
        rope = self.rope[:T] if cache is None else cache.next_rope(T)  # the RoPE rows of idx's positions
        memory = self.layout.memory() if cache is None and self.layout else cache  # None: training, no layout
        x = norm(self.wte(idx))
        for block in self.blocks:
            x = block(x, rope, memory)
        if cache is not None:
            cache.advance(T)
        logits = self.lm_head(norm(x)).float()
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)

    def get_num_params(self):
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """nanoGPT's call, through a cache: idx (B, T) and max_new_tokens more, each sampled from the last
        one's logits. The prompt (its last L = block_size) fills a cache, then each step adds one token; past
        L, a new cache from the last L - L // 2 tokens (nanoGPT slides L tokens: samples past L differ)."""
        L, max_len = self.config.block_size, min(self.config.block_size, idx.size(1) + max_new_tokens)
        cache, context = self.new_cache(idx.size(0), max_len), idx[:, -L:]  # first, the prompt
        for _ in range(max_new_tokens):
            if cache.pos == L:  # full: a new cache from the last L - L // 2 tokens
                cache, context = self.new_cache(idx.size(0), max_len), idx[:, -(L - L // 2):]
            logits = self(context, cache=cache)[0][:, -1]  # (B, vocab) at the last position
            idx = torch.cat((idx, sample(logits, temperature, top_k)), dim=1)
            context = idx[:, -1:]  # then one token a step
        return idx

    def new_cache(self, batch_size, max_len, dtype=None, device=None, cache_class=None):
        """An empty KVCache (a layout's, or cache_class) of batch_size sequences of max_len tokens at most."""
        if max_len > self.config.block_size:  # the RoPE table has block_size rows
            raise ValueError(f"a KV cache of {max_len} tokens exceeds block_size = {self.config.block_size}")
        cache_class = cache_class or (self.layout.cache_class if self.layout else KVCache)
        dtype, device = dtype or self.wte.weight.dtype, device or self.rope.device  # the model's by default
        return cache_class(self, batch_size, max_len, dtype, device)

    def kv_cache_bytes(self, batch_size, seq_len, dtype=None, cache_class=None):  # counted on the meta device
        cache = self.new_cache(batch_size, seq_len, dtype, "meta", cache_class)
        return sum(buf.nbytes for layer in cache.layers for buf in layer.values())


def sample(logits, temperature=1.0, top_k=None):
    """A token (B, 1) from logits (B, vocab): argmax at t = 0, else fp32 softmax(logits / t) of the top_k."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = (logits.float() - logits.float().amax(-1, keepdim=True)) / max(temperature, torch.finfo().tiny)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)


class KVCache:
    """Decoding's memory, one for the whole model: each layer's entries of columns 0..pos-1 in buffers (B,
    max_len, *shape), column p every row's position p; only allocate, store and load use them (quant.py's)."""

    def __init__(self, model, batch_size, max_len, dtype, device):
        self.pos, self.max_len, self.batch_size, self.dtype = 0, max_len, batch_size, dtype
        self.dtypes = {}  # {layer: {name: dtype}}: load casts back what buffers hold lower (quant.py: int8)
        self.rope = model.rope[:max_len].to(device)  # the RoPE rows of positions 0..max_len-1
        self.layers = [self.allocate(block.attn.cache_shapes(), self.length(block.attn.layer), device)
                       for block in model.blocks]

    def length(self, layer):  # how many positions a layer's buffers hold (a ring.py layout's, fewer)
        return self.max_len

    def allocate(self, shapes, length, device):  # the buffers {name: (B, length, *shape)} of shapes
        return {name: torch.zeros(self.batch_size, length, *shape, dtype=self.dtype, device=device)
                for name, shape in shapes.items()}

    def store(self, layer, slots, entries):  # the layer's entries {name: (B, T, *shape)} into slots (T,)
        self.dtypes.setdefault(layer, {name: x.dtype for name, x in entries.items()})
        for name, x in entries.items():  # in the buffer's dtype, allocate's choice
            self.layers[layer][name][:, slots] = x.to(self.layers[layer][name].dtype)

    def load(self, layer, slots):  # the layer's entries {name: (B, S, *shape)} at slots, as computed
        return {name: buf[:, slots].to(self.dtypes[layer][name]) for name, buf in self.layers[layer].items()}

    def row_positions(self, columns):  # the positions at columns (S,): (S,) where rows agree (here), or
        return columns  # (B, S), each row's (ring.py: rows of different lengths, left-padded; a pad negative)

    def next_rope(self, T):  # the next T columns' RoPE rows: (T, rope_dim), or (B, T, rope_dim) each row's
        if self.pos + T > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens, {self.pos + T} were asked for")
        return self.rope[self.row_positions(torch.arange(self.pos, self.pos + T)).clamp(min=0)]  # a pad: 0's

    def attend(self, attn, q, x, rope):
        """attn's tokens x (B, T, d) at pos..pos+T-1 store their entries; their queries q (B, T, H, d_qk)
        attend over keys and values rebuilt from positions 0..pos+T-1, query pos + i seeing j <= pos + i."""
        T, end = x.size(1), self.pos + x.size(1)
        self.store(attn.layer, slice(self.pos, end), attn.cache_entries(x, rope))  # rope: the T new rows
        k, v = attn.cached_keys_values(self.rope[:end], **self.load(attn.layer, slice(0, end)))  # end rows
        mask = q.new_ones(T, end, dtype=torch.bool).tril(self.pos) if self.pos and T > 1 else None
        return attn.attend(q, k, v, mask)  # a chunk after a prefix: query pos + i sees j <= pos + i

    def advance(self, T):  # after the last layer (GPT.forward): all layers of a forward see the same pos
        self.pos += T


def check_config(config):
    """Every field, a flag's or a checkpoint's: a ValueError of one line naming the first that cannot be."""
    H, d_h, span = config.n_head, config.head_dim, f"from 1 to block_size = {config.block_size}, or None"
    kinds = {bool: "true or false", str: "a string", float: "a number", int: "a positive integer"}
    for field in fields(config):  # first its type: every int field >= 1 (window: or None)
        value, kind = getattr(config, field.name), field.type
        ok = {bool: type(value) is bool, str: type(value) is str, float: type(value) in (int, float),
              int | None: value is None or type(value) is int and value >= 1}
        if not ok.get(kind, type(value) is int and value >= 1):
            config.reject(field.name, kinds.get(kind, span))
    for field, ok, allowed in (
            ("attn", config.attn in VARIANTS, "one of " + ", ".join(VARIANTS)),
            ("head_dim", d_h % 2 == 0, "even (RoPE rotates pairs of dimensions)"),
            ("rope_theta", 1 < config.rope_theta < math.inf, "a finite number > 1 (RoPE's theta^(-2i/d))"),
            ("n_embd", config.n_embd == H * d_h, f"n_head * head_dim = {H} * {d_h}"),
            ("n_kv_head", config.attn != "gqa" or H % config.n_kv_head == 0, f"a divisor of n_head = {H}"),
            ("lrkv_rank", config.attn != "lrkv" or config.lrkv_rank <= d_h, f"from 1 to head_dim = {d_h}"),
            ("rope_head_dim", config.attn != "mla" or config.rope_head_dim in range(2, d_h + 1, 2),
             f"even, from 2 to head_dim = {d_h}")):
        if not ok:
            config.reject(field, allowed)
    getattr(attention_class(config.attn), "check", lambda config: None)(config)  # a rival's own knobs
    if config.cla > 1 or config.yoco or config.window is not None:  # a layout's (lib/attention/layout.py)
        importlib.import_module(LIB + "layout", __package__).check(config)
