"""What the tests know of each variant apart from its code, and the computations they check the
code against: REFERENCES, one Reference per --attn name, each from its paper's formulas;
naive_attention and naive_forward, a layer and the whole model in float64, head by head, softmax
written out; and the tiny models, decodes and greedy loops the tests share. No test lives here:
test_model.py, tests/test_decode.py, test_convert.py, test_rivals.py and test_variant.py import it."""

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import pytest
import torch

from lib.attention.layout import key_layers
from lib.attention.ring import RingKVCache
from model import GPT, GPTConfig

TINY = GPTConfig(
    block_size=32, vocab_size=61, n_layer=2, n_head=4, n_embd=64, head_dim=16,
    n_kv_head=2, kv_lora_rank=24, rope_head_dim=8, lrkv_rank=4,
    gta_kv_heads=2, gla_latent_dim=12, mlra_latent_dim=8,  # lib/attention/rivals.py's, to the tiny shape
)
MIB = 2**20
# bf16 MiB at 128M (12 layers x 2048 tokens x 2 bytes) per cached element per token and layer
MIB_PER_ELEMENT = 12 * 2048 * 2 / MIB


def tiny_model(attn, seed=0, **overrides):
    """A tiny GPT whose every weight is random: the real init zeroes W_o, which would hide
    the attention from any comparison of outputs."""
    torch.manual_seed(seed)
    model = GPT(replace(TINY, attn=attn, **overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5 / math.sqrt(p.size(-1)))
    return model.eval()


def naive_rope(x, positions, rot_dim, theta):
    """RoPE through complex numbers: dim i of the rotated block pairs with i + rot_dim/2."""
    half = rot_dim // 2
    x_pass, x_rot = x[..., :-rot_dim], x[..., -rot_dim:]
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rot_dim)
    turn = torch.polar(torch.ones(len(positions), half, dtype=torch.float64), positions[:, None] * freqs)
    z = torch.complex(x_rot[..., :half], x_rot[..., half:]) * turn.conj()
    return torch.cat((x_pass, z.real, z.imag), dim=-1)


def rms(t):
    return t / t.pow(2).mean(-1, keepdim=True).add(torch.finfo(t.dtype).eps).sqrt()


def lin(t, layer):
    return t @ layer.weight.double().t()


@dataclass
class Reference:
    """Everything the tests know of one variant from its formulas, apart from its code. Functions
    take the layer (or the config c and the layer's index) as their field's comment says."""
    keys_values: Callable  # (layer, x (1, T, d) float64, c) -> H keys (T, d_qk), H values (T, d_h), rot_dim:
    # the paper's per-head keys and values, in float64, and how many of each key's last dims RoPE rotates;
    # optionally a fourth item, {"scale": s}, for heads that attend to several key/value pairs apart (MLRA's
    # latent heads): keys[h] and values[h] are then lists, one softmax each, their outputs summed times s
    params: Callable  # (c, layer) -> (key/value parameters besides W_q, W_o and the MLP, d_qk): a variant
    # without W_q counts its query parameters here too; a third entry, where a variant has one, is its
    # multiply-adds of q k^T and a v per head and key (default d_qk + d_h)
    paper_cache_mib: float  # its KV cache at 128M (12 layers, 2,048 tokens, bf16) as the paper counts it
    decoder_extra_mib: float  # what its decoder caches besides (LRKV's and MLA's key RMSs)
    cache_elements: Callable  # (c, layer) -> its cached elements per token in that layer, all of them
    key_weights: tuple  # the weights that make its keys: scaled down, keys far below bf16's eps
    key_builder: Callable  # layer -> (object, method name, count): where it builds per-head keys, count
    # (the call's arguments) -> the positions a call builds keys for, None where it builds something else
    head_keys: Callable = None  # (layer, x (N, d), c) -> (N, H, d_qk): per-head keys from its own projections
    # before the QK norm and RoPE (the class's head_key_weights must match them); for a variant whose
    # heads are no linear maps of x (its own head_qk_grams), (layer, None, c) -> its heads' lifted maps;
    # None for a variant that heads.py gives no maps of
    queries: Callable = None  # (layer, x (1, T, d) float64, c) -> H queries (T, d_qk) before the QK norm
    # and RoPE, for a variant without W_q (TPA); None: x W_h^Q
    score_scale: Callable = None  # (layer, h) -> the factor on head h's scores q k^T / sqrt(d_qk) in that
    # layer, for a variant with a softmax of its own (tests/variants.py's ScaledSoftmaxAttention); None: 1


