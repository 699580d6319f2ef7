"""Tests of model.py against the paper's math: each variant against an independent naive
attention, the exact equivalences between variants, cached decoding against the full
forward pass, and the KV-cache sizes of section 2."""

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Callable

import pytest
import torch

from lib import diversity

from model import ATTENTION, GPT, GPTConfig, GroupedQueryAttention, norm
from model import rms as cached_rms

TINY = GPTConfig(
    block_size=32, vocab_size=61, n_layer=2, n_head=4, n_embd=64, head_dim=16,
    n_kv_head=2, kv_lora_rank=24, rope_head_dim=8, lrkv_rank=4,
    gta_kv_heads=2, gla_latent_dim=12, mlra_latent_dim=8,  # lib/rivals.py's, to the tiny shape
)
MIB = 2**20


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
    # optionally a fourth item, a dict (naive_attention: "queries" for a variant without W_q, "scale")
    head_keys: Callable  # (layer, x (N, d), c) -> (N, H, d_qk): per-head keys from its own projections
    # before the QK norm and RoPE (diversity.py's head_qk_weights must match them); for a variant whose
    # heads are no linear maps of x (head_qk_grams), (layer, None, c) -> its heads' lifted query and key maps
    params: Callable  # (c, layer) -> (key/value parameters besides W_q, W_o and the MLP, d_qk): a variant
    # without W_q counts its query parameters here too; a third entry, where a variant has one, is its
    # multiply-adds of q k^T and a v per head and key (default d_qk + d_h)
    paper_cache_mib: float  # its KV cache at 128M (12 layers, 2,048 tokens, bf16) as the paper counts it
    decoder_extra_mib: float  # what its decoder caches besides (LRKV's and MLA's key RMSs)
    cache_elements: Callable  # (c, layer) -> its cached elements per token in that layer, all of them
    key_weights: tuple  # the weights that make its keys: scaled down, keys far below bf16's eps
    key_builder: Callable  # layer -> (object, method name, count): where it builds per-head keys, count
    # (the call's arguments) -> the positions a call builds keys for, None where it builds something else


class References(dict):
    """REFERENCES: one Reference per --attn name. A variant without one fails the test that needs it,
    naming what to add: never a skip, never a default."""

    def __missing__(self, attn):
        lines = Path(__file__).read_text().splitlines()
        line = next(n for n, text in enumerate(lines, 1) if text.startswith("REFERENCES = "))
        pytest.fail(f"REFERENCES has no entry for --attn={attn}: add a Reference(...) for it at "
                    f"test_model.py:{line} (a variant defined in a test file registers its own, as "
                    "test_variant.py's REFERENCES do)")


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


def lrkv_head_keys(layer, x, c):
    return layer.head_keys(x[None])[2][0]


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


# LRKV's and MLA's decoders also cache each head's key RMS, which the paper does not count:
# 12 layers x 2048 tokens x 6 heads x 2 bytes (+0.7% and +3.1%; see LowRankKVAttention and
# MultiHeadLatentAttention)
KEY_RMS_MIB = 12 * 2048 * 6 * 2 / MIB


# One Reference per variant of model.py, by its --attn name: where a new variant adds its entry
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
})


