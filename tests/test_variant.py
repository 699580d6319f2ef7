"""Attention variants written here and registered for these tests only, which no other file knows:
- GQA whose query heads share the G key/value heads interleaved (head h reads head h mod G)
  instead of in contiguous groups;
- LRK, LRKV's keys with one value that every head shares, as MQA's;
- LRKV whose rank differs from layer to layer;
- grouped LRKV, one residual for each group of H/G heads, every head its own B_h;
- LRKV with a softmax of its own: a learned temperature per head, times 1 + layer / 4, in its attend.
The last four subclass LowRankKVAttention. Each goes through every test of test_model.py,
test_decode.py, test_convert.py, test_window.py and test_serve.py that runs on every variant, with a
Reference as tests/references.py's REFERENCES hold them (so the softmax of its own through every decoding
path and layout, and the serving engine's paged cache, which refuses the per-layer ranks in one line);
the interleaved one also through train.py (a run and its resume), analyze.py and bench.py,
the per-layer one and the scaled one through train.py and analyze.py. Each gives what README's "Adding
a variant" asks: its key (and value) weights as methods of its class, its single-token step in
decode.py's STEPS (or LRKV's, inherited), its conversion in convert.py's table (or none: refused),
its legend in lib/evaluation/runs.py's; the fixture `variant` puts each in model.VARIANTS, and the
others in their tables, for one test."""

import inspect
import itertools
import json

import pytest
import torch

import analyze
from lib.evaluation import runs
import references
import test_analyze
import test_convert
import test_decode
import test_model
import test_serve
import test_window
import train
from lib.attention import convert, decode
from lib.attention.engine import Engine
from lib.attention.heads import HEAD_KV_WEIGHTS
from lib.attention.ring import masked_softmax
import model
from variants import (GroupedLowRankKVAttention, InterleavedGroupedQueryAttention, LowRankKeyAttention,
                      PerLayerRankAttention, ScaledSoftmaxAttention, layer_rank)
from references import KEY_RMS_MIB, Reference
from test_train import data_dir, flags  # noqa: F401 (data_dir is a fixture)
from lib.training.recipe import TrainConfig, configure_optimizers
from tools import bench


def interleaved_head_kv_weights(attn):
    tiles = attn.n_head // attn.n_kv_head
    G, d_h = attn.n_kv_head, attn.head_dim
    return tuple(W.weight.view(G, d_h, -1).repeat(tiles, 1, 1) for W in (attn.W_k, attn.W_v))


def load_interleaved_head_kv_weights(attn, W_K, W_V, C=None):
    """Key/value head g the mean of the heads that read it, g, g + G, g + 2 G, ..."""
    G, d_h = attn.n_kv_head, attn.head_dim
    for W, heads in ((attn.W_k, W_K), (attn.W_v, W_V)):
        W.weight.copy_(heads.view(-1, G, d_h, heads.size(-1)).mean(0).flatten(0, 1))


convert.LOAD_HEAD_KV_WEIGHTS[InterleavedGroupedQueryAttention] = load_interleaved_head_kv_weights


def lrk_head_kv_weights(attn):
    H, d_h, r = attn.n_head, attn.head_dim, attn.lrkv_rank
    residuals = torch.einsum("hdr,hrc->hdc", attn.B_k.view(H, d_h, r), attn.U_k.weight.view(H, r, -1))
    return attn.W_shared_k.weight + residuals, attn.W_shared_v.weight.expand(H, -1, -1)  # (H, d_h, d)


def lrk_step(attn, q, cached, rope, mask):
    """LRKV's exact key scores, then the one shared value: a_h V_shared."""
    scores = decode.key_scores(attn, q, cached["k_shared"], cached["r_k"], cached["rho"], rope)  # (B, H, S)
    return (masked_softmax(scores, mask, q.dtype) @ cached["v_shared"]).unsqueeze(1)


