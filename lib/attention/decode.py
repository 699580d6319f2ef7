"""
Decoding fast: the optimised single-token steps of the variants that cache less than their keys and
values (here LRKV's and MLA's, the rivals' in rivals.py), each beside the plain equation it equals; the
caches that run them; and stream, the sampling loop with a choice of cache and step.

model.py decodes by the plain cached path: KVCache.attend rebuilds every cached position's keys and
values from the cache (the variant's cached_keys_values) and attends as training does. A new token
needs less: a variant's exact single-token step reads the cache as it is. STEPS, at the end of this
file, lists every variant's by class, each a function

    def lrkv_step(attn, q, cached, rope, mask): ...

of q (B, 1, H, d_qk) the new token's normalised, rotated query; cached {name: (B, S, *shape)} every
position's cache entries, the new token's included; rope (S, rope_dim) their RoPE rows; mask None (all
S visible) or (1, S) bool, the positions the token may see. The step returns the attention output
(B, 1, H, d_v), before W_o, and must equal reference_step, the plain equation, which the tests check at
every step of a decode. A subclass inherits its parent's step (looked up along the MRO) while it attends
and rebuilds keys as that parent does (the same attend and cached_keys_values): a class with an attend
of its own decodes through that attend unless it registers a step of its own. A variant with no step
decodes by the plain path. MHA's, GQA's and MQA's step is the plain equation over their cached keys and
values. A layer that reads another's keys (layout.py) runs its own class's step over the entries its
owner wrote, with the owner's weights, which made them; where its attend reads weights of the reader's
own (attend_weights, which the owner's copy of would differ), through its own attend instead. The steps
of CODE_STEPS take a quantised cache's entries as their codes (quant.Codes: its own products over them,
never a dequantised copy of the cache); the others take load's dequantised entries.

Two caches run the steps, each a view over a ring.RingKVCache (any layout, any storage: quant.py) whose
write and read it uses, so that both see the buffers and positions the cache holds: ExactKVCache
(stream's exact_step: sample.py and bench.py by default) and FixedKVCache (compiled_decode: the step on
fixed shapes under torch.compile, sample.py --compile).
"""

import functools
import math

import torch

from lib.attention import rivals
from lib.attention.ring import RingKVCache, masked_softmax, slot_positions, visible
from model import Attention, GroupedQueryAttention, LowRankKVAttention, MultiHeadLatentAttention, sample


# -----------------------------------------------------------------------------
# The sampling loop

@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True, step=None,
             vocab_size=None, cache_class=RingKVCache, cache_dtype=None):
    """idx (B, T) continued by max_new_tokens sampled tokens: (B, T + max_new_tokens)."""
    new = stream(model, idx, max_new_tokens, temperature, top_k, use_cache, step, vocab_size, cache_class,
                 cache_dtype)
    return torch.cat([idx, *new], dim=1)


@torch.no_grad()
def stream(model, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True, step=None,
           vocab_size=None, cache_class=RingKVCache, cache_dtype=None):
    """Yield the max_new_tokens tokens (B, 1) that continue idx (B, T), as they are drawn: model.py's
    GPT.generate, the same loop and sampling (model.sample; temperature 0: greedy; vocab_size: only ids
    below it), with a choice. The prompt goes into a new cache of cache_class (RingKVCache, or a storage
    of quant.py's), then each token through step(model, token, cache) -> (logits, cache): by default a
    forward, the plain cached path; exact_step and compiled_decode (below) hand back a view over the
    same cache, in cache_dtype (autocast's, else the weights'). use_cache=False: a whole forward every
    token."""
    if step is not None and not use_cache:
        raise ValueError("a step feeds the KV cache: it needs use_cache=True")
    L = model.config.block_size
    # As GPT.generate: the model sees at most its last L tokens; when the text outgrows them, it starts
    # again from the last `keep`, prefilled into a new cache.
    keep, start, cache = L - L // 2, max(0, idx.size(1) - L), None
    max_len = min(L, idx.size(1) + max_new_tokens)  # the cache's: the longest the context gets
    device = idx.device.type
    dtype = cache_dtype or (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None)
    for _ in range(max_new_tokens):
        if idx.size(1) - start > L:
            start, cache = idx.size(1) - keep, None
        if cache is None:  # the whole context: the prompt, a new start, or any step without the cache
            cache = model.new_cache(idx.size(0), max_len, dtype, cache_class=cache_class) if use_cache \
                else None
            logits = model(idx[:, start:], cache=cache)[0][:, -1]
        elif step is None:
            logits = last_logits(model, idx[:, -1:], cache)
        else:
            logits, cache = step(model, idx[:, -1:], cache)
        next_token = sample(logits[:, :vocab_size], temperature, top_k)
        idx = torch.cat((idx, next_token), dim=1)
        yield next_token


