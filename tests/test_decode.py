"""Tests of decode.py: every registered single-token step equals the plain equation at every step of
a decode, builds no cached position's key, and decodes what the full forward gives; the fixed-shape
step gives the eager step's logits, is one graph at every position, and compiled by inductor gives
eager's tokens through GPT.generate's step, past the model's context too."""

import pytest
import torch

from lib.attention import decode

from lib.attention.decode import (ExactKVCache, FixedKVCache, compiled_decode, compiled_step, exact_step,
                                  generate)
from lib.attention.ring import RingKVCache
from model import LowRankKVAttention, VARIANTS
from references import REFERENCES, TINY, cropped_greedy, small_key_model, tiny_model, token_by_token


def exact_steps(model, idx, prefix, dtype=torch.float32):
    """idx's logits from position prefix on, each token after a prompt through its variant's
    single-token step (ExactKVCache)."""
    return token_by_token(model, idx, prefix, dtype, ExactKVCache)


def fixed_steps(model, idx, prefix, step):
    """idx's logits from position prefix on: a prompt of prefix tokens, then each token through
    step(model, token, cache) on a fixed-shape cache, advancing its position."""
    cache = model.new_cache(idx.size(0), idx.size(1), cache_class=RingKVCache)
    model(idx[:, :prefix], cache=cache)
    cache = FixedKVCache(cache)
    logits = []
    for t in range(prefix, idx.size(1)):
        logits.append(step(model, idx[:, t:t + 1].contiguous(), cache))  # as compiled_decode passes it
        cache.pos += 1
    return torch.stack(logits, dim=1)


@pytest.mark.parametrize("cla", [1, 2])
@pytest.mark.parametrize("attn", VARIANTS)
def test_every_registered_step_equals_its_plain_reference_at_every_step(attn, cla, monkeypatch):
    """A variant's registered step gives what reference_step, the plain equation, gives, on the
    arguments of every step of a decode, and so does each optimised piece it calls (a function of
    decode.py with a `<name>_reference` beside it: LRKV's key_scores and attend_values, MLA's
    latent_attention). A variant with no registered step has nothing to compare. With --cla=2 the
    second layer's queries run the first layer's step over its cache entries, but where its attend reads
    weights of its own (attend_weights), which the first layer's step would not see: then its attend."""
    model = tiny_model(attn, block_size=64, cla=cla)
    step = decode.registered_step(model.blocks[0].attn)
    compared = []

    def checked(name, fast, plain):
        def both(*args):
            got = fast(*args)
            torch.testing.assert_close(got, plain(*args), atol=1e-5, rtol=1e-5)
            compared.append(name)
            return got
        return both

    if step is not None:
        whole = checked("step", step, decode.reference_step)
        monkeypatch.setattr(decode, "registered_step", lambda attn: whole)
        for name in [name.removesuffix("_reference") for name in vars(decode) if name.endswith("_reference")]:
            monkeypatch.setattr(decode, name, checked(name, getattr(decode, name),
                                                      getattr(decode, name + "_reference")))
    idx = torch.randint(0, TINY.vocab_size, (2, 40))
    with torch.no_grad():
        exact_steps(model, idx, 8)
    readers = TINY.n_layer - TINY.n_layer // cla  # the layers that read another's keys
    stepping = TINY.n_layer - (readers if getattr(model.blocks[0].attn, "attend_weights", ()) else 0)
    assert compared.count("step") == (0 if step is None else 32 * stepping), \
        f"--attn={attn}: its registered step ran {compared.count('step')} times in 32 steps of 2 layers"


@pytest.mark.parametrize("cla", [1, 2])
@pytest.mark.parametrize("attn", VARIANTS)
def test_exact_steps_give_the_plain_steps_logits(attn, cla):
    """Over 64 positions in fp32 (test_model.py checks the plain steps against a chunk and the full
    forward), and against the full forward in bf16 with small keys."""
    model = tiny_model(attn, block_size=64, cla=cla)
    idx = torch.randint(0, TINY.vocab_size, (2, 64))
    with torch.no_grad():
        assert (exact_steps(model, idx, 8) - token_by_token(model, idx, 8)).abs().max() < 1e-5
        model = small_key_model(attn, cla=cla)
        full, stepped = model(idx[:, :24])[0][:, 8:], exact_steps(model, idx[:, :24], 8, torch.bfloat16)
    assert (stepped - full).norm() / full.norm() < 2e-2


@pytest.mark.parametrize("attn", VARIANTS)
def test_single_token_steps_build_keys_of_their_own_token_only(attn, monkeypatch):
    """A single-token step builds its own token's per-head keys and no cached position's: those
    that MHA, GQA and MQA cache, and those LRKV and MLA build for the key RMS that they cache, where
    a cached position's are never built (LRKV's R_h^K (B_h^K)^T, MLA's c W_up,h^K, which the query
    absorbs)."""
    model = tiny_model(attn, block_size=64)
    positions = []
    for block in model.blocks:
        owner, name, count = REFERENCES[attn].key_builder(block.attn)

        def spied(*args, build=getattr(owner, name), count=count):
            if count(*args) is not None:
                positions.append(count(*args))
            return build(*args)
        monkeypatch.setattr(owner, name, spied)
    idx = torch.randint(0, TINY.vocab_size, (2, 64))
    with torch.no_grad():
        cache = model.new_cache(2, 64, dtype=torch.float32, cache_class=RingKVCache)
        model(idx[:, :8], cache=cache)
        positions.clear()
        for t in range(8, 64):
            cache = exact_step(model, idx[:, t:t + 1], cache)[1]
    assert positions == [1] * 56 * TINY.n_layer, f"--attn={attn} built keys of {positions[:4]}... positions"