def load_lrk_head_kv_weights(attn, W_K, W_V, C=None):
    """The keys as LRKV converts them; the one value the heads' mean, as MQA's."""
    convert.load_lrkv_head_weights(attn, W_K, attn.W_shared_k, attn.U_k, attn.B_k, C)
    attn.W_shared_v.weight.copy_(W_V.mean(0))



def grouped_lrkv_head_kv_weights(attn):
    H, G, d_h, r = attn.n_head, attn.n_groups, attn.head_dim, attn.lrkv_rank

    def heads(W_shared, U, factor):
        U_t = U.weight.view(G, r, -1).repeat_interleave(H // G, dim=0)  # (H, r, d)
        return W_shared.weight + torch.einsum("hdr,hrc->hdc", factor.view(H, d_h, r), U_t)
    return heads(attn.W_shared_k, attn.U_k, attn.B_k), heads(attn.W_shared_v, attn.U_v, attn.B_v)


def grouped_lrkv_step(attn, q, cached, rope, mask):
    """LRKV's step on each head's residual."""
    per_head = {name: attn.per_head(t) if name in ("r_k", "r_v") else t for name, t in cached.items()}
    return decode.lrkv_step(attn, q, per_head, rope, mask)


def load_grouped_lrkv_head_kv_weights(attn, W_K, W_V, C=None):
    """W_shared the heads' mean; a group's residual the rank-r truncated SVD of its heads'
    deviations stacked, (H/G d_h, d), U_g shared by the group, each head's B_h its rows; with C
    the stacked deviations times C^(1/2) (shared_plus_low_rank's projection, for a group)."""
    G, r = attn.n_groups, attn.lrkv_rank
    for heads, W_shared, U, factor in ((W_K, attn.W_shared_k, attn.U_k, attn.B_k),
                                       (W_V, attn.W_shared_v, attn.U_v, attn.B_v)):
        mean = heads.double().mean(0)
        D = (heads.double() - mean).reshape(G, -1, heads.size(-1))  # (G, H/G d_h, d)
        # D C D^T's top eigenvectors are the left singular vectors of D C^(1/2), no root of C needed
        gram = D @ (D.mT if C is None else C.double() @ D.mT)  # (G, H/G d_h, H/G d_h)
        P = torch.linalg.eigh(gram)[1][..., -r:]  # (G, H/G d_h, r)
        W_shared.weight.copy_(mean)
        U.weight.copy_((P.mT @ D).flatten(0, 1))  # (G r, d)
        factor.copy_(P.flatten(0, 1))  # (H d_h, r)



def scaled_softmax_step(attn, q, cached, rope, mask):
    """LRKV's exact step on the queries scaled as ScaledSoftmaxAttention's attend scales them: tau_h
    (1 + layer / 4) q_h . k_h is (tau_h (1 + layer / 4) q_h) . k_h. attn is the layer that wrote the
    entries, whose tau this reads: decode.py never runs it for a reader of another layer's keys."""
    scale = attn.tau * (1 + attn.layer / 4)  # (H,)
    return decode.lrkv_step(attn, q * scale.view(-1, 1).to(q.dtype), cached, rope, mask)


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
    k, v = (references.lin(x[0], W).view(T, G, d_h) for W in (attn.W_k, attn.W_v))
    return [k[:, h % G] for h in range(H)], [v[:, h % G] for h in range(H)], d_h


def interleaved_head_keys(layer, x, c):
    return layer.W_k(x).view(len(x), c.n_kv_head, c.head_dim)[:, torch.arange(c.n_head) % c.n_kv_head]


def lrk_keys_values(attn, x, config):
    """Each head's key projection W_shared^K + U_h B_h^T built whole, and the one shared value."""
    H, d_h, r = config.n_head, config.head_dim, config.lrkv_rank
    U, B = attn.U_k.weight.double().view(H, r, -1), attn.B_k.double().view(H, d_h, r)
    keys = [x[0] @ (attn.W_shared_k.weight.double() + B[h] @ U[h]).t() for h in range(H)]
    return keys, [references.lin(x[0], attn.W_shared_v)] * H, d_h


# the paper's 128M shape: 12 layers of 6 heads of 128, r = 46 (lrkv_per_layer: 46, 92, then 128)
PAPER_BF16_MIB_PER_ELEMENT = 12 * 2048 * 2 / 2**20

# Each variant's class, its Reference (as references.py's REFERENCES) and its legend (runs.LEGEND's)
VARIANTS = {
    "gqa_interleaved": (InterleavedGroupedQueryAttention, Reference(
        keys_values=interleaved_keys_values, head_keys=interleaved_head_keys,
        params=lambda c, layer: (2 * c.n_kv_head * c.n_embd * c.head_dim, c.head_dim),
        paper_cache_mib=36, decoder_extra_mib=0,  # GQA's: 3 of 6 KV heads
        cache_elements=lambda c, layer: 2 * c.n_kv_head * c.head_dim,
        key_weights=("W_k",), key_builder=references.grouped_key_builder),
        (lambda config, peers: f"Interleaved GQA ({config.n_kv_head} KV heads)",
         lambda config: config.n_kv_head)),
    "lrk": (LowRankKeyAttention, Reference(
        keys_values=lrk_keys_values, head_keys=references.lrkv_head_keys,
        # W_shared^K and W_shared^V (d x d_h), and each head's U_h^K (d x r) and B_h^K (d_h x r)
        params=lambda c, layer: (
            2 * c.n_embd * c.head_dim + c.n_head * c.lrkv_rank * (c.n_embd + c.head_dim), c.head_dim),
        paper_cache_mib=24.9375,  # 12 layers x 2048 tokens x (2 d_h + H r = 2 x 128 + 6 x 46) x 2 bytes
        decoder_extra_mib=KEY_RMS_MIB,
        cache_elements=lambda c, layer: 2 * c.head_dim + c.n_head * c.lrkv_rank + c.n_head,
        key_weights=("W_shared_k", "U_k"), key_builder=references.lrkv_key_builder),
        (lambda config, peers: f"LRK (r={config.lrkv_rank})", lambda config: config.lrkv_rank)),
    "lrkv_per_layer": (PerLayerRankAttention, Reference(
        keys_values=references.lrkv_keys_values, head_keys=references.lrkv_head_keys,
        params=lambda c, layer: (
            2 * c.n_embd * c.head_dim + 2 * c.n_head * layer_rank(c, layer) * (c.n_embd + c.head_dim),
            c.head_dim),
        paper_cache_mib=(2 * 128 + 2 * 6 * (46 + 92 + 10 * 128) / 12) * PAPER_BF16_MIB_PER_ELEMENT,
        decoder_extra_mib=KEY_RMS_MIB,
        cache_elements=lambda c, layer: 2 * c.head_dim + 2 * c.n_head * layer_rank(c, layer) + c.n_head,
        key_weights=("W_shared_k", "U_k"), key_builder=references.lrkv_key_builder),
        (lambda config, peers: f"LRKV (r={config.lrkv_rank} x layer)", lambda config: config.lrkv_rank)),
    "lrkv_grouped": (GroupedLowRankKVAttention, Reference(
        keys_values=grouped_lrkv_keys_values, head_keys=references.lrkv_head_keys,
        # W_shared^K and W_shared^V (d x d_h), each group's U_g (d x r) and each head's B_h (d_h x r)
        params=lambda c, layer: (
            2 * c.n_embd * c.head_dim + 2 * c.lrkv_rank * (c.n_kv_head * c.n_embd + c.n_head * c.head_dim),
            c.head_dim),
        paper_cache_mib=(2 * 128 + 2 * 3 * 46) * PAPER_BF16_MIB_PER_ELEMENT,  # 3 groups at 128M
        decoder_extra_mib=KEY_RMS_MIB,
        cache_elements=lambda c, layer: 2 * c.head_dim + 2 * c.n_kv_head * c.lrkv_rank + c.n_head,
        key_weights=("W_shared_k", "U_k"), key_builder=references.lrkv_key_builder),
        (lambda config, peers: f"Grouped LRKV (r={config.lrkv_rank}, {config.n_kv_head} groups)",
         lambda config: config.lrkv_rank)),
    "lrkv_scaled": (ScaledSoftmaxAttention, Reference(
        keys_values=references.lrkv_keys_values, head_keys=references.lrkv_head_keys,
        # LRKV's, and tau: one number a head
        params=lambda c, layer: (
            2 * c.n_embd * c.head_dim + 2 * c.n_head * c.lrkv_rank * (c.n_embd + c.head_dim) + c.n_head,
            c.head_dim),
        paper_cache_mib=37.875, decoder_extra_mib=KEY_RMS_MIB,
        cache_elements=lambda c, layer: 2 * c.head_dim + 2 * c.n_head * c.lrkv_rank + c.n_head,
        key_weights=("W_shared_k", "U_k"), key_builder=references.lrkv_key_builder,
        score_scale=lambda attn, h: attn.tau[h].item() * (1 + attn.layer / 4)),
        (lambda config, peers: f"Scaled-softmax LRKV (r={config.lrkv_rank})",
         lambda config: config.lrkv_rank)),
}


@pytest.fixture(params=VARIANTS)
def variant(request, monkeypatch):
    """One of the variants above, registered under its --attn name for one test: its name."""
    name, (cls, reference, legend) = request.param, VARIANTS[request.param]
    monkeypatch.setitem(model.VARIANTS, name, cls)
    # the steps, conversions and head maps of the variants above that have their own, in decode.py's,
    # convert.py's and heads.py's tables
    own = ((LowRankKeyAttention, lrk_step, load_lrk_head_kv_weights),
           (GroupedLowRankKVAttention, grouped_lrkv_step, load_grouped_lrkv_head_kv_weights),
           (PerLayerRankAttention, None, convert.load_lrkv_head_kv_weights))  # LRKV's step, inherited
    for cls, step, load in own:
        if step is not None:
            monkeypatch.setitem(decode.STEPS, cls, step)
        monkeypatch.setitem(convert.LOAD_HEAD_KV_WEIGHTS, cls, load)
    monkeypatch.setitem(decode.STEPS, ScaledSoftmaxAttention, scaled_softmax_step)  # no conversion: refused
    for cls, maps in ((InterleavedGroupedQueryAttention, interleaved_head_kv_weights),
                      (LowRankKeyAttention, lrk_head_kv_weights),
                      (GroupedLowRankKVAttention, grouped_lrkv_head_kv_weights)):
        monkeypatch.setitem(HEAD_KV_WEIGHTS, cls, maps)
    monkeypatch.setitem(references.REFERENCES, name, reference)
    monkeypatch.setitem(runs.LEGEND, name, legend)
    return name


def parameters(test):
    """{name: values} of a test's parametrize marks."""
    marks = getattr(test, "pytestmark", [])
    return {mark.args[0]: mark.args[1] for mark in marks if mark.name == "parametrize"}


# test_serve.py's tests of the engine over its paged pool, which pools layers that cache entries of one
# shape: every variant above but per-layer ranks, which the pool refuses in one line (below)
PAGED_TESTS = [test_serve.test_every_request_decodes_as_its_prompt_alone,
               test_serve.test_int4_pages_its_key_groups_as_blocks]
# Every other test of test_model.py, test_decode.py, test_convert.py, test_window.py and test_serve.py
# parametrized over every variant: a new variant needs nothing for windows and sharing
GENERIC_TESTS = [test for module in (test_model, test_decode, test_convert, test_window, test_serve)
                 for name, test in vars(module).items()
                 if name.startswith("test_") and parameters(test).get("attn") is model.VARIANTS
                 and test not in PAGED_TESTS]


@pytest.mark.parametrize("generic_test", GENERIC_TESTS, ids=lambda test: test.__name__)
def test_generic_model_tests_pass(generic_test, variant, request):
    """Each generic test on the variant, at every value of its other parameters (--cla's), the rest
    of its arguments fixtures."""
    run_generic(generic_test, variant, request)


@pytest.mark.parametrize("variant", [name for name, (cls, _, _) in VARIANTS.items()
                                     if cls is not PerLayerRankAttention], indirect=True)
@pytest.mark.parametrize("paged_test", PAGED_TESTS, ids=lambda test: test.__name__)
def test_the_engine_serves_every_request_as_alone(paged_test, variant, request):
    run_generic(paged_test, variant, request)


@pytest.mark.parametrize("variant", ["lrkv_per_layer"], indirect=True)
def test_the_engine_refuses_layers_of_different_cache_shapes_in_one_line(variant):
    refusal = "^a paged cache pools layers that cache entries of the same shapes$"
    with pytest.raises(ValueError, match=refusal):
        Engine(references.tiny_model(variant, n_layer=2), 10**6)


def run_generic(generic_test, variant, request):
    assert 1 < references.TINY.n_kv_head < references.TINY.n_head  # else interleaved groups are contiguous
    others = {name: values for name, values in parameters(generic_test).items() if name != "attn"}
    fixtures = [name for name in list(inspect.signature(generic_test).parameters)[1:] if name not in others]
    for values in itertools.product(*others.values()):
        generic_test(variant, **dict(zip(others, values)),
                     **{name: request.getfixturevalue(name) for name in fixtures})


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
    assert list(result["variants"]) == list(model.VARIANTS) and variant in result["variants"]
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


@pytest.mark.parametrize("variant", ["lrkv_scaled"], indirect=True)
def test_a_variants_own_vector_trains_under_adamw_and_stays_in_every_layer_with_cla(variant, data_dir,
                                                                                    tmp_path):
    """tau, one number a head and no matrix, is AdamW's at --adamw_lr (Muon takes matrices alone), and a
    layer that reads another's keys keeps its own (attend_weights): train.py trains it with --cla=2, each
    layer's tau staying where the seed drew it at --adamw_lr=0 and moving at the default, and analyze.py
    reads the run."""
    small = dict(attn=variant, n_head=4, head_dim=8, lrkv_rank=2, n_layer=2, cla=2, max_steps=3,
                 eval_interval=3)
    taus = {}
    for adamw_lr in (0, TrainConfig.adamw_lr):
        run = tmp_path / f"out-{adamw_lr}" / variant
        assert train.main(flags(data_dir=data_dir, out_dir=run, adamw_lr=adamw_lr, **small)) == 0
        ckpt = torch.load(run / "ckpt.pt", weights_only=True)
        taus[adamw_lr] = [ckpt["model"][f"blocks.{layer}.attn.tau"] for layer in range(2)]
    torch.manual_seed(ckpt["config"]["seed"])  # the weights train.py drew
    built = model.GPT(model.GPTConfig(**ckpt["model_args"]))
    drawn = [block.attn.tau.detach() for block in built.blocks]
    assert all(map(torch.equal, taus[0], drawn))
    assert not any(map(torch.equal, taus[TrainConfig.adamw_lr], drawn))
    optimizers = configure_optimizers(built, TrainConfig())
    muon_params = optimizers[0].param_groups[0]["params"]
    assert all(p.ndim == 2 for p in muon_params) and not {id(t) for t in drawn} & {id(p) for p in muon_params}
    analyze.main([str(run / "ckpt.pt"), "--out_dir", str(tmp_path / "figures")])
    [result] = json.loads((tmp_path / "figures" / "analysis.json").read_text())["runs"]
    assert result["label"] == "Scaled-softmax LRKV (r=2) + CLA2"
