"""Tests of model.py against the paper's math: each variant, every layer, against an independent
float64 reference (tests/references.py), the exact equivalences between variants, cached decoding
against the full forward pass, cross-layer sharing (CLA) with every variant, and the KV-cache sizes
of section 2."""

import math
import os
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch

from lib.attention import diversity, heads
from lib.attention.layout import kv_cache_elements_per_token
from lib.attention.decode import generate
from lib.evaluation.downstream import repeated
from lib.training.recipe import flops_per_token
from model import GPT, GPTConfig, VARIANTS, norm, rms as cached_rms
from references import (MIB, REFERENCES, TINY, Reference, cropped_greedy, naive_forward, small_key_model,
                        tiny_model, token_by_token)


@pytest.mark.parametrize("cla", [1, 2])
@pytest.mark.parametrize("attn", VARIANTS)
def test_every_layer_matches_the_naive_reference(attn, cla):
    """The whole model in float64, every layer head by head from its paper's formulas; with --cla=2,
    the second layer attends with the first's keys and values. To the fp32 logits' rounding."""
    model = tiny_model(attn, cla=cla).double()
    idx = torch.randint(0, TINY.vocab_size, (12,))
    with torch.no_grad():
        fast = model(idx[None])[0][0]
    torch.testing.assert_close(fast.double(), naive_forward(model, idx), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("attn", VARIANTS)
def test_forward_shapes_and_finite_loss(attn):
    model = GPT(replace(TINY, attn=attn))
    idx = torch.randint(0, TINY.vocab_size, (3, 10))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 10, TINY.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(loss)
    # the init makes every block the identity and the unembedding tiny: loss ~ ln(vocab)
    assert abs(loss.item() - math.log(TINY.vocab_size)) < 0.05
    assert model(idx)[1] is None


@pytest.mark.parametrize("attn", VARIANTS)
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


@pytest.mark.parametrize("cla", [1, 2])
@pytest.mark.parametrize("attn", VARIANTS)
def test_cached_decoding_equals_full_forward(attn, cla):
    model = tiny_model(attn, cla=cla)
    idx = torch.randint(0, TINY.vocab_size, (2, 24))
    with torch.no_grad():
        full = model(idx)[0]
        cache = model.new_cache(2, 24, dtype=torch.float32)
        # a multi-token prompt, a chunk that attends to a cached prefix, then token by token
        pieces = [model(idx[:, :9], cache=cache)[0], model(idx[:, 9:13], cache=cache)[0]]
        pieces += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(13, 24)]
    assert (torch.cat(pieces, dim=1) - full).abs().max() < 1e-4


@pytest.mark.parametrize("attn", VARIANTS)
def test_a_repeated_cache_continues_one_prompt_several_ways(attn):
    """A prompt prefilled once, its cache repeated for 3 continuations of different tokens: each
    continuation's logits are the full forward's of prompt + continuation."""
    model = tiny_model(attn, cla=2)
    prompt = torch.randint(0, TINY.vocab_size, (1, 9))
    continuations = torch.randint(0, TINY.vocab_size, (3, 6))
    with torch.no_grad():
        cache = model.new_cache(1, 15, dtype=torch.float32)
        model(prompt, cache=cache)
        logits = model(continuations, cache=repeated(cache, 3))[0]
        full = model(torch.cat((prompt.expand(3, -1), continuations), dim=1))[0][:, 9:]
    assert cache.pos == 9 and (logits - full).abs().max() < 1e-4


