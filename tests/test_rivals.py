"""Tests of lib/rivals.py, the field's rivals of LRKV (GTA, GLA, TPA, MLRA), against their papers.

lib/rivals.py registers them into model.ATTENTION wherever lib is imported, so every test of
test_model.py, test_decode.py and test_convert.py that runs on every variant runs on them already
(shapes, overfitting, the float64 head-by-head reference, cached, exact, fixed-shape and compiled
decoding, greedy decoding with and without the cache against an uncached argmax loop, every
registered step against decode.reference_step, the cache counted off the buffers, conversion refused
in one line). This file gives each rival its Reference in test_model.py's REFERENCES (RIVALS, which
test_model.py imports: a fixture, as test_variant.py's, would come after those tests' parametrisation
has read ATTENTION), then tests what is the rivals' own: each cache against its paper's formula at
128M, the steps' reading of the cache alone, TPA's lifted head maps, training, sampling and analysis
through the scripts, and their knobs' errors."""

import json
import math
from dataclasses import replace

import pytest
import torch

import analyze
import sample
import test_model
import train
from model import ATTENTION, GPT, GPTConfig
from test_decode import exact_steps
from test_model import TINY, Reference, lin, rms, tiny_model
from test_train import data_dir, flags  # noqa: F401 (data_dir is a fixture)

NAMES = ("gta", "gla", "tpa", "mlra")
# bf16 MiB at 128M (12 layers x 2048 tokens x 2 bytes) per cached element per token and layer
MIB_PER_ELEMENT = 12 * 2048 * 2 / 2**20


# Each rival's keys and values from its paper's equations, in float64, head by head, as
# test_model.naive_attention takes them (Reference.keys_values)

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


def tpa_keys_values(attn, x, config):
    """2501.06425 section 3: queries, keys and values each (1/R) sum_r a_r (x) b_r of the token's factors.
    naive_attention rotates the sum: RoPE on every b_r^K, as the paper puts it, is the same, RoPE
    being linear and the same for every r."""
    H, d_h = config.n_head, config.head_dim
    queries = tpa_factor_sum(x[0], attn.W_aq, attn.W_bq, H, d_h)
    keys = tpa_factor_sum(x[0], attn.W_ak, attn.W_bk, H, d_h)
    values = tpa_factor_sum(x[0], attn.W_av, attn.W_bv, H, d_h)
    return keys, values, d_h, {"queries": queries}


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


# Each rival's Reference. paper_cache_mib is its paper's cache formula at 128M (12 layers, 6 heads of
# 128, 2,048 tokens, bf16); cache_elements what this decoder caches per token and layer;
# decoder_extra_mib the difference, the key RMSs that GLA and MLRA cache as MLA here does
RIVALS = {
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
        decoder_extra_mib=test_model.KEY_RMS_MIB,
        cache_elements=lambda c, layer: c.gla_latent_heads * c.gla_latent_dim + c.rope_head_dim + c.n_head,
        key_weights=("W_up_k", "W_kr"),
        key_builder=keys_builder,
    ),
    "tpa": Reference(
        keys_values=tpa_keys_values,
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
        decoder_extra_mib=4 * test_model.KEY_RMS_MIB,
        cache_elements=lambda c, layer: (
            c.mlra_latent_heads * (c.mlra_latent_dim + c.n_head) + c.rope_head_dim),
        key_weights=("W_up_k", "W_kr"),
        key_builder=keys_builder,
    ),
}
test_model.REFERENCES.update(RIVALS)


def test_every_rival_is_registered_with_a_reference_and_a_legend():
    assert [name for name in ATTENTION if name in NAMES] == list(NAMES) == list(RIVALS)
    assert all(test_model.REFERENCES[name] is RIVALS[name] for name in NAMES)
    labels = [analyze.variant_label(GPTConfig(attn=name), []) for name in NAMES]
    assert labels == ["GTA (3 KV heads)", "GLA-2", "TPA", "MLRA-4"]


# The papers' cache per token and layer at 128M (d_h = 128, H = 6), as a share of MHA's 2 H d_h = 1536,
# and what this decoder adds (the key RMSs of GLA and MLRA)
PAPER_CACHE = {
    "gta": (448, 0),  # G d_h + d_h/2, G = 3 (2505.21487, GTA)
    "gla": (576, 6),  # GLA-2: 2 x 2 d_h + d_h/2 = 4.5 d_h (2505.21487, GLA)
    "tpa": (536, 0),  # (R_K + R_V)(H + d_h), R = 2 (2501.06425 section 3)
    "mlra": (576, 24),  # MLRA-4: 4 d_h + d_h/2 = 4.5 d_h (2603.02188)
}


@pytest.mark.parametrize("attn", NAMES)
def test_each_cache_is_its_papers_formula_at_128m(attn):
    with torch.device("meta"):
        model = GPT(GPTConfig(attn=attn))
    paper, extra = PAPER_CACHE[attn]
    per_layer = model.kv_cache_elements_per_token() / model.config.n_layer
    assert per_layer == paper + extra
    assert model.kv_cache_bytes(1, 2048, torch.bfloat16) == 12 * 2048 * 2 * (paper + extra)
    mha = 2 * 6 * 128
    assert round(100 * paper / mha, 1) == {"gta": 29.2, "gla": 37.5, "tpa": 34.9, "mlra": 37.5}[attn]


