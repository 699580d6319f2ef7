"""Tests of fast_decode.py: the fixed-shape single-token step gives the eager step's logits, is
one graph at every position, and compiled by inductor gives eager's tokens through GPT.stream's
step, past the model's context too."""

import pytest
import torch

from fast_decode import compiled_decode, compiled_step, fix, fixed_step
from model import ATTENTION
from test_model import TINY, tiny_model


def fixed_steps(model, idx, prefix, step):
    """idx's logits from position prefix on: a prompt of prefix tokens, then each token through
    step(model, token, caches) on fixed-shape caches, advancing their shared position."""
    caches = model.new_caches(idx.size(0), idx.size(1), dtype=torch.float32)
    model(idx[:, :prefix], caches=caches)
    caches = fix(caches)
    logits = []
    for t in range(prefix, idx.size(1)):
        logits.append(step(model, idx[:, t:t + 1], caches))
        caches[0].pos += 1
    return torch.stack(logits, dim=1)


@pytest.mark.parametrize("attn", ATTENTION)
def test_fixed_shape_steps_equal_the_full_forward(attn):
    """Every step attends over the whole max_len cache, the positions not yet written masked."""
    model = tiny_model(attn)
    idx = torch.randint(0, TINY.vocab_size, (2, 24))
    with torch.no_grad():
        full = model(idx)[0]
        stepped = fixed_steps(model, idx, 6, fixed_step)
    assert (stepped - full[:, 6:]).abs().max() < 1e-4


@pytest.mark.parametrize("attn", ATTENTION)
def test_the_fixed_shape_step_is_one_graph_at_every_position(attn):
    """Captured whole (fullgraph) and never recompiled as the position moves: the step that
    compiled_step compiles, traced here by dynamo without inductor's code generation."""
    model = tiny_model(attn)
    idx = torch.randint(0, TINY.vocab_size, (2, 24))
    torch._dynamo.reset()
    traced = torch.compile(fixed_step, backend="aot_eager", fullgraph=True)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(fixed_steps(model, idx, 6, traced), fixed_steps(model, idx, 6, fixed_step))
        fixed_steps(model, idx, 9, traced)  # new caches, another starting position: the same graph


@pytest.mark.parametrize("attn", ["mha", "lrkv"])
def test_compiled_generation_is_eager_generation(attn):
    """generate(step=compiled_decode), inductor's code and all, gives eager's greedy tokens, past
    the context too, where each new start's caches are fixed again and reuse the graph; and the
    same logits to fp32 rounding. The tokens in float64: in fp32 two logits of a random model can
    lie closer than the two paths' rounding differences, and one flipped argmax changes all
    that follows (seen with AVX2 kernels)."""
    model = tiny_model(attn).double()
    prompt = torch.randint(0, TINY.vocab_size, (2, 5))
    n = 2 * TINY.block_size + 20
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = model.generate(prompt, n, temperature=0, step=compiled_decode)
    assert torch.equal(compiled, model.generate(prompt, n, temperature=0))
    model = model.float()
    idx = torch.randint(0, TINY.vocab_size, (2, 24))
    with torch.no_grad():
        compiled, eager = fixed_steps(model, idx, 6, compiled_step), fixed_steps(model, idx, 6, fixed_step)
    assert (compiled - eager).abs().max() < 1e-5