def last_logits(model, token, cache):
    """The plain cached step: the logits (B, vocab) of token (B, 1) after the cache's prefix."""
    return model(token, cache=cache)[0][:, -1]


@torch.no_grad()
def teacher_forced(model, idx, cache_class=RingKVCache, dtype=None):
    """The logits (B, T, vocab) of idx (B, T) as decoding computes them: a token at a time, each through
    its variant's exact step over a cache of cache_class in dtype (the weights'): a quantised one's
    entries as it holds them."""
    cache = ExactKVCache(model.new_cache(idx.size(0), idx.size(1), dtype, cache_class=cache_class))
    return torch.cat([model(idx[:, t:t + 1], cache=cache)[0] for t in range(idx.size(1))], dim=1)


# -----------------------------------------------------------------------------
# The steps, and the plain equation they equal

def registered_step(attn):
    """attn's single-token step (STEPS, at the end of this file): its class's, or the nearest parent's
    while attn's class attends and rebuilds keys and values as that parent does (a class that
    overrides attend or cached_keys_values computes what the parent's step knows nothing of); None
    if none."""
    for cls in type(attn).__mro__:
        if cls in STEPS:
            same = all(getattr(type(attn), name) is getattr(cls, name)
                       for name in ("attend", "cached_keys_values"))
            return STEPS[cls] if same else None
    return None


def step_for(reader, source):
    """The step that decodes reader's query over the entries that source wrote (source is reader but
    under --cla and --yoco): reader's registered step, called with source's weights, unless the reader's
    attend reads weights of its own (attend_weights), which source's would stand in for; None: the plain
    equation (reference_step, or the cache's plain path)."""
    if reader is not source and getattr(reader, "attend_weights", ()):
        return None
    return registered_step(reader)


