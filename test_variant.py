"""A sixth attention variant, written here and registered for these tests only: GQA whose query
heads share the G key/value heads interleaved (head h reads head h mod G) instead of in
contiguous groups. No other file knows it, yet it goes through test_model.py's generic tests,
train.py (a run and its resume), analyze.py and bench.py: the README's "write the class,
register it" is all a variant takes."""

import json

import pytest
import torch

import analyze
import bench
import model
import test_analyze
import test_model
import train
from model import GroupedQueryAttention, apply_rope, norm
from test_train import data_dir, flags  # noqa: F401 (data_dir is a fixture)

NAME = "gqa_interleaved"


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
            k, v = cache.update(k=k, v=v)
        # SDPA's enable_gqa groups heads contiguously: tile the G heads H/G times instead, so that
        # head h meets head h mod G
        tiles = self.n_head // self.n_kv_head
        return self.project_out(self.attend(q, k.repeat(1, 1, tiles, 1), v.repeat(1, 1, tiles, 1)))

    def head_qk_weights(self):
        Wk = self.W_k.weight.view(self.n_kv_head, self.head_dim, -1).transpose(1, 2)  # (G, d, d_h)
        return self.query_weights(), Wk.repeat(self.n_head // self.n_kv_head, 1, 1)


def naive_keys_values(attn, x, config):
    H, G, d_h, T = config.n_head, config.n_kv_head, config.head_dim, x.size(1)
    k, v = (test_model.lin(x[0], W).view(T, G, d_h) for W in (attn.W_k, attn.W_v))
    return [k[:, h % G] for h in range(H)], [v[:, h % G] for h in range(H)], d_h


def head_keys(layer, x, c):
    return layer.W_k(x).view(len(x), c.n_kv_head, c.head_dim)[:, torch.arange(c.n_head) % c.n_kv_head]


@pytest.fixture
def registered(monkeypatch):
    """The variant in the registry, and its references in test_model.py's tables, for one test."""
    monkeypatch.setitem(model.ATTENTION, NAME, InterleavedGroupedQueryAttention)
    monkeypatch.setitem(test_model.NAIVE_KEYS_VALUES, NAME, naive_keys_values)
    monkeypatch.setitem(test_model.HEAD_KEYS, NAME, head_keys)


GENERIC_TESTS = [
    test_model.test_attention_matches_naive_reference,
    test_model.test_forward_shapes_and_finite_loss,
    test_model.test_tiny_model_overfits_one_batch,
    test_model.test_cached_decoding_equals_full_forward,
    test_model.test_single_token_steps_match_a_chunk_over_64_positions,
    test_model.test_greedy_generation_is_the_same_with_and_without_cache,
    test_model.test_head_qk_weights_match_each_variants_projections,
]


@pytest.mark.parametrize("generic_test", GENERIC_TESTS, ids=lambda test: test.__name__)
def test_generic_model_tests_pass(generic_test, registered):
    assert 1 < test_model.TINY.n_kv_head < test_model.TINY.n_head  # else interleaved groups are contiguous ones
    generic_test(NAME)


def test_trains_resumes_is_analyzed_and_benched(registered, data_dir, tmp_path):
    # 4 heads over 2 KV heads, where interleaving differs from GQA's contiguous groups
    run = tmp_path / "out" / NAME
    small = flags(data_dir=data_dir, out_dir=run, attn=NAME, n_head=4, head_dim=8, n_kv_head=2, max_steps=4,
                  eval_interval=2)
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
    bench.main(["--preset=tiny", "--device=cpu", "--check", "--no-compiled_decode", f"--out={tmp_path / 'bench.json'}"])
    result = json.loads((tmp_path / "bench.json").read_text())
    assert list(result["variants"]) == list(model.ATTENTION) and NAME in result["variants"]
    row = result["variants"][NAME]
    assert row["check"]["ok"], row["check"]
    assert [d["cache_pct_mha"] for d in row["decode"]] == [50, 50]  # 2 of 4 KV heads