@pytest.mark.parametrize("attn", VARIANTS)
def test_greedy_generation_through_exact_steps_is_the_uncached_argmax_loop(attn):
    """generate(step=exact_step) gives the greedy tokens of a full forward per token, the context
    cropped as GPT.generate documents, over more than twice block_size. In float64: no near-tie
    between two logits can make a token differ."""
    model = tiny_model(attn).double()
    prompt = torch.randint(0, TINY.vocab_size, (2, 5))
    n = 2 * TINY.block_size + 20
    expected = cropped_greedy(model, prompt, n)
    assert torch.equal(generate(model, prompt, n, temperature=0, step=exact_step), expected)
    shared = tiny_model(attn, cla=2).double()  # CLA: the second layer reads the first's cache
    expected = cropped_greedy(shared, prompt, n)
    assert torch.equal(generate(shared, prompt, n, temperature=0, step=exact_step), expected)


def test_a_subclass_inherits_its_parents_step_unless_it_registers_its_own_or_attends_otherwise(monkeypatch):
    """A subclass that attends or rebuilds keys its own way computes what its parent's step does not:
    it decodes through its own attend (no step) until it registers a step of its own."""
    class Inheriting(LowRankKVAttention):
        pass

    class Plain(LowRankKVAttention):
        pass

    class OwnAttend(LowRankKVAttention):
        def attend(self, q, k, v, mask=None):
            return super().attend(2 * q, k, v, mask)

    class OwnKeys(LowRankKVAttention):
        def cached_keys_values(self, rope, **cached):
            return super().cached_keys_values(rope, **cached)

    monkeypatch.setitem(decode.STEPS, Plain, None)
    config = TINY.__class__(**{**vars(TINY), "attn": "lrkv"})
    assert decode.registered_step(Inheriting(config, 0)) is decode.lrkv_step
    assert decode.registered_step(Plain(config, 0)) is None
    assert decode.registered_step(OwnAttend(config, 0)) is None
    assert decode.registered_step(OwnKeys(config, 0)) is None
    monkeypatch.setitem(decode.STEPS, OwnAttend, decode.lrkv_step)
    assert decode.registered_step(OwnAttend(config, 0)) is decode.lrkv_step


@pytest.mark.parametrize("cla", [1, 2])
@pytest.mark.parametrize("attn", VARIANTS)
def test_fixed_shape_steps_equal_the_full_forward(attn, cla):
    """Every step attends over the whole max_len cache, the positions not yet written masked."""
    model = tiny_model(attn, cla=cla)
    idx = torch.randint(0, TINY.vocab_size, (2, 24))
    with torch.no_grad():
        full = model(idx)[0]
        stepped = fixed_steps(model, idx, 6, decode.last_logits)
    assert (stepped - full[:, 6:]).abs().max() < 1e-4


@pytest.mark.parametrize("attn", VARIANTS)
def test_the_fixed_shape_step_is_one_graph_at_every_position(attn):
    """Captured whole (fullgraph) and never recompiled as the position moves: the step that
    compiled_step compiles, traced here by dynamo without inductor's code generation."""
    model = tiny_model(attn)
    idx = torch.randint(0, TINY.vocab_size, (2, 24))
    torch._dynamo.reset()
    traced = torch.compile(decode.last_logits, backend="aot_eager", fullgraph=True)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(fixed_steps(model, idx, 6, traced), fixed_steps(model, idx, 6, decode.last_logits))
        fixed_steps(model, idx, 9, traced)  # a new cache, another starting position: the same graph


def test_fixed_shape_decoding_past_the_cache_is_one_line(monkeypatch):
    """The fixed-shape cache counts its free positions on the host: the step after the last one is
    refused before it runs (eager steps here: the check is compiled_decode's, outside the graph)."""
    monkeypatch.setattr(decode, "compiled_step", decode.last_logits)
    model = tiny_model("mha")
    token = torch.randint(0, TINY.vocab_size, (1, 1))
    cache = model.new_cache(1, 8, cache_class=RingKVCache)
    with torch.no_grad():
        model(token.repeat(1, 6), cache=cache)
        for _ in range(2):
            _, cache = compiled_decode(model, token, cache)
        with pytest.raises(ValueError, match="^KV cache holds 8 tokens, 9 were asked for$"):
            compiled_decode(model, token, cache)


@pytest.mark.parametrize("attn", ["mha", "lrkv"])
def test_compiled_generation_is_eager_generation(attn):
    """generate(step=compiled_decode), inductor's code and all, gives eager's greedy tokens, past
    the context too, where each new start's cache is fixed again and reuses the graph; and the
    same logits to their fp32 rounding, from the same graph (the same shapes). In float64: in fp32 two
    logits of a random model can lie closer than the two paths' rounding differences, and one
    flipped argmax changes all that follows (seen with AVX2 kernels)."""
    model = tiny_model(attn).double()
    prompt = torch.randint(0, TINY.vocab_size, (2, 5))
    n = 2 * TINY.block_size + 20
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = generate(model, prompt, n, temperature=0, step=compiled_decode)
        assert torch.equal(compiled, generate(model, prompt, n, temperature=0))
        idx = torch.randint(0, TINY.vocab_size, (2, TINY.block_size))
        with torch.no_grad():
            compiled = fixed_steps(model, idx, 26, compiled_step)
            eager = fixed_steps(model, idx, 26, decode.last_logits)
    assert (compiled - eager).abs().max() < 1e-6