def naive_attention(attn, x, config):
    """One head at a time, softmax written out, keys and values from the paper's formulas. An entry
    may return a fourth item, a dict: "queries", every head's query (T, d_qk) before the QK norm
    and RoPE, for a variant without W_q (TPA); "scale", for a head that attends to several key/value
    pairs apart (MLRA's latent heads): keys[h] and values[h] are then lists, one softmax each, and
    the head's output is their outputs' sum times the scale."""
    x = x.double()
    H, T = config.n_head, x.size(1)
    keys, values, rot_dim, *more = REFERENCES[config.attn].keys_values(attn, x, config)
    more = more[0] if more else {}
    if "scale" not in more:
        keys, values = [[k] for k in keys], [[v] for v in values]
    qk_dim = keys[0][0].size(-1)
    positions = torch.arange(T, dtype=torch.float64)
    if "queries" in more:
        queries = more["queries"]
    else:
        Wq = attn.W_q.weight.double().view(H, qk_dim, -1)
        queries = [x[0] @ Wq[h].t() for h in range(H)]
    heads = []
    for h in range(H):
        q = naive_rope(rms(queries[h]), positions, rot_dim, config.rope_theta)
        head = 0
        for key, value in zip(keys[h], values[h]):
            k = naive_rope(rms(key), positions, rot_dim, config.rope_theta)
            scores = q @ k.t() / math.sqrt(qk_dim)
            scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
            head = head + torch.softmax(scores, -1) @ value
        heads.append(head * more.get("scale", 1))
    return torch.cat(heads, -1) @ attn.W_o.weight.double().t()


