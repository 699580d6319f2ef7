"""
A new run from a trained model (train.py --init_from): its weights converted to another attention
variant, calibrated on the inputs its attention sees, and optionally distilled from it.

Every layer converts through the two methods a variant defines after its math (model.py):
head_kv_weights, the source's H per-head key and value projections, and load_head_kv_weights,
which builds the target's keys and values closest to them. Everything else carries over as it is:
embeddings, queries, output projections and MLPs. docs/convert.md has the results.
"""

from pathlib import Path

import torch
import torch.nn.functional as F

from checkpoint import load_checkpoint
from configurator import ConfigError
from model import GPT

# train.py --init_from's default calibration (its --calibration_tokens), which analyze.py's
# rank_energy.png sees the heads through too: 65,536 tokens are 32 of the paper's 2048-token
# sequences, ~85 tokens a dimension of the 128M model's 768-wide input (SVD-LLM calibrates
# Llama-7B's 4096 on 256 x 2048, ~128), for one forward pass over two of its training steps' tokens.
CALIBRATION_TOKENS = 65_536


def head_kv_weights(attn, name):
    """attn's per-head projections (W_K, W_V), each (H, d_h, d) in nn.Linear's layout: head h's key
    is x @ W_K[h].T before the QK norm and RoPE, its value x @ W_V[h].T. name: its --attn."""
    if not hasattr(attn, "head_kv_weights"):
        raise ValueError(f"--attn={name} gives no per-head key and value projections to convert from")
    return attn.head_kv_weights()


def load_head_kv_weights(attn, name, W_K, W_V, C=None):
    """Set attn's key and value parameters from H per-head projections (head_kv_weights' layout),
    as close to them as the variant can be. C: None, or the (d, d) covariance E[x x^T] of the
    inputs x this layer's attention sees (uncentred: the projections have no bias), which makes
    "close" mean close on those inputs: an error E of a head's projection costs
    E||E x||^2 = ||E C^(1/2)||_F^2 there. A variant uses C where it changes its answer."""
    if not hasattr(attn, "load_head_kv_weights"):
        raise ValueError(f"--attn={name} cannot be built from per-head key and value projections")
    attn.load_head_kv_weights(W_K, W_V, C)


@torch.no_grad()
def convert(model, source, covariances=None):
    """Give model a trained GPT's weights: the embeddings, queries, output projections and MLPs as
    they are, and each layer's keys and values through the variants' conversion. covariances:
    None (the weights alone), or per layer the (d, d) covariance of the inputs source's attention
    sees there (attention_input_covariances). A model of the same variant and shapes is copied
    whole. Width, heads, head dim, layers and vocabulary must agree: nothing else can carry over."""
    for field in ("n_embd", "n_head", "head_dim", "n_layer", "vocab_size"):
        if getattr(model.config, field) != getattr(source.config, field):
            raise ValueError(f"the checkpoint has {field} = {getattr(source.config, field)}, this model "
                             f"{getattr(model.config, field)}: only the attention's keys and values convert")
    ours, theirs = model.state_dict(), source.state_dict()
    if model.config.attn == source.config.attn and all(ours[k].shape == theirs[k].shape for k in ours):
        model.load_state_dict(theirs)
        return
    covariances = covariances or [None] * len(model.blocks)
    for block, source_block, C in zip(model.blocks, source.blocks, covariances):
        heads = head_kv_weights(source_block.attn, source.config.attn)
        load_head_kv_weights(block.attn, model.config.attn, *heads, C)
    kept = ("wte.", "lm_head.", ".mlp.", ".attn.W_q.", ".attn.W_o.")
    model.load_state_dict({k: v for k, v in theirs.items() if any(part in f".{k}" for part in kept)},
                          strict=False)


def load_init_checkpoint(cfg, model_config, batches, device):
    """The state_dict of the model the flags describe, made from the --init_from checkpoint's
    weights: copied where the variant and every shape agree, else converted (convert), each layer
    weighed by its attention inputs in --calibration_tokens tokens of batches (0: the weights
    alone), which the checkpoint's model reads on device."""
    path = Path(cfg.init_from)
    if path.exists() and path.resolve() == (Path(cfg.out_dir) / "ckpt.pt").resolve():
        raise ConfigError(f"--init_from={path} is this run's own checkpoint, which the run would overwrite: "
                          "give the run its own --out_dir")
    _, source = load_checkpoint(path, device if cfg.calibration_tokens else "meta")
    model = GPT(model_config)
    try:
        covariances = None
        if cfg.calibration_tokens:
            covariances = attention_input_covariances(source, batches, cfg.calibration_tokens, cfg.seed,
                                                      cfg.micro_batch_size, device)
        convert(model, source, covariances)
    except ValueError as e:
        raise ConfigError(f"--init_from={path}: {e}") from None
    return model.state_dict()


@torch.no_grad()
def attention_input_covariances(model, batches, n_tokens, seed, batch_size, device):
    """Per layer, C = X^T X / N (d, d) in float64 for the N inputs X (N, d) that model's attention
    sees there (norm(x), Block.forward) when it reads n_tokens training tokens: whole windows,
    drawn as step 0 of a run with seed draws its batch (TrainBatches), batch_size at a time on
    device. Uncentred, as the key and value projections have no bias: an error E of one costs
    E||E x||^2 = ||E C^(1/2)||_F^2 on these inputs, what the conversion minimises."""
    T = min(batches.block_size, model.config.block_size)  # the model may have been trained on shorter windows
    windows = batches.get(seed, 0, -(-n_tokens // T), 0, 1)[0][:, :T]
    sums = [torch.zeros(model.config.n_embd, model.config.n_embd, dtype=torch.float64) for _ in model.blocks]

    def record(layer):
        def hook(attn, args):
            x = args[0].flatten(0, 1).float()  # (B T, d)
            sums[layer] += (x.T @ x).cpu().double()
        return hook

    hooks = [block.attn.register_forward_pre_hook(record(i)) for i, block in enumerate(model.blocks)]
    try:
        for chunk in windows.split(batch_size):
            model(chunk.to(device))
    finally:
        for hook in hooks:
            hook.remove()
    return [total / windows.numel() for total in sums]


def distill_loss(cross_entropy, logits, teacher, idx, weight):
    """(1 - weight) CE + weight KL(p_teacher || p_model), the KL a mean over the tokens, at
    temperature 1: besides the next token, the teacher's whole distribution over it as a target.
    The logged training loss is this."""
    with torch.no_grad():
        target = F.log_softmax(teacher(idx)[0], dim=-1).flatten(0, 1)
    kl = F.kl_div(F.log_softmax(logits, dim=-1).flatten(0, 1), target, log_target=True, reduction="batchmean")
    return (1 - weight) * cross_entropy + weight * kl