class References(dict):
    """REFERENCES: one Reference per --attn name. A variant without one fails the test that needs it,
    naming what to add: never a skip, never a default."""

    def __missing__(self, attn):
        lines = Path(__file__).read_text().splitlines()
        line = next(n for n, text in enumerate(lines, 1) if text.startswith("REFERENCES = "))
        pytest.fail(f"REFERENCES has no entry for --attn={attn}: add a Reference(...) for it at "
                    f"tests/references.py:{line} (a variant defined in a test file registers its own, as "
                    "test_variant.py's VARIANTS do)")


# The paper's five: each one's keys and values head by head (Reference.keys_values), its per-head
# keys from its projections (head_keys) and where its code builds them (key_builder)

def grouped_keys_values(kv_heads):
    """MHA, GQA, MQA: G = kv_heads(config) key/value heads, query head h reading head h G // H."""
    def keys_values(attn, x, config):
        H, G, d_h, T = config.n_head, kv_heads(config), config.head_dim, x.size(1)
        k, v = (lin(x[0], W).view(T, G, d_h) for W in (attn.W_k, attn.W_v))
        return [k[:, h * G // H] for h in range(H)], [v[:, h * G // H] for h in range(H)], d_h
    return keys_values


def lrkv_keys_values(attn, x, config):
    """Eq. 6 per head: W_h = W_shared + U_h B_h^T, built whole (transposed, as nn.Linear holds it)."""
    H, d_h, r = config.n_head, config.head_dim, attn.lrkv_rank  # the layer's own rank
    U_k, U_v = (U.weight.double().view(H, r, -1) for U in (attn.U_k, attn.U_v))
    B_k, B_v = (B.double().view(H, d_h, r) for B in (attn.B_k, attn.B_v))
    W_k = [attn.W_shared_k.weight.double() + B_k[h] @ U_k[h] for h in range(H)]
    W_v = [attn.W_shared_v.weight.double() + B_v[h] @ U_v[h] for h in range(H)]
    return [x[0] @ W_k[h].t() for h in range(H)], [x[0] @ W_v[h].t() for h in range(H)], d_h


def mla_keys_values(attn, x, config):
    """Per head [up-projected latent | the shared RoPE key]; RoPE rotates the last d_R dims."""
    H, d_h, T = config.n_head, config.head_dim, x.size(1)
    c = rms(lin(x, attn.W_down))[0]
    k_nope = lin(c, attn.W_up_k).view(T, H, d_h)
    v_all = lin(c, attn.W_up_v).view(T, H, d_h)
    k_rope = lin(x[0], attn.W_kr)
    keys = [torch.cat((k_nope[:, h], k_rope), -1) for h in range(H)]
    return keys, [v_all[:, h] for h in range(H)], config.rope_head_dim


def grouped_head_keys(layer, x, c):
    G = layer.n_kv_head
    return layer.W_k(x).view(len(x), G, c.head_dim).repeat_interleave(c.n_head // G, dim=1)


def lrkv_head_keys(layer, x, c):  # K_h = X W_shared^K + (X U_h^K)(B_h^K)^T, per head (its own rank)
    r = layer.lrkv_rank
    residual_coords = layer.U_k(x).view(len(x), -1, r)  # (N, H, r): X U_h
    B = layer.B_k.view(-1, c.head_dim, r)  # (H, d_h, r)
    residual_coords = residual_coords.repeat_interleave(B.size(0) // residual_coords.size(1), dim=1)
    return layer.W_shared_k(x)[:, None] + torch.einsum("nhr,hdr->nhd", residual_coords, B)


def mla_head_keys(layer, x, c):  # the latent norm taken as identity
    k_nope = layer.W_up_k(layer.W_down(x)).view(len(x), c.n_head, c.head_dim)
    return torch.cat((k_nope, layer.W_kr(x)[:, None].expand(len(x), c.n_head, c.rope_head_dim)), dim=-1)


def grouped_key_builder(layer):
    """MHA, GQA and MQA build per-head keys with W_k and cache them ready."""
    return layer.W_k, "forward", lambda x: x.size(1)


def lrkv_key_builder(layer):
    """LRKV builds them as R_h^K (B_h^K)^T: residual with factor B_k."""
    return layer, "residual", lambda R, factor: R.size(1) if factor is layer.B_k else None


def mla_key_builder(layer):
    """MLA, with the W_up_k module's call: a step that used W_up_k.weight directly on the cache
    would escape it."""
    return layer.W_up_k, "forward", lambda c: c.size(1)


# The rivals (lib/attention/rivals.py)

# Each rival's keys and values from its paper's equations, in float64, head by head, as
# naive_attention takes them (Reference.keys_values)

def gta_keys_values(attn, x, config):
    """2505.21487, GTA: group g's tied state S_g = x W_g^KV is its value, and its first d_h/2 dims with the
    shared RoPE key x W^KR its key; head h reads group h G // H. RoPE on the last d_h/2 dims."""
    H, G, d_h, T = config.n_head, config.gta_kv_heads, config.head_dim, x.size(1)
    S = lin(x[0], attn.W_kv).view(T, G, d_h)
    k_rope = lin(x[0], attn.W_kr)  # (T, d_h/2)
    keys = [torch.cat((S[:, h * G // H, :d_h // 2], k_rope), -1) for h in range(H)]
    return keys, [S[:, h * G // H] for h in range(H)], d_h // 2


def gla_keys_values(attn, x, config):
    """2505.21487, GLA: latent head j = norm(x W_down,j), read by heads h with h n // H = j, each through
    its own W_up,h^K and W_up,h^V (rows h d_h on of the stacked up-projections); the RoPE key shared."""
    H, n, d_c = config.n_head, config.gla_latent_heads, config.gla_latent_dim
    d_h, T = config.head_dim, x.size(1)
    c = rms(lin(x[0], attn.W_down).view(T, n, d_c))
    W_k, W_v = attn.W_up_k.weight.double(), attn.W_up_v.weight.double()
    k_rope = lin(x[0], attn.W_kr)
    rows = [slice(h * d_h, (h + 1) * d_h) for h in range(H)]
    keys = [torch.cat((c[:, h * n // H] @ W_k[rows[h]].t(), k_rope), -1) for h in range(H)]
    return keys, [c[:, h * n // H] @ W_v[rows[h]].t() for h in range(H)], config.rope_head_dim


def mlra_keys_values(attn, x, config):
    """2603.02188, MLRA-4: every head h attends to each latent head i = norm(x W_down,i) apart, through
    W_up,i,h (rows (i H + h) d_h on), and sums the n outputs times 1/sqrt(n)."""
    H, n, d_c = config.n_head, config.mlra_latent_heads, config.mlra_latent_dim
    d_h, T = config.head_dim, x.size(1)
    c = rms(lin(x[0], attn.W_down).view(T, n, d_c))
    W_k, W_v = attn.W_up_k.weight.double(), attn.W_up_v.weight.double()
    k_rope = lin(x[0], attn.W_kr)

    def rows(i, h):
        return slice((i * H + h) * d_h, (i * H + h + 1) * d_h)
    keys = [[torch.cat((c[:, i] @ W_k[rows(i, h)].t(), k_rope), -1) for i in range(n)] for h in range(H)]
    values = [[c[:, i] @ W_v[rows(i, h)].t() for i in range(n)] for h in range(H)]
    return keys, values, config.rope_head_dim, {"scale": 1 / math.sqrt(n)}


def tpa_factor_sum(x, W_a, W_b, H, d_h):
    """2501.06425 section 3's (1/R) sum_r a_r(x) (x) b_r(x) for each token, head by head: H of (T, d_h)."""
    T = x.size(0)
    a, b = lin(x, W_a).view(T, -1, H), lin(x, W_b).view(T, -1, d_h)
    R = a.size(1)
    return [sum(a[:, r, h, None] * b[:, r] for r in range(R)) / R for h in range(H)]


def tpa_queries(attn, x, config):
    """2501.06425 section 3: TPA has no W_q, its queries are (1/R_Q) sum_r a_r^Q (x) b_r^Q too."""
    return tpa_factor_sum(x[0], attn.W_aq, attn.W_bq, config.n_head, config.head_dim)


def tpa_keys_values(attn, x, config):
    """2501.06425 section 3: keys and values each (1/R) sum_r a_r (x) b_r of the token's factors.
    naive_attention rotates the sum: RoPE on every b_r^K, as the paper puts it, is the same, RoPE
    being linear and the same for every r."""
    H, d_h = config.n_head, config.head_dim
    keys = tpa_factor_sum(x[0], attn.W_ak, attn.W_bk, H, d_h)
    values = tpa_factor_sum(x[0], attn.W_av, attn.W_bv, H, d_h)
    return keys, values, d_h


# Each rival's per-head keys (N, H, d_qk) from its own projections, before the QK norm and RoPE
# (Reference.head_keys)

def gta_head_keys(layer, x, c):
    G, d_h = c.gta_kv_heads, c.head_dim
    S = layer.W_kv(x).view(len(x), G, d_h)[:, torch.arange(c.n_head) * G // c.n_head]
    return torch.cat((S[..., :d_h // 2], layer.W_kr(x)[:, None].expand(-1, c.n_head, -1)), -1)


def gla_head_keys(layer, x, c):  # the latent norm taken as identity
    H, n, d_c, d_h = c.n_head, c.gla_latent_heads, c.gla_latent_dim, c.head_dim
    latent = layer.W_down(x).view(len(x), n, d_c)
    W = layer.W_up_k.weight.view(H, d_h, d_c)
    k_nope = torch.stack([latent[:, h * n // H] @ W[h].t() for h in range(H)], 1)
    return torch.cat((k_nope, layer.W_kr(x)[:, None].expand(-1, H, -1)), -1)


def mlra_head_keys(layer, x, c):  # the sum over the latent heads (MultiHeadLowRankAttention.head_key_weights)
    H, n, d_c, d_h = c.n_head, c.mlra_latent_heads, c.mlra_latent_dim, c.head_dim
    latent = layer.W_down(x).view(len(x), n, d_c)
    W = layer.W_up_k.weight.view(n, H, d_h, d_c)
    k_nope = torch.stack([sum(latent[:, i] @ W[i, h].t() for i in range(n)) for h in range(H)], 1)
    return torch.cat((k_nope, n * layer.W_kr(x)[:, None].expand(-1, H, -1)), -1)


def tpa_lifted_maps(W_a, W_b, H, d_h):
    """Every head's symmetric lift M_h (d^2, d_h), built whole: q_h(x) = (x (x) x) M_h, with
    M_h[(i, j)] = (1/2R) sum_r (alpha_{r,h}[i] B_r[j] + alpha_{r,h}[j] B_r[i])."""
    alpha = W_a.weight.double().view(-1, H, W_a.in_features)  # (R, H, d)
    B = W_b.weight.double().view(-1, d_h, W_b.in_features).transpose(1, 2)  # (R, d, d_h)
    R, d = alpha.size(0), alpha.size(-1)
    M = sum(torch.einsum("hi,ja->hija", alpha[r], B[r]) + torch.einsum("hj,ia->hija", alpha[r], B[r])
            for r in range(R)) / (2 * R)
    return M.reshape(H, d * d, d_h)


def tpa_head_maps(layer, x, c):
    """x unused: TPA's heads are no linear maps of x, and these are their lifted query and key maps."""
    return (tpa_lifted_maps(layer.W_aq, layer.W_bq, c.n_head, c.head_dim),
            tpa_lifted_maps(layer.W_ak, layer.W_bk, c.n_head, c.head_dim))


def rows_builder(name):
    """A key_builder: the nn.Linear whose call makes the new token's key entries."""
    return lambda layer: (getattr(layer, name), "forward", lambda x: x.size(1))


def keys_builder(layer):
    """GLA's and MLRA's: keys, which cache_entries calls on the new token for the key RMS."""
    return layer, "keys", lambda c, k_rope: c.size(1)


# LRKV's and MLA's decoders also cache each head's key RMS, which the paper does not count:
# 12 layers x 2048 tokens x 6 heads x 2 bytes (+0.7% and +3.1%; see LowRankKVAttention and
# MultiHeadLatentAttention)
KEY_RMS_MIB = 12 * 2048 * 6 * 2 / MIB


# One Reference per variant, by its --attn name: where a new variant adds its entry. For the rivals,
# paper_cache_mib is its paper's cache formula at 128M (12 layers, 6 heads of 128, 2,048 tokens, bf16);
# cache_elements what this decoder caches per token and layer; decoder_extra_mib the difference, the
# key RMSs that GLA and MLRA cache as MLA here does
REFERENCES = References({
    "mha": Reference(
        keys_values=grouped_keys_values(lambda c: c.n_head), head_keys=grouped_head_keys,
        params=lambda c, layer: (2 * c.n_head * c.n_embd * c.head_dim, c.head_dim),  # the paper's section 1
        paper_cache_mib=72, decoder_extra_mib=0, cache_elements=lambda c, layer: 2 * c.n_head * c.head_dim,
        key_weights=("W_k",), key_builder=grouped_key_builder),
    "gqa": Reference(
        keys_values=grouped_keys_values(lambda c: c.n_kv_head), head_keys=grouped_head_keys,
        params=lambda c, layer: (2 * c.n_kv_head * c.n_embd * c.head_dim, c.head_dim),
        paper_cache_mib=36, decoder_extra_mib=0, cache_elements=lambda c, layer: 2 * c.n_kv_head * c.head_dim,
        key_weights=("W_k",), key_builder=grouped_key_builder),
    "mqa": Reference(
        keys_values=grouped_keys_values(lambda c: 1), head_keys=grouped_head_keys,
        params=lambda c, layer: (2 * c.n_embd * c.head_dim, c.head_dim),
        paper_cache_mib=12, decoder_extra_mib=0, cache_elements=lambda c, layer: 2 * c.head_dim,
        key_weights=("W_k",), key_builder=grouped_key_builder),
    "lrkv": Reference(
        keys_values=lrkv_keys_values, head_keys=lrkv_head_keys,
        params=lambda c, layer: (  # the paper's section 1
            2 * c.n_embd * c.head_dim + 2 * c.n_head * c.lrkv_rank * (c.n_embd + c.head_dim), c.head_dim),
        paper_cache_mib=37.875, decoder_extra_mib=KEY_RMS_MIB,
        cache_elements=lambda c, layer: 2 * c.head_dim + 2 * c.n_head * c.lrkv_rank + c.n_head,
        key_weights=("W_shared_k", "U_k"), key_builder=lrkv_key_builder),
    "mla": Reference(
        keys_values=mla_keys_values, head_keys=mla_head_keys,
        params=lambda c, layer: (c.n_embd * c.kv_lora_rank + 2 * c.kv_lora_rank * c.n_head * c.head_dim
                                 + c.n_embd * c.rope_head_dim, c.head_dim + c.rope_head_dim),
        paper_cache_mib=9, decoder_extra_mib=KEY_RMS_MIB,
        cache_elements=lambda c, layer: c.kv_lora_rank + c.rope_head_dim + c.n_head,
        key_weights=("W_up_k", "W_kr"), key_builder=mla_key_builder),
    "gta": Reference(
        keys_values=gta_keys_values,
        head_keys=gta_head_keys,
        # W^KV (d x G d_h) and W^KR (d x d_h/2)
        params=lambda c, layer: (
            c.n_embd * (c.gta_kv_heads * c.head_dim + c.head_dim // 2), c.head_dim),
        # arXiv 2505.21487, GTA: the tied KV, G d_h, plus the RoPE key's d_h/2: (3 x 128 + 64)
        paper_cache_mib=(3 * 128 + 128 // 2) * MIB_PER_ELEMENT,
        decoder_extra_mib=0,
        cache_elements=lambda c, layer: c.gta_kv_heads * c.head_dim + c.head_dim // 2,
        key_weights=("W_kv", "W_kr"),
        key_builder=rows_builder("W_kv"),
    ),
    "gla": Reference(
        keys_values=gla_keys_values,
        head_keys=gla_head_keys,
        # W_down (d x n d_c), H heads' W_up^K and W_up^V (d_c x d_h), W^KR (d x d_R)
        params=lambda c, layer: (
            c.n_embd * c.gla_latent_heads * c.gla_latent_dim + 2 * c.gla_latent_dim * c.n_head * c.head_dim
            + c.n_embd * c.rope_head_dim, c.head_dim + c.rope_head_dim),
        # arXiv 2505.21487, GLA: GLA-2 caches 2 latent heads of 2 d_h and the d_h/2 RoPE key,
        # 4.5 d_h (2 x 256 + 64)
        paper_cache_mib=(2 * 2 * 128 + 128 // 2) * MIB_PER_ELEMENT,
        decoder_extra_mib=KEY_RMS_MIB,
        cache_elements=lambda c, layer: c.gla_latent_heads * c.gla_latent_dim + c.rope_head_dim + c.n_head,
        key_weights=("W_up_k", "W_kr"),
        key_builder=keys_builder,
    ),
    "tpa": Reference(
        keys_values=tpa_keys_values,
        queries=tpa_queries,
        head_keys=tpa_head_maps,
        # no W_q: the query factors (d x R_Q (H + d_h)) and the key and value factors (d x R (H + d_h) each)
        params=lambda c, layer: (
            c.n_embd * (c.tpa_q_rank + 2 * c.tpa_kv_rank) * (c.n_head + c.head_dim), c.head_dim),
        # arXiv 2501.06425 section 3, KV caching: (R_K + R_V)(H + d_h) per token, (2 + 2) x (6 + 128)
        paper_cache_mib=(2 + 2) * (6 + 128) * MIB_PER_ELEMENT,
        decoder_extra_mib=0,
        cache_elements=lambda c, layer: 2 * c.tpa_kv_rank * (c.n_head + c.head_dim),
        key_weights=("W_ak", "W_bk"),
        key_builder=rows_builder("W_ak"),
    ),
    "mlra": Reference(
        keys_values=mlra_keys_values,
        head_keys=mlra_head_keys,
        # W_down (d x n d_c), n H up-projections each for keys and values (d_c x d_h), W^KR; q k^T and
        # a v n times a head and key
        params=lambda c, layer: (
            c.n_embd * c.mlra_latent_heads * c.mlra_latent_dim
            + 2 * c.mlra_latent_dim * c.mlra_latent_heads * c.n_head * c.head_dim
            + c.n_embd * c.rope_head_dim,
            c.head_dim + c.rope_head_dim, c.mlra_latent_heads * (2 * c.head_dim + c.rope_head_dim)),
        # arXiv 2603.02188 (and model/mlra_4.py): MLRA-4 caches 4 latent heads of d_h and the d_h/2
        # RoPE key, 4.5 d_h
        # (4 x 128 + 64), as MLA at d_c = 4 d_h
        paper_cache_mib=(4 * 128 + 128 // 2) * MIB_PER_ELEMENT,
        decoder_extra_mib=4 * KEY_RMS_MIB,
        cache_elements=lambda c, layer: (
            c.mlra_latent_heads * (c.mlra_latent_dim + c.n_head) + c.rope_head_dim),
        key_weights=("W_up_k", "W_kr"),
        key_builder=keys_builder,
    ),
})


def naive_attention(attn, x, config, shared=None, window=None):
    """One layer, one head at a time, softmax written out, keys and values from the paper's formulas:
    the output (T, d) of x (1, T, d), and the Reference's keys and values, which the layers that
    share them are given as shared and attend with. Query i sees key j <= i, and with a window W
    only j > i - W."""
    x = x.double()
    H, T = config.n_head, x.size(1)
    reference = REFERENCES[config.attn]
    keys_values = reference.keys_values(attn, x, config) if shared is None else shared
    keys, values, rot_dim, *more = keys_values
    scale = more[0]["scale"] if more else None
    if scale is None:
        keys, values = [[k] for k in keys], [[v] for v in values]
    qk_dim = keys[0][0].size(-1)
    positions = torch.arange(T, dtype=torch.float64)
    if reference.queries is not None:
        queries = reference.queries(attn, x, config)
    else:
        Wq = attn.W_q.weight.double().view(H, qk_dim, -1)
        queries = [x[0] @ Wq[h].t() for h in range(H)]
    heads = []
    for h in range(H):
        q = naive_rope(rms(queries[h]), positions, rot_dim, config.rope_theta)
        head = 0
        for key, value in zip(keys[h], values[h]):
            k = naive_rope(rms(key), positions, rot_dim, config.rope_theta)
            scores = q @ k.t() / math.sqrt(qk_dim) * (reference.score_scale or (lambda *_: 1))(attn, h)
            i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
            hidden = (j > i) | (i - j >= window if window is not None else False)
            scores = scores.masked_fill(hidden, float("-inf"))
            head = head + torch.softmax(scores, -1) @ value
        heads.append(head * (scale or 1))
    return torch.cat(heads, -1) @ attn.W_o.weight.double().t(), keys_values


def naive_forward(model, idx):
    """The logits (T, vocab) of the tokens idx (T,), float64, every layer through naive_attention:
    x = norm(embedding); per layer x += attention(norm(x)), then x += W_out relu(W_in norm(x))^2;
    logits = lm_head(norm(x)). In each group of config.cla layers the first's keys and values serve
    all of them (Brandon et al. 2024); with yoco the middle layer's serve the upper half (YOCO). With
    a window, the layers that window_pattern's letters (tiled) mark S see their last W positions, but
    the last layer, which sees all."""
    config, n = model.config, model.config.n_layer
    x = rms(model.wte.weight.double()[idx])[None]  # (1, T, d)
    shared = {}
    for layer, block in enumerate(model.blocks):
        source = n // 2 if config.yoco and layer >= n // 2 else layer - layer % config.cla
        local = config.window_pattern[layer % len(config.window_pattern)] == "S" and layer < n - 1
        y, keys_values = naive_attention(block.attn, rms(x), config, shared.get(source),
                                         config.window if local else None)
        shared.setdefault(layer, keys_values)
        x = x + y
        hidden = torch.relu(lin(rms(x), block.mlp.W_in)).square()
        x = x + lin(hidden, block.mlp.W_out)
    return lin(rms(x), model.lm_head)[0]


# Decoding as the tests drive it, and its reference

def token_by_token(model, idx, prefix, dtype=torch.float32, cache_for_steps=None, cache_class=None):
    """idx's logits from position prefix on: a prompt of prefix tokens into a fresh cache (new_cache's, or
    cache_class), then each token through cache_for_steps(cache) (decode.py's views over a RingKVCache,
    which they take by default)."""
    if cache_for_steps is not None:
        cache_class = cache_class or RingKVCache
    cache = model.new_cache(idx.size(0), idx.size(1), dtype=dtype, cache_class=cache_class)
    model(idx[:, :prefix], cache=cache)
    cache = cache if cache_for_steps is None else cache_for_steps(cache)
    return torch.cat([model(idx[:, t:t + 1], cache=cache)[0] for t in range(prefix, idx.size(1))], dim=1)


def small_key_model(attn, **overrides):
    """A bf16 tiny model whose key weights are scaled down 30x: keys with a mean square far below
    bf16's eps, where the QK norm (and the key RMS that LRKV and MLA cache) must keep its fp32 eps.
    A CLA group's later layers have no key weights of their own."""
    model = tiny_model(attn, **overrides).to(torch.bfloat16)
    with torch.no_grad():
        for name in REFERENCES[attn].key_weights:
            for layer in key_layers(model):
                getattr(model.blocks[layer].attn, name).weight.mul_(0.03)
    return model


def cropped_greedy(model, idx, n):
    """idx and n greedy tokens, each from a full forward pass over the context that GPT.generate
    documents: the last block_size tokens at most, starting again from the most recent half
    (rounded up) whenever it would outgrow block_size."""
    L = model.config.block_size
    start = max(0, idx.size(1) - L)
    for _ in range(n):
        if idx.size(1) - start > L:
            start = idx.size(1) - (L + 1) // 2
        idx = torch.cat((idx, model(idx[:, start:])[0][:, -1].argmax(-1, keepdim=True)), dim=1)
    return idx