def reference_step(attn, q, cached, rope, mask, reader=None):
    """What every single-token step computes, by the plain equation: every cached position's keys and
    values rebuilt by attn, the layer whose weights made the entries (its cached_keys_values), then the
    reading layer's attend (reader's; attn's where None) over the positions that mask allows:
    (B, 1, H, d_v). Where that is model.Attention's, training's softmax(q_h . k_{h,s} / sqrt(d_qk)) v,
    it is written out here for one query, query head h reading key head h G // H (SDPA's kernel with a
    mask ran slower for one query on a CPU, in the fixed-shape path); else the reader's own attend, with
    the keys and values of a position the mask hides zeroed first: an empty slot of a fixed-shape cache
    may rebuild to 0 / 0 (a cached key RMS of 0), which SDPA would spread through the softmax."""
    k, v = attn.cached_keys_values(rope, **cached)  # (B, S, G, d_qk), (B, S, G, d_v)
    reader = reader or attn
    if type(reader).attend is not Attention.attend:
        if mask is not None:
            k, v = (t.masked_fill(~mask[0].view(1, -1, *[1] * (t.dim() - 2)), 0) for t in (k, v))
        return reader.attend(q, k, v, mask)
    B, _, H, d_qk = q.shape
    G, S = k.size(2), k.size(1)
    if G == H:  # a key head per query head: products and sums over the cache as it lies, (B, S, H, d),
        # where an einsum's GEMMs would first copy it head-major for one query each (in bf16 each product
        # is rounded, by at most half a bf16 unit of itself, before the fp32 sum)
        scores = (k * q).sum(-1).transpose(1, 2) / math.sqrt(d_qk)  # (B, H, S)
        a = masked_softmax(scores, mask, q.dtype)  # a hidden 0 / 0 score masked too
        return (a.transpose(1, 2).unsqueeze(-1) * v).sum(1).unsqueeze(1)  # (B, 1, H, d_v)
    # fewer key heads: query head g H/G + j reads key/value head g, by GEMMs (products as above would be
    # H/G times the cache)
    q = q[:, 0].view(B, G, H // G, d_qk)
    scores = torch.einsum("bgjd,bsgd->bgjs", q, k).reshape(B, H, S) / math.sqrt(d_qk)
    a = masked_softmax(scores, mask, q.dtype).view(B, G, H // G, S)
    return torch.einsum("bgjs,bsgd->bgjd", a, v).reshape(B, 1, H, -1)


# -----------------------------------------------------------------------------
# MHA, GQA, MQA: the cached keys and values themselves

def gqa_step(attn, q, cached, rope, mask):
    """Over a plain cache, the plain equation: where nothing is masked, the plain path's attention (the
    class's attend, SDPA), else reference_step's (training's softmax written out for one query); over a
    quantised cache's codes (quant.Codes), their own reads: the scores q_h . k_{g,s} and the weighted sum
    of the values, query head h reading head g = h G / H, each as the codes lie."""
    k, v = cached["k"], cached["v"]
    if torch.is_tensor(k):
        if mask is None:
            return attn.attend(q, *attn.cached_keys_values(rope, **cached))
        return reference_step(attn, q, cached, rope, mask)
    B, _, H, d = q.shape
    G = k.shape[2]
    q = q[:, 0].view(B, G, H // G, d)  # query head g H/G + j reads key/value head g
    scores = k.scores(q).view(B, H, -1) / math.sqrt(d)  # (B, H, S)
    a = masked_softmax(scores, mask, q.dtype).view(B, G, H // G, -1)
    return v.weighted_sum(a).view(B, 1, H, -1)


# -----------------------------------------------------------------------------
# LRKV: eq. 6 made exact under RoPE, and eq. 7

def lrkv_step(attn, q, cached, rope, mask):
    """The scores by key_scores, the values by attend_values: no cached position's key or value built."""
    scores = key_scores(attn, q, cached["k_shared"], cached["r_k"], cached["rho"], rope)  # (B, H, S)
    return attend_values(attn, masked_softmax(scores, mask, q.dtype), cached["v_shared"], cached["r_v"])


def key_scores_reference(attn, q, k_shared, r_k, rho, rope):
    """What key_scores computes, by the plain equation: every cached key built (attn.keys), then
    score_{h,s} = q_h . k_{h,s} / sqrt(d_h). (B, H, S)."""
    k = attn.keys(k_shared, r_k, rho, rope)  # (B, S, H, d_h)
    return torch.einsum("bhd,bshd->bhs", q[:, 0], k) / math.sqrt(attn.head_dim)


def key_scores(attn, q, k_shared, r_k, rho, rope):
    """One new token's attention scores over all S cached positions (rope (S, d_h): their rows of the
    RoPE table), the softmax's input (N, H, S) for N sequences, exact, without building any head's key.
    Vectors here are columns (model.py writes rows: X U_h is R_h, one row r_{h,s} per position). Head
    h's key at s is Rot_s(K_s + B_h r_{h,s}) / rho_{h,s} (K_h, then the QK norm and RoPE; K_s the
    shared key, B_h = B_h^K (d_h, r), r_{h,s} = R_h^K's row s), so for the normalised, rotated query q_h

        score_{h,s} = [ q_h . Rot_s(K_s) + (B_h^T Rot_s^T q_h) . r_{h,s} ] / rho_{h,s}

    This is the paper's eq. 6, q_h K_h^T = q_h K_shared^T + (q_h B_h^K)(R_h^K)^T, made exact: RoPE does
    not commute with B_h (a rotation of d_h dims cannot pass into r dims), so the rotation goes into the
    query side, position by position. The first term is MQA's, over the cached rotated K_shared. In the
    second, RoPE (model.apply_rope) takes each pair of dims i and i' = i + d_h/2 of a key at position s
    to (x_i cos + x_i' sin, x_i' cos - x_i sin) of s theta_i, and its transpose turns the query back:

        (Rot_s^T q)_i  = q_i cos(s theta_i) - q_i' sin(s theta_i)
        (Rot_s^T q)_i' = q_i sin(s theta_i) + q_i' cos(s theta_i)

    so with B_h[i] the i-th row of B_h (r numbers)

        B_h^T Rot_s^T q_h = sum_i cos(s theta_i) (q_i B_h[i] + q_i' B_h[i'])
                                + sin(s theta_i) (q_i B_h[i'] - q_i' B_h[i])

    which for every s, h and sequence n at once is rope (S, d_h), the rows [cos | sin], times one
    (d_h, N H r) matrix M built from every sequence's queries and every B_h: one GEMM for the batch
    (positions are absolute, so every sequence's rope rows are the same), the rebuild's S H r d_h
    multiply-adds a sequence without its (S, H, d_h) tensors and their norm and rotation. No exact form
    does less with this cache: each score needs a d_h-wide rotated residual key of which the cache holds
    r numbers. The GEMM runs over chunks of positions (_residual_key_scores)."""
    H, d_h, r = attn.n_head, attn.head_dim, attn.lrkv_rank
    q = q[:, 0] / math.sqrt(d_h)  # (N, H, d_h), the softmax's scale taken in
    N, half = q.size(0), d_h // 2
    # the products in fp32 at least (bf16's elementwise products ran slower than fp32's here), M in q's dtype
    wide = torch.promote_types(q.dtype, torch.float32)
    q1, q2 = q.to(wide).permute(2, 0, 1).unsqueeze(-1).chunk(2, dim=0)  # (d_h/2, N, H, 1): q_i, q_i'
    B_h = attn.B_k.to(wide).view(H, d_h, r).transpose(0, 1).unsqueeze(1)  # (d_h, 1, H, r): row i of every B_h
    B_h1, B_h2 = B_h.chunk(2, dim=0)  # (d_h/2, 1, H, r) each: rows i and i'
    M = q.new_empty(d_h, N, H, r)  # row j goes with column j of rope, [cos | sin]
    M[:half].copy_(torch.addcmul(q1 * B_h1, q2, B_h2))  # the coefficients of cos(s theta_i) above
    M[half:].copy_(torch.addcmul(q1 * B_h2, q2, B_h1, value=-1))  # those of sin(s theta_i)
    residual_term = _residual_key_scores(rope.to(q.dtype), M, r_k)  # (N, S, H)
    if torch.is_tensor(k_shared):
        # (N, H, S): + MQA's
        scores = torch.baddbmm(residual_term.transpose(1, 2), q, k_shared.transpose(1, 2))
    else:  # a quantised cache's codes (quant.Codes), read as they are
        scores = residual_term.transpose(1, 2) + k_shared.scores(q.unsqueeze(1)).squeeze(1)
    return scores / rho.transpose(1, 2)


def _residual_key_scores(rope, M, r_k):
    """(B_h^T Rot_s^T q_h) . r_{h,s} for every sequence n, position s and head h: (N, S, H), from the RoPE
    rows rope (S, d_h), M (d_h, N, H, r) and r_k (N, S, H, r), a chunk of positions at a time, each chunk's
    product of every sequence by one GEMM, (chunk, d_h) @ (d_h, N H r). All at once, rope @ M would be an
    (S, N, H, r) tensor as large as r_k, written to memory and read back; a chunk's stays in the processor's
    cache between the GEMM and the dot product with r_k (docs/decoding.md: the roofline and the chunk
    sizes). r_k may be a quantised cache's codes (quant.Codes), whose dot reads a chunk's codes and takes
    the product (N, n, H, r) as a view of the GEMM's result, laid out as the codes lie."""
    N, S, H, r = r_k.shape
    M = M.view(M.size(0), N * H * r)
    chunk_bytes = 2**25 if M.is_cuda else 2**22
    chunk = max(1, chunk_bytes // (N * H * r * M.element_size()))
    if not torch.is_tensor(r_k) and r_k.dot_position_last:  # positions contiguous: (N H r, n), then a view
        return torch.cat([r_k.dot((M.T @ rope[s:s + chunk].T).view(N, H, r, -1).permute(0, 3, 1, 2),
                                  s, min(s + chunk, S)) for s in range(0, S, chunk)], dim=1)
    if not torch.is_tensor(r_k):
        return torch.cat([r_k.dot((rope[s:s + chunk] @ M).view(-1, N, H, r).transpose(0, 1), s,
                                  min(s + chunk, S)) for s in range(0, S, chunk)], dim=1)
    # the dot product over r in place in the GEMM's fresh result: no second chunk-sized tensor
    return torch.cat([(rope[s:s + chunk] @ M).view(-1, N, H, r).mul_(r_k[:, s:s + chunk].transpose(0, 1))
                      .sum(-1).transpose(0, 1) for s in range(0, S, chunk)], dim=1)


def attend_values_reference(attn, a, v_shared, r_v):
    """What attend_values computes, by the plain equation: every head's cached V_h built
    (attn.values), then a_h V_h. (B, 1, H, d_h)."""
    return torch.einsum("bhs,bshd->bhd", a, attn.values(v_shared, r_v)).unsqueeze(1)


def attend_values(attn, a, v_shared, r_v):
    """One new token's output (N, 1, H, d_h) from its attention a (N, H, S) over the cached values, by
    eq. 7: a_h V_h = a_h V_shared + (a_h R_h^V) (B_h^V)^T, as two products so that V_shared is never
    copied per head, B_h^V applied once, to the result. The a_h R_h^V, plainly einsum("nhs,nshr->nhr",
    a, r_v), are one GEMM instead: every head's a_h times every head's R^V, (H, S) by (S, H r) per
    sequence, (N, H, H r), of which head h keeps its own r columns: the diagonal of the (H, H) blocks,
    computed whole for it. The GEMM does H times the work but reads r_v once, in its own layout, where
    the einsum would first copy all of r_v per head (docs/decoding.md measures both)."""
    N, H, _ = a.shape
    if not torch.is_tensor(v_shared):  # a quantised cache's codes (quant.Codes): each head's a_h by its R_h^V
        y_res = r_v.weighted_sum(a.unsqueeze(2)).transpose(1, 2)  # (N, 1, H, r)
        return v_shared.weighted_sum(a.unsqueeze(1)) + attn.residual(y_res, attn.B_v)
    y_shared = (a @ v_shared).unsqueeze(1)  # (N, 1, H, d_h)
    y_all = (a @ r_v.flatten(2)).view(N, H, H, attn.lrkv_rank)  # (N, H, H, r): each head's a by each R_h'^V
    heads = torch.arange(H, device=a.device)
    y_res = y_all[:, heads, heads].unsqueeze(1)  # (N, 1, H, r): the diagonal, a_h R_h^V
    return y_shared + attn.residual(y_res, attn.B_v)


# -----------------------------------------------------------------------------
# MLA: W_up^K absorbed into the query, W_up^V applied to the attended latent

def mla_step(attn, q, cached, rope, mask):
    """a_h V_h = (a_h c) W_up,h^V exactly: W_up^V applied once, to the attended latent."""
    y = latent_attention(attn, q, cached["c"], cached["k_rope"], cached["rho"], mask)  # (B, 1, H, d_c)
    W_up_v = attn.W_up_v.weight.view(attn.n_head, attn.head_dim, attn.kv_lora_rank)
    return torch.einsum("bthc,hdc->bthd", y, W_up_v)


def latent_attention_reference(attn, q, c, k_rope, rho, mask):
    """What latent_attention computes, by the plain equation: every cached key built and divided
    by its cached RMS, then softmax(q_h . k_{h,s} / sqrt(d_h + d_R)) applied to the latent.
    (B, 1, H, d_c)."""
    k = attn.keys(c, k_rope) / rho.unsqueeze(-1)  # (B, S, H, d_h + d_R)
    scores = torch.einsum("bhd,bshd->bhs", q[:, 0], k) / math.sqrt(attn.qk_dim)
    return (masked_softmax(scores, mask, q.dtype) @ c).unsqueeze(1)


def latent_attention(attn, q, c, k_rope, rho, mask):
    """One new token's attention over all S cached positions, exact, without building any key.
    Head h's key at s is [c_s W_up,h^K | k_R,s] / rho_{h,s}, rho the RMS of that concatenation,
    cached when s was new, so for the normalised, rotated query q_h = [q_h^nope | q_h^R]

        score_{h,s} = [ (q_h^nope (W_up,h^K)^T) . c_s + q_h^R . k_R,s ] / rho_{h,s}

    The first term is absorbed into the latent, as DeepSeek-V2 absorbs it: the scores cost
    d_c + d_R per head and position instead of d_h + d_R, and read only the cache. Without
    the cached rho, every step would apply W_up^K to the whole cache again (S d_c H d_h
    multiply-adds), just for the norm. Returns a_h c: (B, 1, H, d_c)."""
    H, d_h = attn.n_head, attn.head_dim
    q_nope, q_rope = q[:, 0].split((d_h, attn.rope_dim), dim=-1)  # (B, H, d_h), (B, H, d_R)
    W_up_k = attn.W_up_k.weight.view(H, d_h, attn.kv_lora_rank)
    q_latent = (q_nope.unsqueeze(2) @ W_up_k).squeeze(2)  # (B, H, d_c)
    if torch.is_tensor(c):
        rope_term = q_rope @ k_rope[:, :, 0].transpose(1, 2)  # (B, H, S)
        scores = torch.baddbmm(rope_term, q_latent, c.transpose(1, 2))  # (B, H, S)
    else:  # a quantised cache's codes (quant.Codes), read as they are
        scores = (k_rope.scores(q_rope.unsqueeze(1)) + c.scores(q_latent.unsqueeze(1))).squeeze(1)
    scores = scores / (rho.transpose(1, 2) * math.sqrt(attn.qk_dim))
    a = masked_softmax(scores, mask, q.dtype)  # (B, H, S)
    return (a @ c).unsqueeze(1) if torch.is_tensor(c) else c.weighted_sum(a.unsqueeze(1))


# -----------------------------------------------------------------------------
# The caches that run the steps, and stream's steps over them

def rows_agree(cache):
    """A ValueError of one line where cache's rows are at different positions (ring.py's left-padded rows):
    the steps take one set of RoPE rows and one mask for the batch, so such rows decode by the plain path."""
    if cache.starts is not None:
        raise ValueError("rows at different positions (left-padded) decode by the plain cached path: the "
                         "single-token steps take one position for the batch")


class ExactKVCache:
    """A view over a RingKVCache (one a prefill has filled, say) from its position on: a single new
    token attends through its variant's registered step, reading the entries and positions the cache's
    own read gives; a chunk, or a variant without a step, takes the cache's plain path. The position
    and buffers are the cache's: the view moves them on."""

    def __init__(self, cache):
        if not isinstance(cache, RingKVCache):
            raise TypeError(f"an ExactKVCache views a RingKVCache (new_cache(..., cache_class=RingKVCache)), "
                            f"not a {type(cache).__name__}")
        rows_agree(cache)
        self.cache = cache

    @property
    def pos(self):
        return self.cache.pos

    @pos.setter
    def pos(self, pos):  # tools/bench.py steps over the same positions again
        self.cache.pos = pos

    def next_rope(self, T):
        return self.cache.next_rope(T)

    def advance(self, T):
        self.cache.advance(T)

    def attend(self, attn, q, x, rope):
        cache = self.cache
        step = step_for(attn, cache.sources[cache.kv_source[attn.layer]])
        if step is None or q.size(1) > 1:
            return cache.attend(attn, q, x, rope)
        cache.write(attn, x, rope)
        source, entries, rope, mask = cache.read(attn, 1, codes=step in CODE_STEPS)
        return step(source, q, entries, rope, mask)


class FixedKVCache:
    """A view over a RingKVCache, from its position on, behind shapes that no longer change, for
    torch.compile: pos is a (1,) tensor; a token's entries go to its slot pos % length through the
    cache's store; the token attends over every slot (load of them all) through its variant's step
    (step_for), or reference_step, the reading layer's own attend, with the mask that `visible` makes of
    the slots' positions (ring.slot_positions: an empty slot is negative, so masked; LRKV's and MLA's
    scores there are 0 / 0, which the mask overwrites). A step's cost no longer depends on its
    position. pos moves outside the compiled step (compiled_decode, in place, so that the compiled graph
    reads the new value), so advance does nothing; the cache's own pos stays where the view began."""

    def __init__(self, cache):
        if not isinstance(cache, RingKVCache):
            raise TypeError(f"a FixedKVCache views a RingKVCache, not a {type(cache).__name__}")
        rows_agree(cache)
        self.cache = cache
        self.pos = torch.tensor([cache.pos], device=cache.rope.device)
        self.free = cache.max_len - cache.pos  # the positions left, counted on the host: no sync to check
        for layer in cache.layers:
            for buf in layer.values():
                torch._dynamo.mark_static_address(buf)  # a CUDA graph may keep its address

    def next_rope(self, T):
        if T != 1:
            raise ValueError(f"a fixed-shape cache takes one token a step, not {T}")
        return self.cache.rope[self.pos]  # (1, rope_dim)

    def advance(self, T):
        pass

    def attend(self, attn, q, x, rope):
        cache = self.cache
        owner, length = cache.kv_source[attn.layer], cache.length(cache.kv_source[attn.layer])
        if owner == attn.layer:
            cache.store(owner, self.pos % length, attn.cache_entries(x, rope))
        positions = slot_positions(length, self.pos + 1, self.pos.device)  # (length,), negative: empty
        source = cache.sources[owner]
        step = step_for(attn, source)
        entries = (cache.load_codes if step in CODE_STEPS else cache.load)(owner, slice(None))
        mask = visible(self.pos, positions, cache.windows[attn.layer])  # (1, length)
        rope = cache.rope[positions.clamp(min=0)]
        if step is None:
            return reference_step(source, q, entries, rope, mask, reader=attn)
        return step(source, q, entries, rope, mask)


def exact_step(model, token, cache):
    """stream's step through every layer's registered single-token step: the last logits (B, vocab) of
    token (B, 1), and the cache: the first time one a prefill has just filled, then an ExactKVCache
    over it."""
    if not isinstance(cache, ExactKVCache):
        cache = ExactKVCache(cache)
    return last_logits(model, token, cache), cache


@functools.cache
def compiled_fixed_step():
    """last_logits compiled, one step for every model and cache of the same shapes (fixed ones: the same
    at every position): torch.compile lifts modules' weights and the cache's buffers into graph inputs,
    so new caches reuse the graph. On a GPU, "reduce-overhead" replays it as a CUDA graph, one launch
    for the whole step. Made on first use: importing torch.compile's machinery costs a process about
    2 s on a CPU, which sample.py without --compile need not pay."""
    return torch.compile(last_logits, mode="reduce-overhead" if torch.cuda.is_available() else None)


def compiled_step(model, token, cache):
    return compiled_fixed_step()(model, token, cache)


def compiled_decode(model, token, cache):
    """stream's step, compiled: a cache that a prefill has just filled gets a FixedKVCache over it on
    its first step, then the compiled step runs and the position moves on."""
    if not isinstance(cache, FixedKVCache):
        cache = FixedKVCache(cache)
    if cache.free == 0:  # past max_len, rope[pos] would fail inside the compiled step (on a GPU, an assert)
        max_len = cache.cache.max_len
        raise ValueError(f"KV cache holds {max_len} tokens, {max_len + 1} were asked for")
    # contiguous: a column of stream's growing idx has a new stride at every step, which recompiles
    logits = compiled_step(model, token.contiguous(), cache)
    cache.pos += 1
    cache.free -= 1
    return logits, cache


# -----------------------------------------------------------------------------
# Every variant's exact single-token step, by class, in one place: the paper's two that cache less
# than their keys and values (above), and the rivals' (lib/attention/rivals.py, each beside its
# class). A subclass inherits its parent's step; an entry of None gives a class the plain cached path.

STEPS = {
    GroupedQueryAttention: gqa_step,
    LowRankKVAttention: lrkv_step,
    MultiHeadLatentAttention: mla_step,
    rivals.GroupedTiedAttention: rivals.gta_step,
    rivals.GroupedLatentAttention: rivals.gla_step,
    rivals.MultiHeadLowRankAttention: rivals.mlra_step,
    rivals.TensorProductAttention: rivals.tpa_step,
}
# The steps that take a quantised cache's entries as its codes (quant.Codes, ring.RingKVCache.load_codes);
# every other reads them dequantised (load)
CODE_STEPS = {gqa_step, lrkv_step, mla_step}
