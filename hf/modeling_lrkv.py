"""
This repository's GPT (model.py, lib/attention/rivals.py) for Hugging Face transformers: every
attention variant (--attn: mha, mqa, gqa, mla, lrkv, gta, gla, tpa, mlra), shared keys and values
(--cla, --yoco) and sliding windows (--window, --window_pattern), with a cache that holds exactly
what model.py's KVCache holds. export_hf.py copies this file beside a checkpoint's weights;
transformers loads it with

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

It imports only torch and transformers, and reads like model.py: the same parameter names, so a
checkpoint's state_dict loads as it is, and the same equations. What differs is the decoding:

  - The cache is a transformers Cache (LatentCache) with one LatentLayer per layer that owns keys
    and values (config.kv_source's): each holds the entries of its variant's cache_shapes in
    model.py, (B, S, *shape), and nothing else. An owner whose readers all have a window keeps only
    its last `span` positions, the widest reader's window, as model.py's ring does. So the cache's
    bytes after a prompt of S tokens are model.kv_cache_bytes(B, S).
  - Every forward, with or without a cache, goes the way of model.py's cached path (KVCache.attend):
    a layer writes its new tokens' entries, rebuilds every held position's keys and values from the
    entries (keys_values, model.py's cached_keys_values) and attends with plain equations, where
    model.py's rule `visible` allows (j <= i and, in a layer with a window W, i - j < W).
  - Positions come from the attention mask, as transformers' generate numbers them: a token's
    position is the number of real tokens before it in its row, so a left-padded batch decodes as
    each sequence would alone. Pad tokens are never attended to (but by themselves).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer
from transformers.modeling_outputs import CausalLMOutputWithPast


class LRKVConfig(PreTrainedConfig):
    """model.py's GPTConfig, field by field (a checkpoint's model_args), plus the token ids."""

    model_type = "lrkv"
    # the names that transformers and lm-evaluation-harness look for
    attribute_map = {"num_hidden_layers": "n_layer", "hidden_size": "n_embd", "num_attention_heads": "n_head",
                     "max_position_embeddings": "block_size"}

    block_size: int = 2048
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 6  # H
    n_embd: int = 768  # d
    head_dim: int = 128  # d_h
    attn: str = "mha"
    # Which layers compute keys and values (kv_source): with cla = N, the first of each group of N
    # layers; with yoco, the middle layer for the whole upper half
    cla: int = 1
    yoco: bool = False
    # Sliding windows: an S layer sees its last `window` positions, an L layer all of them;
    # window_pattern is tiled over the layers and the last layer is always L (layer_window)
    window: int | None = None  # W; None: every layer is L
    window_pattern: str = "SSSL"
    n_kv_head: int = 3  # gqa: G
    kv_lora_rank: int = 128  # mla: d_c
    rope_head_dim: int = 64  # mla, gla, mlra: d_R
    lrkv_rank: int = 46  # lrkv: r
    rope_theta: float = 10000.0
    gta_kv_heads: int = 3
    gla_latent_heads: int = 2
    gla_latent_dim: int = 256
    tpa_q_rank: int = 6
    tpa_kv_rank: int = 2
    mlra_latent_heads: int = 4
    mlra_latent_dim: int = 128
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    use_cache: bool = True

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
    """x / rms(x): parameter-free RMSNorm over the last dim (model.py's norm)."""
    return F.rms_norm(x, (x.size(-1),))


def rms(x):
    """The RMS that norm divides by, (...,) for x (..., D), computed in fp32 at least with that
    dtype's eps, returned in x's dtype (model.py's rms): what LRKV, MLA, GLA and MLRA cache as rho."""
    x_hi = x.to(torch.promote_types(x.dtype, torch.float32))
    return x_hi.pow(2).mean(-1).add(torch.finfo(x_hi.dtype).eps).sqrt().to(x.dtype)


def rope_table(dim, max_len, theta):
    """(max_len, dim): row s is [cos(s theta_i) | sin(s theta_i)], in fp32, as model.py builds it."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x, rope):
    """Rotate the last rope.size(-1) dims of x (B, T, heads, D) by each token's row of rope
    (B, T, rope_dim): dims i and i + half turn together, (x_i, x_{i+half}) -> (x_i cos + x_{i+half}
    sin, x_{i+half} cos - x_i sin), as model.py's apply_rope. The first dims pass unrotated."""
    cos, sin = rope[:, :, None, :].to(x.dtype).chunk(2, dim=-1)  # (B, T, 1, half) each
    x_pass, x1, x2 = x.split((x.size(-1) - 2 * cos.size(-1), cos.size(-1), cos.size(-1)), dim=-1)
    return torch.cat((x_pass, x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


# The cache

class LatentLayer(CacheLayerMixin):
    """One owner layer's cache: its variant's entries {name: (B, S, *shape)} of the latest S slots,
    each new forward's appended along S. span None: it keeps every slot. span W (every layer reading
    it has a window, the widest W): after each forward it keeps only the slots that a later token
    may still see, which are the last W where no pad lies among them (a left-padded batch, as
    generate makes), as model.py's ring of W positions. seen counts every slot written, kept or not:
    the cache's sequence length for generate. The Cache methods that generate calls (beam search's
    reordering, cropping) act on every entry alike."""

    def __init__(self, span=None):
        super().__init__()
        self.entries, self.seen, self.span = {}, 0, span
        self.is_croppable = span is None  # see crop

    def lazy_initialization(self, key_states, value_states):
        """Nothing to allocate ahead: the entries are made by the first update."""

    def update(self, entries):
        """Append the new tokens' entries {name: (B, T, *shape)}; returns every held slot's."""
        self.entries = {name: torch.cat((self.entries[name], x), dim=1) if self.entries else x
                        for name, x in entries.items()}
        self.seen += next(iter(entries.values())).size(1)
        self.is_initialized = True
        return self.entries

    def held(self):
        return next(iter(self.entries.values())).size(1) if self.entries else 0

    def trim(self, real):
        """Drop the slots no later token can see, real (B, seen) the attention mask of every slot
        written. A later token of a row has a position at least that row's count P of real tokens: it
        sees a real token at position p where P - p < span, and model.py keeps one more, the slot the
        next token overwrites. So a slot is kept where it is real and at most span real tokens lie
        from it to the end, and never fewer than the last span slots."""
        held = self.held()
        if self.span is None or held <= self.span:
            return
        real = real[:, -held:]
        after = real.flip(-1).long().cumsum(-1).flip(-1)  # (B, held): real slots from each to the end
        needed = (real & (after <= self.span)).any(0)  # (held,): in any row
        oldest = int(needed.long().argmax()) if needed.any() else held  # the first slot needed
        keep = max(self.span, held - oldest)
        if keep < held:
            self.apply(lambda x: x[:, -keep:].clone(memory_format=torch.contiguous_format))

    def get_seq_length(self):
        return self.seen

    def get_mask_sizes(self, query_length):
        return self.seen + query_length, 0

    def get_max_length(self):
        return -1

    def apply(self, fn):
        """Every entry through fn, (B, S, ...) -> (B', S', ...)."""
        self.entries = {name: fn(x) for name, x in self.entries.items()}

    def reset(self):
        self.entries, self.seen, self.is_initialized = {}, 0, False

    def crop(self, tokens_to_remove):
        """Drop the newest -tokens_to_remove positions. A layer that has dropped its oldest ones (a
        window's) cannot have them back, so that a later token would miss them: it is not croppable,
        and generate crops it only where it hands the cache back to no one."""
        if tokens_to_remove < 0:
            self.apply(lambda x: x[:, :tokens_to_remove])
            self.seen += tokens_to_remove

    def reorder_cache(self, beam_idx):
        self.apply(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats):
        self.apply(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        self.apply(lambda x: x[indices])


class LatentCache(Cache):
    """The model's decoding memory, as model.py's KVCache: a LatentLayer for each layer that owns
    keys and values, its span the widest window among the layers that read it (None where one of
    them sees every position), and a DummyLayer (nothing) for a layer that reads another's entries
    (a later layer of a CLA group, YOCO's upper half)."""

    def __init__(self, config):
        readers = {}  # owner: the windows of the layers that read its entries, its own included
        for layer in range(config.n_layer):
            readers.setdefault(config.kv_source(layer), []).append(config.layer_window(layer))
        span = {owner: None if None in windows else max(windows) for owner, windows in readers.items()}
        super().__init__(layers=[LatentLayer(span[layer]) if layer in span else DummyLayer()
                                 for layer in range(config.n_layer)])

    def write(self, layer, entries):
        self.layers[layer].update(entries)

    def read(self, layer):
        return self.layers[layer].entries

    def trim(self, real):
        """After a forward: every owner keeps only what a later token may see (LatentLayer.trim)."""
        for layer in self.layers:
            if isinstance(layer, LatentLayer):
                layer.trim(real)


# The attention variants: each as in model.py or lib/attention/rivals.py, under the same names

class Attention(nn.Module):
    """What every variant shares: H query heads q_h = Rot(norm(x W_h^Q)), causal softmax attention
    over the variant's keys and values, and W_o. A variant makes its key and value weights
    (make_keys_values, only in a layer that owns them), its cache entries (cache_entries) and every
    cached position's keys and values from them (keys_values). A layer reads the entries of
    kv_layer (config.kv_source's: its own, or those of the layer it shares with, CLA's or YOCO's)
    and attends with its own window (config.layer_window's), which its forward's mask applies."""

    def __init__(self, config, layer, qk_dim=None, rope_dim=None):
        super().__init__()
        self.layer, self.n_head, self.head_dim = layer, config.n_head, config.head_dim
        self.qk_dim = qk_dim or config.head_dim  # d_qk: a query or key head's width
        self.rope_dim = rope_dim or config.head_dim  # RoPE turns a query's and a key's last rope_dim dims
        self.kv_layer = config.kv_source(layer)  # the layer whose keys and values this one reads
        self.window = config.layer_window(layer)  # W: it sees its last W positions; None: all
        self.make_queries(config)
        self.W_o = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)
        if self.kv_layer == layer:
            self.make_keys_values(config)

    def make_queries(self, config):
        self.W_q = nn.Linear(config.n_embd, config.n_head * self.qk_dim, bias=False)

    def queries(self, x, rope):
        B, T, _ = x.shape
        return apply_rope(norm(self.W_q(x).view(B, T, self.n_head, self.qk_dim)), rope)  # (B, T, H, d_qk)

    def forward(self, x, rope, cache, mask, source):
        """x's T new tokens (B, T, d), the last of S slots: rope (B, S, rope_dim), the RoPE rows of
        all S; mask (B, T, S), which slots each new token attends to with this layer's window;
        source, the attention that owns this layer's keys and values (itself, or the one it reads).
        The cache holds the last of the S slots (all of them, or those a window still sees)."""
        T = x.size(1)
        q = self.queries(x, rope[:, -T:])
        if self.kv_layer == self.layer:
            cache.write(self.layer, self.cache_entries(x, rope[:, -T:]))
        entries = cache.read(self.kv_layer)
        held = next(iter(entries.values())).size(1)  # the last `held` of the S slots
        k, v = source.keys_values(rope[:, -held:], **entries)
        return self.W_o(self.attend(q, k, v, mask[:, :, -held:]).flatten(2))

    @staticmethod
    def attend(q, k, v, mask):
        """softmax(q k^T / sqrt(d_qk)) v over the keys mask allows: q (B, T, H, d_qk), k (B, S, G, d_qk),
        v (B, S, G, d_v), mask (B, T, S) -> (B, T, H, d_v); query head h reads key/value head h G // H."""
        H, G = q.size(2), k.size(2)
        k, v = k.repeat_interleave(H // G, dim=2), v.repeat_interleave(H // G, dim=2)  # (B, S, H, d)
        scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.size(-1))
        scores = scores.masked_fill(~mask[:, None], float("-inf"))  # (B, H, T, S)
        return torch.einsum("bhts,bshd->bthd", scores.softmax(dim=-1), v)


class GroupedQueryAttention(Attention):
    """MHA (G = H), GQA (G = n_kv_head) and MQA (G = 1): keys K_g = Rot(norm(X W_g^K)), values
    V_g = X W_g^V. The cache holds them as they are: k and v, (G, d_h) each."""

    def make_keys_values(self, config):
        self.n_kv_head = {"mha": config.n_head, "mqa": 1, "gqa": config.n_kv_head}[config.attn]  # G
        self.W_k = nn.Linear(config.n_embd, self.n_kv_head * config.head_dim, bias=False)
        self.W_v = nn.Linear(config.n_embd, self.n_kv_head * config.head_dim, bias=False)

    def cache_entries(self, x, rope):
        B, T, _ = x.shape
        k = apply_rope(norm(self.W_k(x).view(B, T, self.n_kv_head, self.head_dim)), rope)  # (B, T, G, d_h)
        return {"k": k, "v": self.W_v(x).view(B, T, self.n_kv_head, self.head_dim)}

    def keys_values(self, rope, k, v):
        return k, v


class LowRankKVAttention(Attention):
    """LRKV: head h's key projection W_h^K = W_shared^K + U_h^K (B_h^K)^T, and the same for values,
    so K_h = K_shared + R_h^K (B_h^K)^T with K_shared = X W_shared^K and R_h^K = X U_h^K (T, r).
    The cache holds K_shared rotated (the same for every head), V_shared, every head's R_h^K and
    R_h^V (unrotated) and every head's key RMS rho_h: k_shared (d_h), r_k (H, r), rho (H),
    v_shared (d_h), r_v (H, r). A key comes back as (Rot K_shared + Rot(R_h^K (B_h^K)^T)) / rho_h."""

    def make_keys_values(self, config):
        d, H, d_h, r = config.n_embd, config.n_head, config.head_dim, config.lrkv_rank
        self.lrkv_rank = r
        self.W_shared_k = nn.Linear(d, d_h, bias=False)
        self.W_shared_v = nn.Linear(d, d_h, bias=False)
        self.U_k = nn.Linear(d, H * r, bias=False)  # the (U_h^K)^T stacked: (H r, d)
        self.U_v = nn.Linear(d, H * r, bias=False)
        self.B_k = nn.Parameter(torch.zeros(H * d_h, r))  # the B_h^K stacked: (H d_h, r)
        self.B_v = nn.Parameter(torch.zeros(H * d_h, r))

    def residual_coords(self, U, x):
        """R_h = X U_h of every head: (B, T, d) -> (B, T, H, r)."""
        return U(x).view(*x.shape[:2], self.n_head, self.lrkv_rank)

    def residual(self, R, factor):
        """Every head's R_h B_h^T: (B, S, H, r) -> (B, S, H, d_h)."""
        return torch.einsum("bshr,hdr->bshd", R, factor.view(self.n_head, self.head_dim, self.lrkv_rank))

    def cache_entries(self, x, rope):
        k_shared, r_k = self.W_shared_k(x), self.residual_coords(self.U_k, x)  # (B, T, d_h), (B, T, H, r)
        k = k_shared.unsqueeze(2) + self.residual(r_k, self.B_k)  # (B, T, H, d_h): K_h before the norm
        return {"k_shared": apply_rope(k_shared.unsqueeze(2), rope).squeeze(2), "r_k": r_k, "rho": rms(k),
                "v_shared": self.W_shared_v(x), "r_v": self.residual_coords(self.U_v, x)}

    def keys_values(self, rope, k_shared, r_k, rho, v_shared, r_v):
        residual = apply_rope(self.residual(r_k, self.B_k), rope)  # (B, S, H, d_h)
        k = (k_shared.unsqueeze(2) + residual) / rho.unsqueeze(-1)
        return k, v_shared.unsqueeze(2) + self.residual(r_v, self.B_v)


class MultiHeadLatentAttention(Attention):
    """MLA: k_h = norm([c W_up,h^K | Rot(k_R)]), v_h = c W_up,h^V, from the normalised latent
    c = norm(x W_down) (d_c) and one RoPE key k_R = x W_kr (d_R) shared by all heads; queries
    [q_h^nope | q_h^R], d_h + d_R wide. The cache holds c (d_c), the rotated k_R (1, d_R) and every
    head's key RMS rho (H)."""

    def __init__(self, config, layer):
        super().__init__(config, layer, qk_dim=config.head_dim + config.rope_head_dim,
                         rope_dim=config.rope_head_dim)

    def make_keys_values(self, config):
        d, H, d_h = config.n_embd, config.n_head, config.head_dim
        self.W_down = nn.Linear(d, config.kv_lora_rank, bias=False)
        self.W_up_k = nn.Linear(config.kv_lora_rank, H * d_h, bias=False)
        self.W_up_v = nn.Linear(config.kv_lora_rank, H * d_h, bias=False)
        self.W_kr = nn.Linear(d, config.rope_head_dim, bias=False)

    def keys(self, c, k_rope):
        """Every head's key before the QK norm, [c W_up,h^K | k_R]: (B, S, H, d_h + d_R)."""
        B, S = c.shape[:2]
        k_nope = self.W_up_k(c).view(B, S, self.n_head, self.head_dim)
        return torch.cat((k_nope, k_rope.expand(B, S, self.n_head, self.rope_dim)), dim=-1)

    def cache_entries(self, x, rope):
        c = norm(self.W_down(x))  # (B, T, d_c)
        k_rope = apply_rope(self.W_kr(x).unsqueeze(2), rope)  # (B, T, 1, d_R)
        return {"c": c, "k_rope": k_rope, "rho": rms(self.keys(c, k_rope))}

    def keys_values(self, rope, c, k_rope, rho):
        v = self.W_up_v(c).view(*c.shape[:2], self.n_head, self.head_dim)  # (B, S, H, d_h)
        return self.keys(c, k_rope) / rho.unsqueeze(-1), v


class GroupedTiedAttention(Attention):
    """GTA: per group g of H/G query heads one tied state S_g = x W_g^KV (d_h), the group's value and,
    in its first d_h/2 dims, the position-free half of its key, whose RoPE half is one key
    k^R = x W^KR (d_h/2) shared by all heads: k_g = norm([S_g[:d_h/2] | Rot(k^R)]), v_g = S_g. The
    cache holds S_g and the rotated k^R: kv (G, d_h), k_rope (1, d_h/2)."""

    def __init__(self, config, layer):
        super().__init__(config, layer, rope_dim=config.head_dim // 2)

    def make_keys_values(self, config):
        self.n_kv_head = config.gta_kv_heads  # G
        self.W_kv = nn.Linear(config.n_embd, self.n_kv_head * config.head_dim, bias=False)
        self.W_kr = nn.Linear(config.n_embd, self.rope_dim, bias=False)

    def cache_entries(self, x, rope):
        kv = self.W_kv(x).view(*x.shape[:2], self.n_kv_head, self.head_dim)  # (B, T, G, d_h)
        return {"kv": kv, "k_rope": apply_rope(self.W_kr(x).unsqueeze(2), rope)}  # k_rope (B, T, 1, d_h/2)

    def keys_values(self, rope, kv, k_rope):
        nope = kv[..., :self.head_dim - self.rope_dim]
        k = norm(torch.cat((nope, k_rope.expand(*kv.shape[:3], self.rope_dim)), dim=-1))  # (B, S, G, d_h)
        return k, kv


class LatentHeadsAttention(Attention):
    """What GLA and MLRA share: n latent heads c_i = norm(x W_down,i) (d_c each), every key and value
    up-projected from one latent head by a (d_c x d_h) matrix of its own, n_up of them per latent
    head, and MLA's RoPE key k^R shared by all heads; q/k heads d_h + d_R wide. The cache holds the
    latent heads c (n, d_c), the rotated k^R (1, d_R) and every key's RMS rho."""

    def __init__(self, config, layer, n_latent, latent_dim, n_up):
        self.n_latent, self.latent_dim, self.n_up = n_latent, latent_dim, n_up
        super().__init__(config, layer, qk_dim=config.head_dim + config.rope_head_dim,
                         rope_dim=config.rope_head_dim)

    def make_keys_values(self, config):
        n, d_h = self.n_latent * self.n_up, config.head_dim
        self.W_down = nn.Linear(config.n_embd, self.n_latent * self.latent_dim, bias=False)
        self.W_up_k = nn.Linear(self.latent_dim, n * d_h, bias=False)
        self.W_up_v = nn.Linear(self.latent_dim, n * d_h, bias=False)
        self.W_kr = nn.Linear(config.n_embd, self.rope_dim, bias=False)

    def up_project(self, c, W):
        """c_i W_up,i,j for every latent head i and its n_up projections j:
        (B, S, n, d_c) -> (B, S, n, n_up, d_h)."""
        up = W.weight.view(self.n_latent, self.n_up, self.head_dim, self.latent_dim)
        return torch.einsum("bsic,ijdc->bsijd", c, up)

    def with_rope_key(self, k_nope, k_rope):
        """[k_nope | Rot k^R] for keys (B, S, ..., d_h) and the rotated k^R (B, S, 1, d_R)."""
        k_rope = k_rope.view(*k_rope.shape[:2], *[1] * (k_nope.dim() - 3), self.rope_dim)
        return torch.cat((k_nope, k_rope.expand(*k_nope.shape[:-1], self.rope_dim)), dim=-1)

    def cache_entries(self, x, rope):
        c = norm(self.W_down(x).view(*x.shape[:2], self.n_latent, self.latent_dim))  # (B, T, n, d_c)
        k_rope = apply_rope(self.W_kr(x).unsqueeze(2), rope)  # (B, T, 1, d_R)
        return {"c": c, "k_rope": k_rope, "rho": rms(self.keys(c, k_rope))}

    def keys_values(self, rope, c, k_rope, rho):
        return self.keys(c, k_rope) / rho.unsqueeze(-1), self.values(c)


class GroupedLatentAttention(LatentHeadsAttention):
    """GLA: head h reads only the latent head of its group, j = h n // H, through its own
    up-projections: k_h = [c_j W_up,h^K | Rot(k^R)], v_h = c_j W_up,h^V. rho: (H)."""

    def __init__(self, config, layer):
        n = config.gla_latent_heads
        super().__init__(config, layer, n, config.gla_latent_dim, n_up=config.n_head // n)

    def keys(self, c, k_rope):
        k_nope = self.up_project(c, self.W_up_k).flatten(2, 3)  # (B, S, H, d_h)
        return self.with_rope_key(k_nope, k_rope)  # (B, S, H, d_h + d_R)

    def values(self, c):
        return self.up_project(c, self.W_up_v).flatten(2, 3)  # (B, S, H, d_h)


class MultiHeadLowRankAttention(LatentHeadsAttention):
    """MLRA: every query head attends to each latent head i apart, through its own up-projections,
    k_{i,h} = [c_i W_up,i,h^K | Rot(k^R)], v_{i,h} = c_i W_up,i,h^V, and the n outputs are summed:
    o_h = (1 / sqrt(n)) sum_i softmax(q_h k_{i,h}^T / sqrt(d_h + d_R)) V_{i,h}. rho: (n, H)."""

    def __init__(self, config, layer):
        super().__init__(config, layer, config.mlra_latent_heads, config.mlra_latent_dim, n_up=config.n_head)

    def keys(self, c, k_rope):
        return self.with_rope_key(self.up_project(c, self.W_up_k), k_rope)  # (B, S, n, H, d_h + d_R)

    def values(self, c):
        return self.up_project(c, self.W_up_v)  # (B, S, n, H, d_h)

    def attend(self, q, k, v, mask):
        heads = [Attention.attend(q, k[:, :, i], v[:, :, i], mask) for i in range(self.n_latent)]
        return sum(heads) / math.sqrt(self.n_latent)


class TensorProductAttention(Attention):
    """TPA: queries, keys and values each (1/R) sum_r a_r(x) (x) b_r(x), a head factor (H) times a
    feature factor (d_h), both linear in x, RoPE on the feature factor; the QK norm on every head.
    It has no W_q. The cache holds the key factors (b^K rotated) and the value factors: a_k (R, H),
    b_k (R, d_h), a_v (R, H), b_v (R, d_h)."""

    def make_queries(self, config):
        d, H, d_h, R = config.n_embd, config.n_head, config.head_dim, config.tpa_q_rank
        self.W_aq = nn.Linear(d, R * H, bias=False)  # a_r^Q, r-major: (R_Q, H)
        self.W_bq = nn.Linear(d, R * d_h, bias=False)  # b_r^Q: (R_Q, d_h)

    def make_keys_values(self, config):
        d, H, d_h, R = config.n_embd, config.n_head, config.head_dim, config.tpa_kv_rank
        self.W_ak = nn.Linear(d, R * H, bias=False)
        self.W_bk = nn.Linear(d, R * d_h, bias=False)
        self.W_av = nn.Linear(d, R * H, bias=False)
        self.W_bv = nn.Linear(d, R * d_h, bias=False)

    def factors(self, x, W_a, W_b):
        """A token's head factors (B, T, R, H) and feature factors (B, T, R, d_h)."""
        B, T, _ = x.shape
        return W_a(x).view(B, T, -1, self.n_head), W_b(x).view(B, T, -1, self.head_dim)

    @staticmethod
    def product(a, b):
        """(1/R) sum_r a_r (x) b_r: (B, S, R, H), (B, S, R, d_h) -> (B, S, H, d_h)."""
        return torch.einsum("bsrh,bsrd->bshd", a, b) / a.size(2)

    def queries(self, x, rope):
        return apply_rope(norm(self.product(*self.factors(x, self.W_aq, self.W_bq))), rope)  # (B, T, H, d_h)

    def cache_entries(self, x, rope):
        a_k, b_k = self.factors(x, self.W_ak, self.W_bk)
        a_v, b_v = self.factors(x, self.W_av, self.W_bv)
        return {"a_k": a_k, "b_k": apply_rope(b_k, rope), "a_v": a_v, "b_v": b_v}

    def keys_values(self, rope, a_k, b_k, a_v, b_v):
        return norm(self.product(a_k, b_k)), self.product(a_v, b_v)


VARIANTS = {"mha": GroupedQueryAttention, "mqa": GroupedQueryAttention, "gqa": GroupedQueryAttention,
            "lrkv": LowRankKVAttention, "mla": MultiHeadLatentAttention, "gta": GroupedTiedAttention,
            "gla": GroupedLatentAttention, "mlra": MultiHeadLowRankAttention, "tpa": TensorProductAttention}


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
        self.attn = VARIANTS[config.attn](config, layer)
        self.mlp = MLP(config)

    def forward(self, x, rope, cache, mask, source):
        x = x + self.attn(norm(x), rope, cache, mask, source)
        return x + self.mlp(norm(x))


class LRKVForCausalLM(PreTrainedModel, GenerationMixin):
    """model.py's GPT: norm(wte) in, the blocks, lm_head(norm(x)) out, logits in fp32 at least."""

    config_class = LRKVConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]

    def __init__(self, config):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls):
        """generate makes no DynamicCache for this model: its forward makes a LatentCache."""
        return False

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, value):
        self.wte = value

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, past_key_values=None, labels=None, use_cache=None,
                **kwargs):
        """Logits (B, T, vocab) of input_ids' T tokens after the cache's positions, and the cache that
        holds them (use_cache): all of them, but for a layer whose readers all have a window, what a
        later token may still see. attention_mask (B, S), S the cached positions and these T: 0 marks
        a pad. labels (B, T): the loss of predicting each token from those before it (-100: none)."""
        use_cache = self.config.use_cache if use_cache is None else use_cache
        cache = past_key_values if past_key_values is not None else LatentCache(self.config)
        B, T = input_ids.shape
        S = cache.get_seq_length() + T
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.long, device=input_ids.device)
        if attention_mask.shape != (B, S):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}: it must be (batch, "
                             f"cached + new tokens) = ({B}, {S}), 1 for a token and 0 for a pad")
        real = attention_mask.bool()  # (B, S)
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)  # (B, S): real tokens before each one
        rope_dim = self.blocks[0].attn.rope_dim
        # the table of model.py's GPT, block_size rows, so that every row is the same to the last bit
        table = rope_table(rope_dim, max(self.config.block_size, S), self.config.rope_theta)
        rope = table.to(input_ids.device)[positions]  # (B, S, rope_dim)
        # new token t, at S - T + t, sees the real tokens up to it, and itself (so a pad attends to
        # something); in a layer with a window W, only those fewer than W positions back (model.py's visible)
        key, query = torch.arange(S, device=input_ids.device), torch.arange(S - T, S, device=input_ids.device)
        causal = (key <= query[:, None]) & (real[:, None, :] | (key == query[:, None]))  # (B, T, S)
        distance = positions[:, -T:, None] - positions[:, None, :]  # (B, T, S)
        masks = {window: causal if window is None else causal & (distance < window)
                 for window in {block.attn.window for block in self.blocks}}

        x = norm(self.wte(input_ids))
        for block in self.blocks:
            x = block(x, rope, cache, masks[block.attn.window], self.blocks[block.attn.kv_layer].attn)
        cache.trim(real)
        logits = self.lm_head(norm(x))
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache if use_cache else None)