@pytest.mark.parametrize("attn", VARIANTS)
def test_cla_layers_hold_queries_alone_and_cache_nothing(attn):
    """--cla=2: the second layer of each pair keeps W_o, its queries' weights and its attend's (a
    variant's attend_weights), and nothing else (no key or value weights), and caches nothing: the model
    caches what its first layers cache at --cla=1, to the byte, counted off the buffers."""
    model, shared = tiny_model(attn, n_layer=4), tiny_model(attn, n_layer=4, cla=2)
    for layer, (block, block_cla) in enumerate(zip(model.blocks, shared.blocks)):
        names = {name for name, _ in block_cla.attn.named_parameters()}
        if layer % 2:
            plain = block.attn
            kept = {*getattr(plain, "query_weights", ["W_q"]), *getattr(plain, "attend_weights", []), "W_o"}
            assert names == {name for name, _ in plain.named_parameters() if name.split(".")[0] in kept}
        else:
            assert names == {name for name, _ in block.attn.named_parameters()}
    cache = shared.new_cache(1, 8)
    assert [cache.length(layer) for layer in range(4)] == [8, 0, 8, 0]
    assert [sum(buf.numel() for buf in layer.values()) for layer in cache.layers][1::2] == [0, 0]
    first_layers = model.new_cache(3, 32, device="meta").layers[::2]
    assert shared.kv_cache_bytes(3, 32) == sum(buf.nbytes for layer in first_layers for buf in layer.values())


@pytest.mark.parametrize("attn", list(VARIANTS))
def test_cla_2_halves_each_variants_cache_at_128m(attn):
    with torch.device("meta"):
        model, shared = GPT(GPTConfig(attn=attn)), GPT(GPTConfig(attn=attn, cla=2))
    assert 2 * shared.kv_cache_bytes(1, 2048, torch.bfloat16) == model.kv_cache_bytes(1, 2048, torch.bfloat16)
    assert 2 * kv_cache_elements_per_token(shared) == kv_cache_elements_per_token(model)


@pytest.mark.parametrize("cla", [0, 3])
def test_bad_cla_is_refused_naming_the_flag(cla):
    with pytest.raises(ValueError, match=f"--cla={cla}: must be"):
        GPTConfig(n_layer=4, cla=cla)


@pytest.mark.parametrize("attn", VARIANTS)
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
    assert sdpa_ops(cache=model.new_cache(2, 20, dtype=torch.float32)) == training


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3), (torch.float32, 1e-5),
                                        (torch.float64, 1e-12)], ids=["bf16", "fp16", "fp32", "fp64"])
