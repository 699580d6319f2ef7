"""Attention variants written here and registered for these tests only, which no other file knows:
- GQA whose query heads share the G key/value heads interleaved (head h reads head h mod G)
  instead of in contiguous groups;
- LRK, LRKV's keys with one value that every head shares, as MQA's;
- LRKV whose rank differs from layer to layer;
- grouped LRKV, one residual for each group of H/G heads, every head its own B_h.
The last three subclass LowRankKVAttention and reuse its decoding. Each goes through every test of
test_model.py, test_fast_decode.py and test_convert.py that runs on every variant, with an entry
in each of test_model.py's tables (REFERENCES); the interleaved one also through train.py (a run
and its resume), analyze.py and bench.py, the per-layer one through train.py and analyze.py. The
README's "write the class, register it, give the tables an entry" is all a variant takes."""

import inspect
import json
from dataclasses import replace

import pytest
import torch

import analyze
import bench
import model
import test_analyze
import test_convert
import test_fast_decode
import test_model
import train
from model import GroupedQueryAttention, LowRankKVAttention, apply_rope, norm
from test_train import data_dir, flags  # noqa: F401 (data_dir is a fixture)


class InterleavedGroupedQueryAttention(GroupedQueryAttention):
    """G = config.n_kv_head key/value heads, query head h reading head h mod G, so that neighbouring
    query heads read different keys. GQA's projections, checks and cache (2 G d_h per token); only
    which query head reads which key/value head differs."""

    @classmethod
    def legend_label(cls, config, peers):
        return f"Interleaved GQA ({config.n_kv_head} KV heads)"

    @classmethod
    def legend_key(cls, config):
        return 5, config.n_kv_head

    def forward(self, x, rope, cache=None):
        B, T, _ = x.shape
        q = self.queries(x, rope)
        k = apply_rope(norm(self.W_k(x).view(B, T, self.n_kv_head, self.head_dim)), rope)
        v = self.W_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if cache is not None:
            cached = cache.update(k=k, v=v)
            k, v = cached["k"], cached["v"]
        # SDPA's enable_gqa groups heads contiguously: tile the G heads H/G times instead, so that
        # head h meets head h mod G
        tiles = self.n_head // self.n_kv_head
        return self.project_out(self.attend(q, k.repeat(1, 1, tiles, 1), v.repeat(1, 1, tiles, 1), cache))

    def head_key_weights(self):
        Wk = self.W_k.weight.view(self.n_kv_head, self.head_dim, -1).transpose(1, 2)  # (G, d, d_h)
        return Wk.repeat(self.n_head // self.n_kv_head, 1, 1)


class LowRankKeyAttention(LowRankKVAttention):
    """LRK: LRKV's keys, K_h = X W_shared^K + (X U_h^K)(B_h^K)^T, and one value V = X W_shared^V that
    every head shares, as MQA's. LRKV's decode reads this value half through the four methods below."""

    def __init__(self, config, layer):
        super().__init__(config, layer)
        del self.U_v, self.B_v  # LRKV's value residual, which LRK does without

    def forward(self, x, rope, cache=None):
        if cache is not None:
            return self.decode(x, rope, cache)
        B, T, _ = x.shape
        q = self.queries(x, rope)
        r_k = self.U_k(x).view(B, T, self.n_head, self.lrkv_rank)
        k = self.W_shared_k(x).unsqueeze(2) + self.residual(r_k, self.B_k)  # (B, T, H, d_h): K_h
        return self.project_out(self.attend(q, apply_rope(norm(k), rope), self.values(self.W_shared_v(x))))

    def value_shapes(self):
        return {"v_shared": (self.head_dim,)}

    def value_entries(self, x):
        return {"v_shared": self.W_shared_v(x)}

    def values(self, v_shared):
        return v_shared.unsqueeze(2).expand(-1, -1, self.n_head, -1)  # (B, S, H, d_h)

    def attend_values(self, a, v_shared):
        return (a @ v_shared).unsqueeze(1)  # (B, 1, H, d_h)

    @classmethod
    def legend_label(cls, config, peers):
        return f"LRK (r={config.lrkv_rank})"

    @classmethod
    def legend_key(cls, config):
        return 6, config.lrkv_rank

    def head_kv_weights(self):
        W_V = self.W_shared_v.weight.expand(self.n_head, -1, -1)  # (H, d_h, d)
        return self.head_weights(self.W_shared_k, self.U_k, self.B_k), W_V

    def load_head_kv_weights(self, W_K, W_V, C=None):
        """The keys as LRKV converts them; the one value the heads' mean, as MQA's."""
        self.load_head_weights(W_K, self.W_shared_k, self.U_k, self.B_k, C)
        self.W_shared_v.weight.copy_(W_V.mean(0))


class PerLayerRankAttention(LowRankKVAttention):
    """LRKV whose rank grows with depth: lrkv_rank in layer 0, twice it in layer 1, and so on up to
    head_dim. Nothing else changes: every count (parameters, cache) follows the layer's rank."""

    def __init__(self, config, layer):
        super().__init__(replace(config, lrkv_rank=layer_rank(config, layer)), layer)

    @classmethod
    def legend_label(cls, config, peers):
        return f"LRKV (r={config.lrkv_rank} x layer)"

    @classmethod
    def legend_key(cls, config):
        return 7, config.lrkv_rank


def layer_rank(config, layer):
    return min(config.head_dim, config.lrkv_rank * (layer + 1))


class GroupedLowRankKVAttention(LowRankKVAttention):
    """Grouped LRKV: G = n_kv_head residuals per token, R_g = X U_g, each read by H/G consecutive
    heads, every head its own B_h: K_h = K_shared + R_g B_h^T for g = h G // H, V_h likewise. Cache
    per token 2 d_h + 2 G r + H. LRKV with one method changed (residual_heads); its decoding as it is."""

    @staticmethod
    def residual_heads(config):
        return config.n_kv_head

    @classmethod
    def check(cls, config):
        super().check(config)
        GroupedQueryAttention.check(config)

    @classmethod
    def legend_label(cls, config, peers):
        return f"Grouped LRKV (r={config.lrkv_rank}, {config.n_kv_head} groups)"

    @classmethod
    def legend_key(cls, config):
        return 8, config.lrkv_rank

    def load_head_weights(self, heads, W_shared, U, factor, C):
        """W_shared the heads' mean; a group's residual the rank-r truncated SVD of its heads'
        deviations stacked, (H/G d_h, d), U_g shared by the group, each head's B_h its rows; with C
        the stacked deviations times C^(1/2) (shared_plus_low_rank's projection, for a group)."""
        G, r, d = self.n_residual, self.lrkv_rank, heads.size(-1)
        mean = heads.double().mean(0)
        D = (heads.double() - mean).reshape(G, -1, d)  # (G, H/G d_h, d)
        # D C D^T's top eigenvectors are the left singular vectors of D C^(1/2), no root of C needed
        gram = D @ (D.mT if C is None else C.double() @ D.mT)  # (G, H/G d_h, H/G d_h)
        P = torch.linalg.eigh(gram)[1][..., -r:]  # (G, H/G d_h, r)
        W_shared.weight.copy_(mean)
        U.weight.copy_((P.mT @ D).flatten(0, 1))  # (G r, d)
        factor.copy_(P.flatten(0, 1))  # (H d_h, r)


def grouped_lrkv_keys_values(attn, x, config):
    """Each head's projections W_shared + U_g B_h^T built whole, g = h G // H."""
    H, G, d_h, r = config.n_head, config.n_kv_head, config.head_dim, config.lrkv_rank
    U_k, U_v = (U.weight.double().view(G, r, -1) for U in (attn.U_k, attn.U_v))
    B_k, B_v = (B.double().view(H, d_h, r) for B in (attn.B_k, attn.B_v))
    keys = [x[0] @ (attn.W_shared_k.weight.double() + B_k[h] @ U_k[h * G // H]).t() for h in range(H)]
    values = [x[0] @ (attn.W_shared_v.weight.double() + B_v[h] @ U_v[h * G // H]).t() for h in range(H)]
    return keys, values, d_h


def interleaved_keys_values(attn, x, config):
    H, G, d_h, T = config.n_head, config.n_kv_head, config.head_dim, x.size(1)
    k, v = (test_model.lin(x[0], W).view(T, G, d_h) for W in (attn.W_k, attn.W_v))
    return [k[:, h % G] for h in range(H)], [v[:, h % G] for h in range(H)], d_h


def interleaved_head_keys(layer, x, c):
    return layer.W_k(x).view(len(x), c.n_kv_head, c.head_dim)[:, torch.arange(c.n_head) % c.n_kv_head]


def lrk_keys_values(attn, x, config):
    """Each head's key projection W_shared^K + U_h B_h^T built whole, and the one shared value."""
    H, d_h, r = config.n_head, config.head_dim, config.lrkv_rank
    U, B = attn.U_k.weight.double().view(H, r, -1), attn.B_k.double().view(H, d_h, r)
    keys = [x[0] @ (attn.W_shared_k.weight.double() + B[h] @ U[h]).t() for h in range(H)]
    return keys, [test_model.lin(x[0], attn.W_shared_v)] * H, d_h


# Each variant's class and its entry in every table of test_model.py, where a variant of model.py
# has its own
REFERENCES = {
    "gqa_interleaved": (InterleavedGroupedQueryAttention, dict(
        NAIVE_KEYS_VALUES=interleaved_keys_values,
        HEAD_KEYS=interleaved_head_keys,
        ATTENTION_PARAMS=lambda c, layer: (2 * c.n_kv_head * c.n_embd * c.head_dim, c.head_dim),
        PAPER_CACHE_MIB=36,  # GQA's: 3 of 6 KV heads
        DECODER_EXTRA_MIB=0,
        CACHE_ELEMENTS=lambda c, layer: 2 * c.n_kv_head * c.head_dim,
        KEY_WEIGHTS=("W_k",),
        KEY_BUILDERS=test_model.grouped_key_builder,
    )),
    "lrk": (LowRankKeyAttention, dict(
        NAIVE_KEYS_VALUES=lrk_keys_values,
        HEAD_KEYS=test_model.lrkv_head_keys,
        # W_shared^K and W_shared^V (d x d_h), and each head's U_h^K (d x r) and B_h^K (d_h x r)
        ATTENTION_PARAMS=lambda c, layer: (
            2 * c.n_embd * c.head_dim + c.n_head * c.lrkv_rank * (c.n_embd + c.head_dim), c.head_dim),
        PAPER_CACHE_MIB=24.9375,  # 12 layers x 2048 tokens x (2 d_h + H r = 2 x 128 + 6 x 46) x 2 bytes
        DECODER_EXTRA_MIB=test_model.KEY_RMS_MIB,
        CACHE_ELEMENTS=lambda c, layer: 2 * c.head_dim + c.n_head * c.lrkv_rank + c.n_head,
        KEY_WEIGHTS=("W_shared_k", "U_k"),
        KEY_BUILDERS=test_model.KEY_BUILDERS["lrkv"],
    )),
}


# the paper's 128M shape: 12 layers of 6 heads of 128, r = 46 (lrkv_per_layer: 46, 92, then 128)
PAPER_BF16_MIB_PER_ELEMENT = 12 * 2048 * 2 / 2**20
REFERENCES["lrkv_per_layer"] = (PerLayerRankAttention, dict(
    NAIVE_KEYS_VALUES=test_model.lrkv_keys_values,
    HEAD_KEYS=test_model.lrkv_head_keys,
    ATTENTION_PARAMS=lambda c, layer: (
        2 * c.n_embd * c.head_dim + 2 * c.n_head * layer_rank(c, layer) * (c.n_embd + c.head_dim),
        c.head_dim),
    PAPER_CACHE_MIB=(2 * 128 + 2 * 6 * (46 + 92 + 10 * 128) / 12) * PAPER_BF16_MIB_PER_ELEMENT,
    DECODER_EXTRA_MIB=test_model.KEY_RMS_MIB,
    CACHE_ELEMENTS=lambda c, layer: 2 * c.head_dim + 2 * c.n_head * layer_rank(c, layer) + c.n_head,
    KEY_WEIGHTS=("W_shared_k", "U_k"),
    KEY_BUILDERS=test_model.KEY_BUILDERS["lrkv"],
))
REFERENCES["lrkv_grouped"] = (GroupedLowRankKVAttention, dict(
    NAIVE_KEYS_VALUES=grouped_lrkv_keys_values,
    HEAD_KEYS=test_model.lrkv_head_keys,
    # W_shared^K and W_shared^V (d x d_h), each group's U_g (d x r) and each head's B_h (d_h x r)
    ATTENTION_PARAMS=lambda c, layer: (
        2 * c.n_embd * c.head_dim + 2 * c.lrkv_rank * (c.n_kv_head * c.n_embd + c.n_head * c.head_dim),
        c.head_dim),
    PAPER_CACHE_MIB=(2 * 128 + 2 * 3 * 46) * PAPER_BF16_MIB_PER_ELEMENT,  # 3 groups at 128M
    DECODER_EXTRA_MIB=test_model.KEY_RMS_MIB,
    CACHE_ELEMENTS=lambda c, layer: 2 * c.head_dim + 2 * c.n_kv_head * c.lrkv_rank + c.n_head,
    KEY_WEIGHTS=("W_shared_k", "U_k"),
    KEY_BUILDERS=test_model.KEY_BUILDERS["lrkv"],
))


@pytest.fixture(params=REFERENCES)
def variant(request, monkeypatch):
    """One of the variants in the registry, and its entries in test_model.py's tables, for one
    test: its name."""
    name, (cls, entries) = request.param, REFERENCES[request.param]
    monkeypatch.setitem(model.ATTENTION, name, cls)
    for table, entry in entries.items():
        monkeypatch.setitem(getattr(test_model, table), name, entry)
    return name


def runs_on_every_variant(test):
    marks = getattr(test, "pytestmark", [])
    return any(mark.name == "parametrize" and mark.args[1] is model.ATTENTION for mark in marks)


# Every test of test_model.py and test_fast_decode.py parametrized over the registry
GENERIC_TESTS = [test for module in (test_model, test_fast_decode, test_convert)
                 for name, test in vars(module).items()
                 if name.startswith("test_") and runs_on_every_variant(test)]


@pytest.mark.parametrize("generic_test", GENERIC_TESTS, ids=lambda test: test.__name__)
def test_generic_model_tests_pass(generic_test, variant, request):
    assert 1 < test_model.TINY.n_kv_head < test_model.TINY.n_head  # else interleaved groups are contiguous
    fixtures = list(inspect.signature(generic_test).parameters)[1:]  # what it takes besides attn
    generic_test(variant, **{name: request.getfixturevalue(name) for name in fixtures})


@pytest.mark.parametrize("variant", ["gqa_interleaved"], indirect=True)
def test_trains_resumes_is_analyzed_and_benched(variant, data_dir, tmp_path):
    # 4 heads over 2 KV heads, where interleaving differs from GQA's contiguous groups
    run = tmp_path / "out" / variant
    small = flags(data_dir=data_dir, out_dir=run, attn=variant, n_head=4, head_dim=8, n_kv_head=2,
                  max_steps=4, eval_interval=2)
    assert train.main(small + ["--stop_after=2"]) == 0
    assert train.main(small + ["--resume"]) == 0
    assert torch.load(run / "ckpt.pt", weights_only=True)["step"] == 4

    # beside an MHA checkpoint, which its legend place puts first
    test_analyze.save_checkpoint(tmp_path / "out" / "mha" / "ckpt.pt", attn="mha")
    analyze.main([str(tmp_path / "out"), "--out_dir", str(tmp_path / "figures")])
    runs = json.loads((tmp_path / "figures" / "analysis.json").read_text())["runs"]
    assert [r["label"] for r in runs] == ["Standard MHA", "Interleaved GQA (2 KV heads)"]
    assert runs[1]["kv_cache_fraction"] == 0.5 and len(runs[1]["effective_rank"]) == 2

    # in-process, for a subprocess would not see the registered variant; every variant by default
    bench.main(["--preset=tiny", "--device=cpu", "--check", "--no-compiled_decode",
                f"--out={tmp_path / 'bench.json'}"])
    result = json.loads((tmp_path / "bench.json").read_text())
    assert list(result["variants"]) == list(model.ATTENTION) and variant in result["variants"]
    row = result["variants"][variant]
    assert row["check"]["ok"], row["check"]
    assert [d["cache_pct_mha"] for d in row["decode"]] == [50, 50]  # 2 of 4 KV heads


@pytest.mark.parametrize("variant", ["lrkv_per_layer"], indirect=True)
def test_a_per_layer_rank_trains_and_is_analysed_with_every_layers_cache(variant, data_dir, tmp_path):
    run = tmp_path / "out" / variant
    assert train.main(flags(data_dir=data_dir, out_dir=run, attn=variant, n_head=4, head_dim=8, lrkv_rank=3,
                            n_layer=3, max_steps=4, eval_interval=2)) == 0
    analyze.main([str(run / "ckpt.pt"), "--out_dir", str(tmp_path / "figures")])
    [result] = json.loads((tmp_path / "figures" / "analysis.json").read_text())["runs"]
    ranks = [3, 6, 8]  # 3 x (layer + 1), at most head_dim
    assert result["kv_cache_elements_per_token"] == sum(2 * 8 + 2 * 4 * r + 4 for r in ranks)
    # of MHA's 2 H d_h in each of the 3 layers
    elements = result["kv_cache_elements_per_token"]
    assert result["kv_cache_fraction"] == pytest.approx(elements / (3 * 2 * 4 * 8))
    assert len(result["effective_rank"]) == 3 and result["label"] == "LRKV (r=3 x layer)"