@pytest.mark.parametrize("attn", ATTENTION)
def test_attention_matches_naive_reference(attn):
    model = tiny_model(attn)
    layer = model.blocks[0].attn
    x = torch.randn(1, 12, TINY.n_embd)
    rope = model.rope[:12]
    with torch.no_grad():
        fast = layer(x, rope)
    naive = naive_attention(layer, x, model.config)
    torch.testing.assert_close(fast[0].double(), naive, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("attn", ATTENTION)
def test_forward_shapes_and_finite_loss(attn):
    model = GPT(replace(TINY, attn=attn))
    idx = torch.randint(0, TINY.vocab_size, (3, 10))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 10, TINY.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(loss)
    # the init makes every block the identity and the unembedding tiny: loss ~ ln(vocab)
    assert abs(loss.item() - math.log(TINY.vocab_size)) < 0.05
    assert model(idx)[1] is None


@pytest.mark.parametrize("attn", ATTENTION)
def test_tiny_model_overfits_one_batch(attn):
    torch.manual_seed(0)
    model = GPT(replace(TINY, attn=attn))
    x = torch.randint(0, TINY.vocab_size, (4, 16))
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    for _ in range(60):
        loss = model(x, y)[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1, f"{attn} only reached loss {loss.item():.3f}"


def test_gqa_with_all_kv_heads_is_mha():
    mha = tiny_model("mha")
    gqa = GPT(replace(TINY, attn="gqa", n_kv_head=TINY.n_head)).eval()
    gqa.load_state_dict(mha.state_dict())
    idx = torch.randint(0, TINY.vocab_size, (2, 20))
    with torch.no_grad():
        assert torch.equal(gqa(idx)[0], mha(idx)[0])


def test_lrkv_with_zero_residual_is_mqa():
    lrkv = tiny_model("lrkv")
    mqa = tiny_model("mqa", seed=1)
    with torch.no_grad():
        for block_l, block_m in zip(lrkv.blocks, mqa.blocks):
            block_l.attn.U_k.weight.zero_()
            block_l.attn.U_v.weight.zero_()
            block_m.attn.W_k.weight.copy_(block_l.attn.W_shared_k.weight)
            block_m.attn.W_v.weight.copy_(block_l.attn.W_shared_v.weight)
        shared = {k: v for k, v in lrkv.state_dict().items() if k in mqa.state_dict()}
        mqa.load_state_dict(shared, strict=False)
    idx = torch.randint(0, TINY.vocab_size, (2, 20))
    with torch.no_grad():
        assert torch.equal(lrkv(idx)[0], mqa(idx)[0])


def test_lrkv_init_residual_is_a_tenth_of_the_shared_projection():
    torch.manual_seed(0)
    attn = GPT(GPTConfig(attn="lrkv", n_layer=1)).blocks[0].attn
    H, d_h, r = attn.n_head, attn.head_dim, attn.lrkv_rank
    for W_shared, U, B in ((attn.W_shared_k, attn.U_k, attn.B_k), (attn.W_shared_v, attn.U_v, attn.B_v)):
        U, B = U.weight.view(H, r, -1), B.view(H, d_h, r)
        for h in range(H):
            ratio = (B[h] @ U[h]).norm() / W_shared.weight.norm()
            assert 0.08 < ratio < 0.12


@pytest.mark.parametrize("attn", ATTENTION)
def test_cached_decoding_equals_full_forward(attn):
    model = tiny_model(attn)
    idx = torch.randint(0, TINY.vocab_size, (2, 24))
    with torch.no_grad():
        full = model(idx)[0]
        caches = model.new_caches(2, 24, dtype=torch.float32)
        # a multi-token prompt, a chunk that attends to a cached prefix, then token by token
        pieces = [model(idx[:, :9], caches=caches)[0], model(idx[:, 9:13], caches=caches)[0]]
        pieces += [model(idx[:, t:t + 1], caches=caches)[0] for t in range(13, 24)]
    assert (torch.cat(pieces, dim=1) - full).abs().max() < 1e-4


@pytest.mark.parametrize("attn", ATTENTION)
def test_a_prompt_runs_the_attention_kernel_training_runs(attn):
    """A prompt into an empty cache gets training's SDPA kernel. Values that flash attention
    refuses (LRKV's [V_shared | R_h^V], d_h + r wide; MLA's latent, here narrower than its q/k
    heads) would put it on PyTorch's math kernel, which holds all T x T scores at once."""
    model = tiny_model(attn, kv_lora_rank=16)
    idx = torch.randint(0, TINY.vocab_size, (2, 20))

    def sdpa_ops(**kwargs):
        with torch.no_grad(), torch.profiler.profile() as prof:
            model(idx, **kwargs)
        return sorted({e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product_")})

    training = sdpa_ops()
    assert training, "the profiler saw no attention op"
    assert sdpa_ops(caches=model.new_caches(2, 20, dtype=torch.float32)) == training


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3), (torch.float32, 1e-5),
                                        (torch.float64, 1e-12)], ids=["bf16", "fp16", "fp32", "fp64"])
def test_cached_rms_is_what_norm_divides_by(dtype, tol):
    """LRKV and MLA cache each key's RMS and divide by it where training calls norm(). Small
    vectors (mean square 1e-4) are where a wrong eps shows: bf16's own is 7.8e-3."""
    x = (0.01 * torch.randn(8, 64, dtype=torch.float64)).to(dtype)
    divided = x.double() / cached_rms(x).double()[..., None]
    assert torch.allclose(divided, norm(x).double(), rtol=tol, atol=tol)


def token_by_token(model, idx, prefix, dtype=torch.float32, caches_for_steps=list):
    """idx's logits from position prefix on: a prompt of prefix tokens into fresh caches, then each
    token through caches_for_steps(caches) (decode.py's turn them into its own)."""
    caches = model.new_caches(idx.size(0), idx.size(1), dtype=dtype)
    model(idx[:, :prefix], caches=caches)
    caches = caches_for_steps(caches)
    return torch.cat([model(idx[:, t:t + 1], caches=caches)[0] for t in range(prefix, idx.size(1))], dim=1)


def small_key_model(attn):
    """A bf16 tiny model whose key weights are scaled down 30x: keys with a mean square far below
    bf16's eps, where the QK norm (and the key RMS that LRKV and MLA cache) must keep its fp32 eps."""
    model = tiny_model(attn).to(torch.bfloat16)
    with torch.no_grad():
        for name in REFERENCES[attn].key_weights:
            for block in model.blocks:
                getattr(block.attn, name).weight.mul_(0.03)
    return model


@pytest.mark.parametrize("attn", ATTENTION)
def test_bf16_single_token_steps_with_small_keys_match_the_full_forward(attn):
    model = small_key_model(attn)
    idx = torch.randint(0, TINY.vocab_size, (2, 24))
    with torch.no_grad():
        full, stepped = model(idx)[0], token_by_token(model, idx, 8, torch.bfloat16)
    assert (stepped - full[:, 8:]).norm() / full[:, 8:].norm() < 2e-2


@pytest.mark.parametrize("attn", ATTENTION)
def test_single_token_steps_match_a_chunk_over_64_positions(attn):
    """Single-token steps of the plain cached path against one chunk after the same prefix,
    which rebuilds the keys, and against the full forward, over 64 positions."""
    model = tiny_model(attn, block_size=64)
    idx = torch.randint(0, TINY.vocab_size, (2, 64))
    with torch.no_grad():
        full = model(idx)[0]
        caches = model.new_caches(2, 64, dtype=torch.float32)
        model(idx[:, :8], caches=caches)
        chunk = model(idx[:, 8:], caches=caches)[0]
        stepped = token_by_token(model, idx, 8)
    assert (stepped - chunk).abs().max() < 1e-4
    assert (stepped - full[:, 8:]).abs().max() < 1e-4


@pytest.mark.parametrize("attn", ATTENTION)
def test_greedy_generation_is_the_same_with_and_without_cache(attn):
    model = tiny_model(attn)
    prompt = torch.randint(0, TINY.vocab_size, (2, 5))
    cached = model.generate(prompt, 12, temperature=0)
    assert cached.shape == (2, 17) and torch.equal(cached[:, :5], prompt)
    assert torch.equal(cached, model.generate(prompt, 12, temperature=0, use_cache=False))
    sampled = model.generate(prompt, 12, temperature=0.8, top_k=5)
    assert sampled.shape == (2, 17) and sampled.max() < TINY.vocab_size
    top_1 = model.generate(prompt, 12, temperature=1.0, top_k=1)
    assert torch.equal(top_1, cached)  # top-1 sampling is greedy


def test_generation_draws_no_id_past_the_tokenizers_vocabulary():
    """A vocabulary padded for fast matmuls (GPT-2's 50257 to 50304) has ids no tokenizer decodes."""
    model = tiny_model("mha")
    prompt = torch.randint(0, TINY.vocab_size, (4, 3))
    assert model.generate(prompt, 20, temperature=5.0, vocab_size=7)[:, 3:].max() < 7
    assert model.generate(prompt, 20, temperature=0, vocab_size=7)[:, 3:].max() < 7


def cropped_greedy(model, idx, n):
    """idx and n greedy tokens, each from a full forward pass over the context that GPT.stream
    documents: the last block_size tokens at most, starting again from the most recent half
    (rounded up) whenever it would outgrow block_size."""
    L = model.config.block_size
    start = max(0, idx.size(1) - L)
    for _ in range(n):
        if idx.size(1) - start > L:
            start = idx.size(1) - (L + 1) // 2
        idx = torch.cat((idx, model(idx[:, start:])[0][:, -1].argmax(-1, keepdim=True)), dim=1)
    return idx


@pytest.mark.parametrize("attn", ATTENTION)
def test_generation_goes_on_past_the_context_on_caches_of_block_size(attn, monkeypatch):
    """Greedy tokens with the cache and without it are the reference's, the context cropped at the
    same points, over more than twice block_size; every cache allocated is block_size long. In
    float64: no near-tie between two logits can make a token differ."""
    model = tiny_model(attn).double()
    lengths = []
    new_caches = model.new_caches
    monkeypatch.setattr(model, "new_caches", lambda *a, **k: lengths.append(a[1]) or new_caches(*a, **k))
    L = TINY.block_size
    prompt = torch.randint(0, TINY.vocab_size, (2, 5))
    expected = cropped_greedy(model, prompt, 2 * L + 20)
    assert torch.equal(model.generate(prompt, 2 * L + 20, temperature=0), expected)
    assert lengths == [L] * 5  # the prompt's, and new starts at 33, 50, 67 and 84 tokens
    assert torch.equal(model.generate(prompt, 2 * L + 20, temperature=0, use_cache=False), expected)
    long_prompt = torch.randint(0, TINY.vocab_size, (2, L + 7))  # cropped to its last L tokens
    assert torch.equal(model.generate(long_prompt, 9, temperature=0), cropped_greedy(model, long_prompt, 9))


def test_what_exceeds_block_size_is_refused():
    model = tiny_model("mha")
    with pytest.raises(ValueError, match="sequence of 33 tokens is longer than block_size = 32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="a KV cache of 33 tokens exceeds block_size = 32"):
        model.new_caches(1, 33)
    caches = model.new_caches(1, 32)
    model(torch.zeros(1, 30, dtype=torch.long), caches=caches)
    with pytest.raises(ValueError, match="KV cache holds 32 tokens, 33 were asked for"):
        model(torch.zeros(1, 3, dtype=torch.long), caches=caches)


def cache_elements(attn, c):
    """The Reference's cached elements per token, summed over the layers."""
    return sum(REFERENCES[attn].cache_elements(c, layer) for layer in range(c.n_layer))


@pytest.mark.parametrize("attn", ATTENTION)
def test_kv_cache_bytes_of_the_128m_model(attn):
    with torch.device("meta"):
        model = GPT(GPTConfig(attn=attn))
    mib = REFERENCES[attn].paper_cache_mib + REFERENCES[attn].decoder_extra_mib
    assert model.kv_cache_bytes(1, 2048, torch.bfloat16) == mib * MIB
    H, d_h, c = model.config.n_head, model.config.head_dim, model.config
    assert model.kv_cache_elements_per_token() == cache_elements(attn, c)
    if attn == "lrkv":  # the paper's cache fraction 1/H + r/d_h = 52.6%, plus 1/(2 d_h) for the RMSs: 53.0%
        fraction = 1 / H + c.lrkv_rank / d_h + 1 / (2 * d_h)
        assert model.kv_cache_elements_per_token() / (c.n_layer * 2 * H * d_h) == pytest.approx(fraction)


@pytest.mark.parametrize("attn", ATTENTION)
def test_generation_allocates_exactly_the_predicted_cache(attn, monkeypatch):
    model = tiny_model(attn)
    allocated = []
    new_caches = model.new_caches
    monkeypatch.setattr(model, "new_caches",
                        lambda *a, **k: allocated.append(new_caches(*a, **k)) or allocated[-1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.generate(torch.zeros(3, 4, dtype=torch.long), 6)
    buffers = [b for cache in allocated[0] for b in cache.buffers()]
    assert all(b.dtype == torch.bfloat16 and b.shape[:2] == (3, 10) for b in buffers)
    assert sum(b.numel() * b.element_size() for b in buffers) == model.kv_cache_bytes(3, 10, torch.bfloat16)
    elements = 3 * 10 * model.kv_cache_elements_per_token()
    assert model.kv_cache_bytes(3, 10, torch.bfloat16) == 2 * elements


def test_caches_default_to_the_weights_dtype():
    model = tiny_model("lrkv")
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        assert {b.dtype for cache in model.new_caches(2, 8) for b in cache.buffers()} == {dtype}
        assert model.kv_cache_bytes(2, 8) == model.kv_cache_bytes(2, 8, dtype)


@pytest.mark.parametrize("attn", ATTENTION)
def test_parameter_and_flop_counts_follow_each_variants_formula(attn):
    """At 128M: the parameters, and the training FLOPs per token, 6 per weight of every matmul (all
    but the embedding) plus 6 per multiply-add of q k^T and a v over T keys, q/k heads d_qk wide."""
    c = GPTConfig(attn=attn)
    params, attention, T = 0, 0, 1024
    with torch.device("meta"):
        model = GPT(c)
    for layer in range(c.n_layer):
        kv, d_qk, *macs = REFERENCES[attn].params(c, layer)
        W_q = c.n_embd * c.n_head * d_qk if hasattr(model.blocks[layer].attn, "W_q") else 0
        params += kv + W_q + c.n_head * c.head_dim * c.n_embd + 8 * c.n_embd ** 2
        attention += c.n_head * (macs[0] if macs else d_qk + c.head_dim) * T
    assert model.get_num_params() == 2 * c.vocab_size * c.n_embd + params
    assert model.flops_per_token(T) == 6 * (c.vocab_size * c.n_embd + params) + 6 * attention


@pytest.mark.parametrize("attn", ATTENTION)
def test_head_qk_weights_match_each_variants_projections(attn):
    model = tiny_model(attn)
    layer, c = model.blocks[1].attn, model.config
    if hasattr(layer, "head_qk_grams"):  # heads no linear maps of x: head_keys gives their lifted maps
        Mq, Mk = REFERENCES[attn].head_keys(layer, None, c)  # (H, D, d_qk) each, q_h = features(x) @ Mq[h]
        for P, M in zip(layer.head_qk_grams(), (Mq, Mk)):
            torch.testing.assert_close(P.double(), torch.einsum("hxa,gxb->hagb", M, M), atol=1e-9, rtol=1e-9)
        return
    x = torch.randn(5, c.n_embd)
    Wq, Wk = diversity.head_qk_weights(model)[1]
    assert Wq.shape == Wk.shape == (c.n_head, c.n_embd, layer.qk_dim)
    H = c.n_head
    q = layer.W_q(x).view(5, H, layer.qk_dim)
    k = REFERENCES[attn].head_keys(layer, x, c)
    for h in range(H):
        torch.testing.assert_close(x @ Wq[h], q[:, h], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x @ Wk[h], k[:, h], atol=1e-5, rtol=1e-5)


def test_the_readme_names_every_field_of_a_reference():
    """README.md's "Adding a variant" names REFERENCES and every field of a Reference."""
    readme = (Path(__file__).parent / "README.md").read_text()
    section = readme.split("## Adding a variant")[1].split("\n## ")[0]
    assert "`REFERENCES`" in section, "README's Adding a variant does not name REFERENCES"
    missing = [f.name for f in fields(Reference) if f"`{f.name}`" not in section]
    assert not missing, f"README's Adding a variant does not name these fields of Reference: {missing}"


@pytest.mark.parametrize("overrides, field", [
    (dict(attn="mqa2"), "attn"),
    (dict(attn="gqa", n_kv_head=4), "n_kv_head"),
    (dict(attn="gqa", n_kv_head=0), "n_kv_head"),
    (dict(attn="lrkv", lrkv_rank=0), "lrkv_rank"),
    (dict(attn="lrkv", lrkv_rank=129), "lrkv_rank"),
    (dict(attn="mla", rope_head_dim=130), "rope_head_dim"),
    (dict(attn="mla", rope_head_dim=63), "rope_head_dim"),
    (dict(attn="mla", kv_lora_rank=0), "kv_lora_rank"),
    (dict(n_embd=770), "n_embd"),
    (dict(n_head=0), "n_head"),
    (dict(head_dim=127, n_embd=6 * 127), "head_dim"),
    (dict(n_layer=2.5), "n_layer"),
    (dict(rope_theta=0.0), "rope_theta"),
    (dict(rope_theta=float("nan")), "rope_theta"),
])
def test_bad_configuration_raises(overrides, field):
    with pytest.raises(ValueError, match=f"GPTConfig.{field} "):
        GPTConfig(**overrides)


def test_no_line_of_the_repository_is_longer_than_110_characters():
    long = [f"{path.name}:{i}" for path in sorted(Path(__file__).parent.glob("*.py"))
            for i, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 110]
    assert not long, f"lines over 110 characters: {', '.join(long)}"


# lib/rivals.py's variants are in ATTENTION wherever lib is imported: their References, which
# tests/test_rivals.py registers into REFERENCES
import test_rivals  # noqa: E402,F401
