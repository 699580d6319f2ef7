"""
A new run from a trained model (train.py --init_from): its weights converted to another attention
variant, calibrated on the inputs its attention sees, and optionally distilled from it.

Every layer converts in two steps: the source's H per-head key and value projections, (W_K, W_V) =
heads.head_kv_weights(attn) (lib/attention/heads.py; a variant without per-head projections, MLA, is
refused in one line), and LOAD_HEAD_KV_WEIGHTS[cls](attn, W_K, W_V, C), registered here by the target's
class itself, which builds its keys and values closest to them; a variant without one is refused in one
line. A subclass registers its own (its parent's, where that is right for it): one with another attention
rule would otherwise be built by its parent's conversion, silently wrong. Everything else carries over as
it is: embeddings, queries, output projections and MLPs. docs/convert.md has the results.
"""

from pathlib import Path

import torch
import torch.nn.functional as F

from lib.training.checkpoint import load_checkpoint
from lib.training.configurator import ConfigError
from lib.attention.heads import head_kv_weights
from lib.attention.layout import key_layers
from model import (GPT, GroupedQueryAttention, LowRankKVAttention, MultiHeadAttention,
                   MultiHeadLatentAttention, MultiQueryAttention)

# train.py --init_from's default calibration (its --calibration_tokens), which analyze.py's
# rank_energy.png sees the heads through too: 65,536 tokens are 32 of the paper's 2048-token
# sequences, ~85 tokens a dimension of the 128M model's 768-wide input (SVD-LLM calibrates
# Llama-7B's 4096 on 256 x 2048, ~128), for one forward pass over two of its training steps' tokens.
CALIBRATION_TOKENS = 65_536


def load_head_kv_weights(attn, name, W_K, W_V, C=None):
    """Set attn's key and value parameters from H per-head projections (head_kv_weights' layout),
    as close to them as the variant can be. C: None, or the (d, d) covariance E[x x^T] of the
    inputs x this layer's attention sees (uncentred: the projections have no bias), which makes
    "close" mean close on those inputs: an error E of a head's projection costs
    E||E x||^2 = ||E C^(1/2)||_F^2 there. A variant uses C where it changes its answer."""
    load = LOAD_HEAD_KV_WEIGHTS.get(type(attn))  # the class's own: never a parent's
    if load is None:
        raise ValueError(f"--attn={name} cannot be built from per-head key and value projections")
    load(attn, W_K, W_V, C)


# GQA, MHA and MQA

def load_grouped_head_kv_weights(attn, W_K, W_V, C=None):
    """Each key/value head is the mean of its group's H/G heads, as Ainslie et al. (2023)
    convert MHA to GQA; with G = H that is the identity. C changes nothing: for any C the
    mean W of a group's heads W_h minimises sum_h ||(W_h - M) C^(1/2)||_F^2, which is
    sum_h ||(W_h - W) C^(1/2)||_F^2 + (H/G) ||(W - M) C^(1/2)||_F^2 (the cross term holds
    sum_h (W_h - W) = 0)."""
    G, d_h = attn.n_kv_head, attn.head_dim
    for W, heads in ((attn.W_k, W_K), (attn.W_v, W_V)):
        W.weight.copy_(heads.view(G, -1, d_h, heads.size(-1)).mean(1).flatten(0, 1))


# LRKV

def load_lrkv_head_kv_weights(attn, W_K, W_V, C=None):
    """W_shared = the heads' mean, U_h B_h^T = the rank-r truncated SVD of W_h - W_shared, or
    with C its whitened truncated SVD, the closest on the inputs (shared_plus_low_rank), for
    keys and values alike. With r = d_h it is every head exactly, with or without C. The mean
    stays the shared part with C too: it is the optimal single projection in the norm of any C
    (load_grouped_head_kv_weights), and the residuals take what it misses."""
    load_lrkv_head_weights(attn, W_K, attn.W_shared_k, attn.U_k, attn.B_k, C)
    load_lrkv_head_weights(attn, W_V, attn.W_shared_v, attn.U_v, attn.B_v, C)


def load_lrkv_head_weights(attn, heads, W_shared, U, factor, C):
    """One half of load_lrkv_head_kv_weights, heads (H, d_h, d) in nn.Linear's layout."""
    C = None if C is None else C.to(heads.device, torch.float64)
    mean, B_h, U_t, _ = shared_plus_low_rank(heads.double(), attn.lrkv_rank, C)
    W_shared.weight.copy_(mean)
    U.weight.copy_(U_t.flatten(0, 1))
    factor.copy_(B_h.flatten(0, 1))