@pytest.mark.parametrize("attn", NAMES)
def test_single_token_steps_build_no_cached_key_or_value(attn, monkeypatch):
    """Each exact step reads the compressed cache: after the prompt's 8 positions, none of the
    methods that build keys or values from cached entries sees more than the new token."""
    model = tiny_model(attn, block_size=40)
    sizes = []
    for block in model.blocks:
        for name in ("keys", "values", "product"):
            if hasattr(block.attn, name):
                def spied(*args, build=getattr(block.attn, name)):
                    sizes.append(args[0].size(1))
                    return build(*args)
                monkeypatch.setattr(block.attn, name, spied)
    with torch.no_grad():
        exact_steps(model, torch.randint(0, TINY.vocab_size, (2, 40)), 8)
    assert set(sizes) <= {8, 1}  # the prompt's, then each token's own (TPA's queries: its factors' product)


def test_tpa_heads_are_linear_in_the_lifted_token():
    """q_h(x) = (x (x) x) M_h and k_h(x) likewise, M_h the symmetric lift that head_qk_grams pairs."""
    model = tiny_model("tpa").double()
    layer, c = model.blocks[0].attn, model.config
    x = torch.randn(1, 5, c.n_embd, dtype=torch.float64)
    lifted = torch.einsum("ti,tj->tij", x[0], x[0]).reshape(5, -1)
    maps = tpa_head_maps(layer, None, c)
    for (W_a, W_b), M in zip(((layer.W_aq, layer.W_bq), (layer.W_ak, layer.W_bk)), maps):
        heads = layer.product(*layer.factors(x, W_a, W_b))[0]  # (5, H, d_h)
        torch.testing.assert_close(torch.einsum("tx,hxa->tha", lifted, M), heads, atol=1e-12, rtol=1e-10)


def test_mlra_with_one_latent_head_is_mla_on_its_latent():
    """MLRA with n = 1 is MLA with d_c = d_c (the same parameters, the same logits)."""
    mlra = tiny_model("mlra", mlra_latent_heads=1, mlra_latent_dim=TINY.kv_lora_rank)
    mla = GPT(replace(TINY, attn="mla")).eval()
    mla.load_state_dict(mlra.state_dict())
    idx = torch.randint(0, TINY.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(mlra(idx)[0], mla(idx)[0], atol=1e-5, rtol=1e-5)


def test_gla_with_one_latent_head_is_mla():
    gla = tiny_model("gla", gla_latent_heads=1, gla_latent_dim=TINY.kv_lora_rank)
    mla = GPT(replace(TINY, attn="mla")).eval()
    mla.load_state_dict(gla.state_dict())
    idx = torch.randint(0, TINY.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(gla(idx)[0], mla(idx)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", NAMES)
def test_a_rival_trains_is_sampled_with_its_cache_and_analysed(attn, data_dir, tmp_path, capsys):
    run = tmp_path / "out" / attn
    assert train.main(flags(data_dir=data_dir, out_dir=run, attn=attn, n_head=4, head_dim=8, gta_kv_heads=2,
                            gla_latent_dim=8, mlra_latent_dim=4, rope_head_dim=4, max_steps=4,
                            eval_interval=2)) == 0
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [len(r["effective_rank"]) for r in records if "effective_rank" in r] == [2, 2]  # steps 2 and 4
    assert sample.main([str(run / "ckpt.pt"), "--max_new_tokens=40", "--temperature=0", "--device=cpu"]) == 0
    analyze.main([str(run / "ckpt.pt"), "--out_dir", str(tmp_path / "figures")])
    [result] = json.loads((tmp_path / "figures" / "analysis.json").read_text())["runs"]
    c = GPTConfig(**torch.load(run / "ckpt.pt", weights_only=True)["model_args"])
    per_layer = RIVALS[attn].cache_elements(c, 0)
    assert result["kv_cache_elements_per_token"] == c.n_layer * per_layer
    assert result["kv_cache_fraction"] == pytest.approx(per_layer / (2 * c.n_head * c.head_dim))
    assert len(result["effective_rank"]) == 2 and all(1 <= r <= 4 for r in result["effective_rank"])


@pytest.mark.parametrize("overrides, field", [
    (dict(attn="gta", gta_kv_heads=4), "gta_kv_heads"),
    (dict(attn="gta", gta_kv_heads=0), "gta_kv_heads"),
    (dict(attn="gta", head_dim=126, n_embd=6 * 126), "head_dim"),
    (dict(attn="gla", gla_latent_heads=4), "gla_latent_heads"),
    (dict(attn="gla", gla_latent_dim=0), "gla_latent_dim"),
    (dict(attn="gla", rope_head_dim=63), "rope_head_dim"),
    (dict(attn="tpa", tpa_q_rank=0), "tpa_q_rank"),
    (dict(attn="tpa", tpa_kv_rank=0), "tpa_kv_rank"),
    (dict(attn="mlra", mlra_latent_heads=0), "mlra_latent_heads"),
    (dict(attn="mlra", mlra_latent_dim=0), "mlra_latent_dim"),
    (dict(attn="mlra", rope_head_dim=130), "rope_head_dim"),
])
def test_bad_rival_configuration_raises(overrides, field):
    test_model.test_bad_configuration_raises(overrides, field)