def test_cached_rms_is_what_norm_divides_by(dtype, tol):
    """LRKV and MLA cache each key's RMS and divide by it where training calls norm(). Small
    vectors (mean square 1e-4) are where a wrong eps shows: bf16's own is 7.8e-3."""
    x = (0.01 * torch.randn(8, 64, dtype=torch.float64)).to(dtype)
    divided = x.double() / cached_rms(x).double()[..., None]
    assert torch.allclose(divided, norm(x).double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("attn", VARIANTS)
def test_bf16_single_token_steps_with_small_keys_match_the_full_forward(attn):
    model = small_key_model(attn)
    idx = torch.randint(0, TINY.vocab_size, (2, 24))
    with torch.no_grad():
        full, stepped = model(idx)[0], token_by_token(model, idx, 8, torch.bfloat16)
    assert (stepped - full[:, 8:]).norm() / full[:, 8:].norm() < 2e-2


@pytest.mark.parametrize("attn", VARIANTS)
def test_single_token_steps_match_a_chunk_over_64_positions(attn):
    """Single-token steps of the plain cached path against one chunk after the same prefix,
    which rebuilds the keys, and against the full forward, over 64 positions."""
    model = tiny_model(attn, block_size=64)
    idx = torch.randint(0, TINY.vocab_size, (2, 64))
    with torch.no_grad():
        full = model(idx)[0]
        cache = model.new_cache(2, 64, dtype=torch.float32)
        model(idx[:, :8], cache=cache)
        chunk = model(idx[:, 8:], cache=cache)[0]
        stepped = token_by_token(model, idx, 8)
    assert (stepped - chunk).abs().max() < 1e-4
    assert (stepped - full[:, 8:]).abs().max() < 1e-4


@pytest.mark.parametrize("attn", VARIANTS)
def test_greedy_generation_is_the_same_with_and_without_cache(attn):
    model = tiny_model(attn)
    prompt = torch.randint(0, TINY.vocab_size, (2, 5))
    cached = generate(model, prompt, 12, temperature=0)
    assert cached.shape == (2, 17) and torch.equal(cached[:, :5], prompt)
    assert torch.equal(cached, generate(model, prompt, 12, temperature=0, use_cache=False))
    sampled = generate(model, prompt, 12, temperature=0.8, top_k=5)
    assert sampled.shape == (2, 17) and sampled.max() < TINY.vocab_size
    top_1 = generate(model, prompt, 12, temperature=1.0, top_k=1)
    assert torch.equal(top_1, cached)  # top-1 sampling is greedy


def test_generation_draws_no_id_past_the_tokenizers_vocabulary():
    """A vocabulary padded for fast matmuls (GPT-2's 50257 to 50304) has ids no tokenizer decodes."""
    model = tiny_model("mha")
    prompt = torch.randint(0, TINY.vocab_size, (4, 3))
    assert generate(model, prompt, 20, temperature=5.0, vocab_size=7)[:, 3:].max() < 7
    assert generate(model, prompt, 20, temperature=0, vocab_size=7)[:, 3:].max() < 7


@pytest.mark.parametrize("attn", VARIANTS)
def test_generation_goes_on_past_the_context_on_caches_of_block_size(attn, monkeypatch):
    """Greedy tokens with the cache and without it are the reference's, the context cropped at the
    same points, over more than twice block_size; every cache allocated is block_size long. In
    float64: no near-tie between two logits can make a token differ."""
    model = tiny_model(attn).double()
    lengths = []
    new_cache = model.new_cache
    monkeypatch.setattr(model, "new_cache", lambda *a, **k: lengths.append(a[1]) or new_cache(*a, **k))
    L = TINY.block_size
    prompt = torch.randint(0, TINY.vocab_size, (2, 5))
    expected = cropped_greedy(model, prompt, 2 * L + 20)
    assert torch.equal(generate(model, prompt, 2 * L + 20, temperature=0), expected)
    assert lengths == [L] * 5  # the prompt's, and new starts at 33, 50, 67 and 84 tokens
    assert torch.equal(generate(model, prompt, 2 * L + 20, temperature=0, use_cache=False), expected)
    long_prompt = torch.randint(0, TINY.vocab_size, (2, L + 7))  # cropped to its last L tokens
    assert torch.equal(generate(model, long_prompt, 9, temperature=0), cropped_greedy(model, long_prompt, 9))


def test_what_exceeds_block_size_is_refused():
    model = tiny_model("mha")
    with pytest.raises(ValueError, match="sequence of 33 tokens is longer than block_size = 32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="a KV cache of 33 tokens exceeds block_size = 32"):
        model.new_cache(1, 33)
    cache = model.new_cache(1, 32)
    model(torch.zeros(1, 30, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="KV cache holds 32 tokens, 33 were asked for"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)


def cache_elements(attn, c):
    """The Reference's cached elements per token, summed over the layers."""
    return sum(REFERENCES[attn].cache_elements(c, layer) for layer in range(c.n_layer))


@pytest.mark.parametrize("attn", VARIANTS)
def test_kv_cache_bytes_of_the_128m_model(attn):
    with torch.device("meta"):
        model = GPT(GPTConfig(attn=attn))
    mib = REFERENCES[attn].paper_cache_mib + REFERENCES[attn].decoder_extra_mib
    assert model.kv_cache_bytes(1, 2048, torch.bfloat16) == mib * MIB
    H, d_h, c = model.config.n_head, model.config.head_dim, model.config
    assert kv_cache_elements_per_token(model) == cache_elements(attn, c)
    if attn == "lrkv":  # the paper's cache fraction 1/H + r/d_h = 52.6%, plus 1/(2 d_h) for the RMSs: 53.0%
        fraction = 1 / H + c.lrkv_rank / d_h + 1 / (2 * d_h)
        assert kv_cache_elements_per_token(model) / (c.n_layer * 2 * H * d_h) == pytest.approx(fraction)


@pytest.mark.parametrize("attn", VARIANTS)
def test_generation_allocates_exactly_the_predicted_cache(attn, monkeypatch):
    model = tiny_model(attn)
    allocated = []
    new_cache = model.new_cache
    monkeypatch.setattr(model, "new_cache",
                        lambda *a, **k: allocated.append(new_cache(*a, **k)) or allocated[-1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        generate(model, torch.zeros(3, 4, dtype=torch.long), 6)
    buffers = [buf for layer in allocated[0].layers for buf in layer.values()]
    assert all(b.dtype == torch.bfloat16 and b.shape[:2] == (3, 10) for b in buffers)
    assert sum(b.numel() * b.element_size() for b in buffers) == model.kv_cache_bytes(3, 10, torch.bfloat16)
    elements = 3 * 10 * kv_cache_elements_per_token(model)
    assert model.kv_cache_bytes(3, 10, torch.bfloat16) == 2 * elements


def test_caches_default_to_the_weights_dtype():
    model = tiny_model("lrkv")
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        assert {b.dtype for layer in model.new_cache(2, 8).layers for b in layer.values()} == {dtype}
        assert model.kv_cache_bytes(2, 8) == model.kv_cache_bytes(2, 8, dtype)


@pytest.mark.parametrize("attn", VARIANTS)
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
    assert flops_per_token(model, T) == 6 * (c.vocab_size * c.n_embd + params) + 6 * attention


@pytest.mark.parametrize("attn", VARIANTS)
def test_head_qk_grams_are_the_pair_products_of_each_variants_head_maps(attn):
    """What diversity.py reads of a layer, head_qk_grams, is (Q_i^T Q_j, K_i^T K_j) for the maps Q_h
    and K_h that make head h's query and key from x before the QK norm and RoPE: read off the
    Reference's head_keys on the basis of x's space (and head_key_weights maps x to them), or, for a
    variant with queries of its own (TPA), its heads' lifted maps. A variant without head maps (its
    Reference's head_keys None) is refused in one line."""
    model = tiny_model(attn).double()
    layer, c = model.blocks[1].attn, model.config
    if REFERENCES[attn].head_keys is None:
        with pytest.raises(ValueError, match="^[^\n]*$"):
            heads.head_qk_grams(layer, diversity.pair_products)
        return
    with torch.no_grad():
        if REFERENCES[attn].queries is None:
            basis = torch.eye(c.n_embd, dtype=torch.float64)
            Mq = layer.W_q(basis).view(c.n_embd, c.n_head, layer.qk_dim).transpose(0, 1)  # (H, d, d_qk)
            Mk = REFERENCES[attn].head_keys(layer, basis, c).transpose(0, 1)
            torch.testing.assert_close(heads.head_key_weights(layer), Mk, atol=1e-12, rtol=1e-12)
        else:
            Mq, Mk = REFERENCES[attn].head_keys(layer, None, c)  # (H, D, d_qk), q_h = features(x) @ Mq[h]
        for P, M in zip(heads.head_qk_grams(layer, diversity.pair_products), (Mq, Mk)):
            torch.testing.assert_close(torch.as_tensor(P), torch.einsum("hxa,gxb->hagb", M, M), atol=1e-10,
                                       rtol=1e-10)


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
    with pytest.raises(ValueError, match=f"--{field}="):
        GPTConfig(**overrides)


def python_files(root):
    """The repository's own Python files: none of a virtual environment, git, data or a run's output."""
    skip = {".git", "out", "data", "__pycache__"}
    for folder, subfolders, names in os.walk(root):  # a virtual environment, by any name, has pyvenv.cfg
        subfolders[:] = [name for name in subfolders
                         if name not in skip and not Path(folder, name, "pyvenv.cfg").exists()]
        yield from (Path(folder, name) for name in sorted(names) if name.endswith(".py"))


def test_no_line_of_the_repository_is_longer_than_110_characters():
    root = Path(__file__).parent
    long = [f"{path.relative_to(root)}:{i}" for path in python_files(root)
            for i, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 110]
    assert not long, f"lines over 110 characters: {', '.join(long)}"