def shared_plus_low_rank(W, r, C=None):
    """H per-head projections as W_h = W_shared + U_h B_h^T, all in nn.Linear's layout: W (H, d_h, d)
    holds the W_h^T; returns W_shared^T (d_h, d), their mean, and each head's rank-r residual as
    B (H, d_h, r) and U^T (H, r, d), B_h U_h^T the closest to its deviation D_h = W_h^T - W_shared^T
    in one of two norms; also the singular values S (H, d_h) of the D_h in that norm, largest first.
    - Without C, Frobenius: the residual is the truncated SVD of D_h (Eckart-Young).
    - With C, the (d, d) covariance E[x x^T] of the heads' inputs, the error on those inputs,
      E||(D_h - B_h U_h^T) x||^2 = ||(D_h - B_h U_h^T) C^(1/2)||_F^2: the residual is the truncated SVD
      P_r S_r Q_r^T of D_h C^(1/2) mapped back by C^(-1/2) (whitened, as SVD-LLM, Palu and CARE
      compress k_proj and v_proj), and it misses by the singular values of D_h C^(1/2) it drops.
    Both are P_r P_r^T D_h, P_r the top r left singular vectors of D_h as the norm sees it
    (P_r S_r Q_r^T C^(-1/2) = P_r P_r^T D_h C^(1/2) C^(-1/2)), which needs no inverse of C. A
    singular C, with directions the inputs never take, has none; along such a direction every
    residual is as good as another on the inputs, and P_r P_r^T D_h is the one closest to D_h (it
    keeps D_h's part in the r output directions kept), so r = d_h stays exact, where a
    pseudo-inverse would drop that part and an eigenvalue floor would change the answer.
    Each singular value of the residual is split evenly, sqrt into both factors: their product
    does not care, and balanced factors have equal norms, so an optimiser that uptrains them
    moves each by the same share of itself."""
    mean = W.mean(0)
    D = W - mean  # (H, d_h, d)
    if C is not None:
        eigenvalues, V = torch.linalg.eigh(C)
        # a dead direction's eigenvalue 0 comes out of eigh as +-rounding: sqrt needs it >= 0
        seen = D @ (V * eigenvalues.clamp(min=0).sqrt() @ V.mT)  # (H, d_h, d): D_h C^(1/2)
    P, S, _ = torch.linalg.svd(D if C is None else seen, full_matrices=False)  # (H, d_h, d_h), (H, d_h)
    P_r = P[..., :r]
    # P_r^T D_h = Y sigma Z^T: (H, r, r), (H, r), (H, r, d)
    Y, sigma, Zt = torch.linalg.svd(P_r.mT @ D, full_matrices=False)
    root = sigma.sqrt()
    return mean, P_r @ Y * root[:, None, :], root[..., None] * Zt, S


def refuse_mla(attn, W_K, W_V, C=None):
    # MHA2MLA (Ji et al., 2025) first uptrains the source with RoPE on a few frequencies only
    raise ValueError("MLA is not converted to: its keys' d_h position-free dims need keys that RoPE "
                     "leaves alone, and per-head keys rotate every dim (docs/convert.md)")


# Each target variant's conversion, by its very class (MHA and MQA are GQA's with G = H and 1); MLA's is
# a refusal that says why
LOAD_HEAD_KV_WEIGHTS = {GroupedQueryAttention: load_grouped_head_kv_weights,
                        MultiHeadAttention: load_grouped_head_kv_weights,
                        MultiQueryAttention: load_grouped_head_kv_weights,
                        LowRankKVAttention: load_lrkv_head_kv_weights, MultiHeadLatentAttention: refuse_mla}


@torch.no_grad()
def convert(model, source, covariances=None):
    """Give model a trained GPT's weights: the embeddings, queries, output projections and MLPs as
    they are, and each layer's keys and values through the variants' conversion. covariances:
    None (the weights alone), or per layer the (d, d) covariance of the inputs source's attention
    sees there (attention_input_covariances). A model of the same variant and shapes is copied
    whole. Width, heads, head dim, layers, vocabulary and the CLA groups must agree: nothing else can
    carry over, and a layer that shares its group's keys has none of its own to convert to or from."""
    for field in ("n_embd", "n_head", "head_dim", "n_layer", "vocab_size", "cla"):
        if getattr(model.config, field) != getattr(source.config, field):
            why = ("a layer that shares its CLA group's keys and values has none of its own to convert"
                   if field == "cla" else "only the attention's keys and values convert")
            raise ValueError(f"the checkpoint has {field} = {getattr(source.config, field)}, this model "
                             f"{getattr(model.config, field)}: {why}")
    ours, theirs = model.state_dict(), source.state_dict()
    if model.config.attn == source.config.attn and all(ours[k].shape == theirs[k].shape for k in ours):
        model.load_state_dict(theirs)
        return
    covariances = covariances or [None] * len(model.blocks)
    for layer in key_layers(model):
        weights = head_kv_weights(source.blocks[layer].attn)
        load_head_kv_weights(model.blocks[layer].attn, model.config.attn, *weights, covariances[layer])
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
