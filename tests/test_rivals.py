"""Tests of lib/attention/rivals.py, the field's rivals of LRKV (GTA, GLA, TPA, MLRA), against their papers.

lib/variants.py lists them in VARIANTS and tests/references.py gives each its Reference from its
paper's equations, so every test of test_model.py, test_decode.py and test_convert.py that runs on
every variant runs on them already (shapes, overfitting, the float64 head-by-head reference of every
layer, with and without CLA, cached, exact, fixed-shape and compiled decoding, greedy decoding with
and without the cache against an uncached argmax loop, every registered step against
decode.reference_step, the cache counted off the buffers, conversion refused in one line). This file
tests what is the rivals' own: each cache against its paper's formula at 128M, the steps' reading of
the cache alone, TPA's lifted head maps, training, sampling and analysis through the scripts, and
their knobs' errors."""

import json
import math
from dataclasses import replace

import pytest
import torch

import analyze
from lib.evaluation import runs
import sample
import test_model
import train
from lib.attention import rivals
from lib.attention.layout import kv_cache_elements_per_token
from model import GPT, GPTConfig, VARIANTS, attention_class
from references import REFERENCES, TINY, tiny_model, tpa_head_maps
from test_decode import exact_steps
from test_train import data_dir, flags  # noqa: F401 (data_dir is a fixture)

NAMES = ("gta", "gla", "tpa", "mlra")


def test_every_rival_is_named_with_a_reference_and_a_legend():
    assert [name for name in VARIANTS if attention_class(name).__module__ == rivals.__name__] == list(NAMES)
    assert all(name in REFERENCES for name in NAMES)
    labels = [runs.variant_label(GPTConfig(attn=name), []) for name in NAMES]
    assert labels == ["GTA (3 KV heads)", "GLA-2", "TPA", "MLRA (4 latent heads)"]


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
    per_layer = kv_cache_elements_per_token(model) / model.config.n_layer
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
    per_layer = REFERENCES[attn].cache_elements(c, 0)
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
