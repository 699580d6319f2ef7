"""Tests of convert.py, train.py --init_from's conversion: every variant that converts keeps at least
what MQA's mean keeps and is exact where the source is in its reach; then each variant's own
optimum, Eckart-Young for LRKV in the weights and on the inputs, the mean for GQA and MQA."""

from dataclasses import replace

import pytest
import torch

from lib.attention import convert
from lib.attention.heads import head_kv_weights

from model import GPT, VARIANTS
from references import TINY, tiny_model


def per_head_error(W, heads, C=None):
    """sum_h ||(W_h - heads_h) C^(1/2)||_F^2 for (H, d_h, d) stacks, C None for Frobenius."""
    D = (W - heads).double()
    return (D.pow(2).sum() if C is None else torch.einsum("hod,de,hoe->", D, C, D)).item()


@pytest.mark.parametrize("attn", VARIANTS)
def test_every_conversion_keeps_what_the_mean_keeps_and_is_exact_within_reach(attn):
    """From an MHA source, a variant either refuses in one line or: copies the embeddings, queries,
    output projections and MLPs; gives back per-head projections (its head_kv_weights) no further
    from the source's than their mean, MQA's conversion, in the weights and, calibrated, on the
    inputs; and from a source whose heads are all equal, which every variant can hold, gives back
    the source's logits."""
    for inputs in (None, [calibration_inputs(seed) for seed in range(TINY.n_layer)]):
        converts_within_reach(attn, None if inputs is None else [X.T @ X / len(X) for X in inputs])


def converts_within_reach(attn, covariances):
    mha = tiny_model("mha").double()
    model = GPT(replace(TINY, attn=attn)).double().eval()
    try:
        convert.convert(model, mha, covariances)
    except ValueError as refusal:  # a variant that cannot be converted to says so in one line
        assert "\n" not in str(refusal) and str(refusal).startswith(("--attn=", "MLA is not converted to"))
        return
    ours, theirs = model.state_dict(), mha.state_dict()
    for name in theirs:
        if any(part in f".{name}" for part in ("wte.", "lm_head.", ".mlp.", ".attn.W_q.", ".attn.W_o.")):
            assert torch.equal(ours[name], theirs[name]), name
    for layer, (block, source) in enumerate(zip(model.blocks, mha.blocks)):
        C = None if covariances is None else covariances[layer]
        for got, heads in zip(head_kv_weights(block.attn), head_kv_weights(source.attn)):
            mean = heads.mean(0, keepdim=True).expand_as(heads)
            assert per_head_error(got, heads, C) <= per_head_error(mean, heads, C) * (1 + 1e-9)

    same = tiny_model("mha").double()
    with torch.no_grad():
        for block in same.blocks:  # every head the first one
            for W in (block.attn.W_k, block.attn.W_v):
                W.weight.copy_(W.weight[:TINY.head_dim].repeat(TINY.n_head, 1))
    convert.convert(model, same, covariances)
    idx = torch.randint(0, TINY.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], same(idx)[0], atol=1e-9, rtol=0)


def converted(source, attn, **overrides):
    model = GPT(replace(source.config, attn=attn, **overrides)).eval()
    convert.convert(model, source)
    return model


def test_lrkv_of_full_rank_converted_from_mha_gives_mhas_logits():
    """r = d_h: W_shared = the heads' mean, and each head's whole deviation from it is kept."""
    mha = tiny_model("mha")
    lrkv = converted(mha, "lrkv", lrkv_rank=TINY.head_dim)
    idx = torch.randint(0, TINY.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(lrkv(idx)[0], mha(idx)[0], atol=1e-5, rtol=0)


def test_gqa_with_all_kv_heads_converted_from_mha_is_mha():
    mha = tiny_model("mha")
    gqa = converted(mha, "gqa", n_kv_head=TINY.n_head)
    idx = torch.randint(0, TINY.vocab_size, (2, 20))
    with torch.no_grad():
        assert torch.equal(gqa(idx)[0], mha(idx)[0])


def test_an_lrkv_source_converts_to_mha_exactly():
    """LRKV's own per-head projections W_shared + U_h B_h^T, keys and values, are what MHA rebuilds."""
    lrkv = tiny_model("lrkv")
    mha = converted(lrkv, "mha")
    idx = torch.randint(0, TINY.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(mha(idx)[0], lrkv(idx)[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn, groups", [("gqa", TINY.n_kv_head), ("mqa", 1)])
def test_grouped_heads_are_the_mean_of_their_group(attn, groups):
    mha = tiny_model("mha")
    model = converted(mha, attn)
    H, d_h, size = TINY.n_head, TINY.head_dim, TINY.n_head // groups
    for block, source in zip(model.blocks, mha.blocks):
        for name in ("W_k", "W_v"):
            heads = getattr(source.attn, name).weight.view(H, d_h, -1)
            mine = getattr(block.attn, name).weight.view(groups, d_h, -1)
            for g in range(groups):
                torch.testing.assert_close(mine[g], sum(heads[g * size + i] for i in range(size)) / size)


def test_lrkv_residuals_lose_exactly_the_discarded_singular_values():
    """Eckart-Young: the rank-r truncated SVD of W_h - W_shared misses it by the norm of the
    singular values it drops, and no rank-r matrix misses it by less."""
    mha, r = tiny_model("mha"), 3
    lrkv = converted(mha, "lrkv", lrkv_rank=r)
    H, d_h = TINY.n_head, TINY.head_dim
    for block, source in zip(lrkv.blocks, mha.blocks):
        attn = block.attn
        for W, W_shared, U, B in ((source.attn.W_k, attn.W_shared_k, attn.U_k, attn.B_k),
                                  (source.attn.W_v, attn.W_shared_v, attn.U_v, attn.B_v)):
            heads = W.weight.double().view(H, d_h, -1)
            torch.testing.assert_close(W_shared.weight.double(), heads.mean(0), atol=1e-6, rtol=0)
            U, B = U.weight.double().view(H, r, -1), B.double().view(H, d_h, r)
            for h in range(H):
                deviation = heads[h] - heads.mean(0)
                dropped = torch.linalg.svdvals(deviation)[r:]
                error = torch.linalg.matrix_norm(deviation - B[h] @ U[h])
                assert error.item() == pytest.approx(dropped.norm().item(), rel=1e-5)
                # the singular values are split evenly between the factors
                torch.testing.assert_close(B[h].norm(dim=0), U[h].norm(dim=1), atol=1e-5, rtol=1e-4)


# Activation-aware conversion: each layer weighs its heads' error by the inputs its attention sees

def calibration_inputs(seed, dead_scale=1.0, n=400):
    """X (n, d) in float64: inputs whose scale spans a factor 100 over a random basis, so that
    the whitened and the plain conversions differ, and whose input dim 0 is multiplied by
    dead_scale (0: a dead direction, which makes X^T X singular)."""
    generator = torch.Generator().manual_seed(seed)
    d = TINY.n_embd
    basis = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))[0]
    scales = torch.logspace(0, -2, d, dtype=torch.float64)
    X = torch.randn(n, d, generator=generator, dtype=torch.float64) * scales @ basis
    X[:, 0] *= dead_scale
    return X


def converted64(source, attn, inputs, **overrides):
    """source converted in float64, layer l weighing by the covariance X^T X / n of inputs[l]."""
    model = GPT(replace(source.config, attn=attn, **overrides)).double()
    covariances = None if inputs is None else [X.T @ X / len(X) for X in inputs]
    convert.convert(model, source.double(), covariances)
    return model


def lrkv_deviations(lrkv, mha):
    """Per layer, keys then values: each head's deviation from the mean D_h (H, d_h, d) and its
    rank-r residual (U_h B_h^T)^T = B_h U_h^T from the converted model, both float64."""
    H, d_h, r = TINY.n_head, TINY.head_dim, lrkv.config.lrkv_rank
    for block, source in zip(lrkv.blocks, mha.blocks):
        attn = block.attn
        for W, U, B in ((source.attn.W_k, attn.U_k, attn.B_k), (source.attn.W_v, attn.U_v, attn.B_v)):
            heads = W.weight.double().view(H, d_h, -1)
            yield heads - heads.mean(0), B.view(H, d_h, r) @ U.weight.view(H, r, -1)


@pytest.mark.parametrize("dead_scale", [1.0, 0.0])
def test_whitened_residuals_lose_on_the_inputs_exactly_the_dropped_singular_values(dead_scale):
    """Whitened Eckart-Young: on the calibration inputs X, each head's rank-r residual misses its
    deviation D_h by the singular values of X D_h^T that it drops, the least any rank-r matrix can,
    and less than the plain SVD misses there; also with a dead input direction (dead_scale 0)."""
    mha, r = tiny_model("mha").double(), 3
    inputs = [calibration_inputs(seed, dead_scale) for seed in range(TINY.n_layer)]
    whitened = lrkv_deviations(converted64(mha, "lrkv", inputs, lrkv_rank=r), mha)
    plain = lrkv_deviations(converted64(mha, "lrkv", None, lrkv_rank=r), mha)
    for i, ((D, M), (_, M_plain)) in enumerate(zip(whitened, plain)):
        X = inputs[i // 2]  # keys and values of one layer see the same inputs
        assert torch.isfinite(M).all()
        for h in range(TINY.n_head):
            error = torch.linalg.matrix_norm(X @ (D[h] - M[h]).T) ** 2
            dropped = torch.linalg.svdvals(X @ D[h].T)[r:]
            assert error.item() == pytest.approx((dropped ** 2).sum().item(), rel=1e-9)
            assert torch.linalg.matrix_norm(X @ (D[h] - M_plain[h]).T) ** 2 > 1.05 * error


def test_a_dead_input_direction_keeps_the_deviation_in_the_kept_output_directions():
    """A direction the inputs never take (column 0 of X zero) costs nothing on them, so any
    residual there is as good as another: the conversion keeps D_h's part in the output
    directions its residual spans, the choice closest to D_h, which is the limit of inputs that
    take it less and less, with nothing blowing up on the way."""
    mha, r = tiny_model("mha").double(), 3

    def residuals(scale):
        inputs = [calibration_inputs(seed, scale) for seed in range(TINY.n_layer)]
        return lrkv_deviations(converted64(mha, "lrkv", inputs, lrkv_rank=r), mha)

    for (D, M), (_, M_faint) in zip(residuals(0.0), residuals(1e-9)):
        for h in range(TINY.n_head):
            outputs = torch.linalg.svd(M[h])[0][:, :r]  # (d_h, r): the output directions M_h spans
            torch.testing.assert_close(M[h][:, 0], outputs @ outputs.T @ D[h][:, 0], atol=1e-12, rtol=0)
        torch.testing.assert_close(M, M_faint, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dead_scale", [1.0, 0.0])
def test_lrkv_of_full_rank_converted_with_calibration_gives_mhas_logits(dead_scale):
    mha = tiny_model("mha")
    lrkv = GPT(replace(TINY, attn="lrkv", lrkv_rank=TINY.head_dim)).eval()
    inputs = [calibration_inputs(seed, dead_scale) for seed in range(TINY.n_layer)]
    covariances = [X.T @ X / len(X) for X in inputs]
    convert.convert(lrkv, mha, covariances)
    idx = torch.randint(0, TINY.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(lrkv(idx)[0], mha(idx)[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn", ["gqa", "mqa"])
def test_mean_pooled_heads_are_what_whitening_would_choose(attn):
    """GQA's and MQA's mean is the same with the inputs' covariance, and optimal on the inputs:
    moving a pooled head off it costs more on X."""
    mha = tiny_model("mha").double()
    inputs = [calibration_inputs(seed) for seed in range(TINY.n_layer)]
    pooled, whitened = converted64(mha, attn, None), converted64(mha, attn, inputs)
    assert all(torch.equal(pooled.state_dict()[k], v) for k, v in whitened.state_dict().items())
    H, d_h = TINY.n_head, TINY.head_dim
    generator = torch.Generator().manual_seed(0)
    for block, source, X in zip(pooled.blocks, mha.blocks, inputs):
        group = source.attn.W_k.weight.view(H, d_h, -1)[:H // block.attn.n_kv_head]  # the first group's heads
        mean = block.attn.W_k.weight[:d_h]  # and the key head they pool into

        def cost(M):
            return sum(torch.linalg.matrix_norm(X @ (W - M).T) ** 2 for W in group)

        for _ in range(5):
            moved = mean + 1e-3 * torch.randn(mean.shape, generator=generator, dtype=torch.float64)
            assert cost(moved) > cost(mean)


@pytest.mark.parametrize("attn, overrides, message", [
    ("mla", {}, "MLA is not converted to"),
    ("mha", dict(n_layer=3), "n_layer = 2, this model 3"),
    ("mha", dict(vocab_size=64), "vocab_size = 61, this model 64"),
    ("mha", dict(cla=2), "cla = 1, this model 2"),
])
def test_what_cannot_convert_is_refused(attn, overrides, message):
    with pytest.raises(ValueError, match=message):
        converted(tiny_model("mha"), attn, **overrides)


def test_mla_gives_no_per_head_projections():
    with pytest.raises(ValueError, match="MultiHeadLatentAttention gives no per-head key and value"):
        converted(tiny_model("mla"), "mha")


def test_cla_models_convert_layer_by_layer_where_the_groups_agree():
    """MHA-CLA2 to LRKV-CLA2 of full rank: each group's first layer converts, the later ones hold
    queries alone, which carry over, so the logits are MHA-CLA2's."""
    mha = tiny_model("mha", cla=2)
    lrkv = converted(mha, "lrkv", lrkv_rank=TINY.head_dim)
    idx = torch.randint(0, TINY.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(lrkv(idx)[0], mha(idx)[0], atol=1e-5, rtol=0)
