"""
The paper's training recipe, as train.py runs it and tools/bench.py and tools/plan.py measure it:
TrainConfig (every flag of train.py beside GPTConfig's), the model and optimisers a run builds (Muon
for the blocks' matrices, AdamW for the embeddings), one step's forward and backward over its
micro-batches, the optimizer step with its gradient clip, and the validation loss and bits per byte.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lib.attention.convert import CALIBRATION_TOKENS, distill_loss
from lib.training import configurator
from lib.training.configurator import SEED_LIMIT
from lib.training.hardware import PRECISION_NAMES, check_device, precision
from lib.training.muon import Muon
from lib.training.parallel import is_shard, no_sync, parallelize
from model import GPT, GPTConfig


@dataclass
class TrainConfig:
    # data and output
    data_dir: str = "data/fineweb-edu-gpt2"
    out_dir: str = ""  # where ckpt.pt and log.jsonl go; "": out/<attn>
    resume: bool = False  # continue out_dir/ckpt.pt, given the run's flags again (but JOB_FLAGS)
    overwrite: bool = False  # a fresh run into an out_dir that holds a run: start over, replacing its files
    init_from: str = ""  # a new run whose weights come from this checkpoint, attention converted to --attn
    # --init_from converts each layer's keys and values to be closest on the attention inputs that
    # the checkpoint's model sees in this many training tokens; 0: closest in the weights alone
    calibration_tokens: int = CALIBRATION_TOKENS
    # --init_from: the loss is (1 - distill) CE + distill KL(p_source || p_model) per token, p_source
    # the next-token distribution of the checkpoint's model, frozen; 0: CE alone. Each step costs a
    # forward pass more (1.3x on the demo's CPU): at equal time 0.5 with 46 steps beat CE with 60
    # in docs/convert.md.
    distill: float = 0.0
    # batch and budget: the paper's 16 sequences of 2048 tokens, 32,768 tokens a step
    batch_size: int = 16  # sequences per optimizer step, over all devices together
    micro_batch_size: int = 16  # most sequences a device holds at once; gradient accumulation fills the step
    max_steps: int = 3_051_758  # the token budget: the paper's 100B tokens / 32,768 tokens a step
    # stop after this step, checkpointed, on max_steps' schedule, for --resume to go on; 0: don't
    stop_after: int = 0
    # optimisation
    # muon: Muon for the blocks' matrices, AdamW for wte and lm_head; adamw: AdamW for all
    optimizer: str = "muon"
    muon_lr: float = 0.02
    adamw_lr: float = 0.003  # the blocks' matrices under --optimizer=adamw, their vectors always; not tuned
    embedding_lr: float = 0.2  # AdamW, wte
    unembedding_lr: float = 0.004  # AdamW, lm_head
    weight_decay: float = 0.1  # decoupled, every parameter in both optimizers
    grad_clip: float = 1.0  # largest global gradient norm; 0: no clipping
    warmup_steps: int = 2000
    # evaluation and logging
    eval_interval: int = 5000  # steps between evaluations (and checkpoints); the last step always gets one
    # the fixed validation slice, in whole block_size windows from the start of the val split
    eval_tokens: int = 2**21
    log_interval: int = 100
    # downstream tasks scored at every evaluation into log.jsonl, as OLMo scores its in-loop ones: eval.py's
    # short names, comma-separated (lib/evaluation/downstream.py), each on its first eval_tasks_limit
    # documents (0: all)
    eval_tasks: str = ""
    eval_tasks_limit: int = 0
    # system
    seed: int = 0
    device: str = "auto"  # auto: cuda, then mps, then cpu
    dtype: str = "auto"  # bfloat16 (autocast) or float32; auto: hardware.precision's for training here
    ns_dtype: str = "auto"  # Muon's Newton-Schulz: bfloat16 or float32; auto: hardware.precision's
    compile: bool | None = None  # torch.compile; None: on CUDA only
    # under torchrun, shard weights, gradients and optimizer states over the processes (FSDP2)
    fsdp: bool = False
    # keep each block's input only and recompute the block in the backward
    checkpoint_activations: bool = False

    def __post_init__(self):
        def bad(field, allowed):
            raise ValueError(f"--{field}={getattr(self, field)!r}: must be {allowed}")

        for field in ("batch_size", "micro_batch_size", "max_steps", "eval_interval", "eval_tokens",
                      "log_interval"):
            if getattr(self, field) < 1:
                bad(field, "a positive integer")
        for field in ("stop_after", "eval_tasks_limit", "calibration_tokens", "warmup_steps", "muon_lr",
                      "adamw_lr", "embedding_lr", "unembedding_lr", "weight_decay", "grad_clip"):
            if not getattr(self, field) >= 0:  # `not >=` also refuses nan
                bad(field, "zero or more")
        if not 0 <= self.seed < SEED_LIMIT:
            bad("seed", "between 0 and 2**64 - 1")
        check_device(self.device)
        for field, allowed in (("optimizer", ("muon", "adamw")), ("dtype", ("auto", "bfloat16", "float32")),
                               ("ns_dtype", ("auto", "bfloat16", "float32"))):
            if getattr(self, field) not in allowed:
                bad(field, "one of " + ", ".join(allowed))
        if not 0 <= self.distill <= 1:
            bad("distill", "between 0 and 1")
        if self.distill and not self.init_from:
            bad("distill", "0 without --init_from, whose model it distils")


def parse_args(argv):
    """(GPTConfig, TrainConfig) from the defaults, then preset files in order, then --name=value flags."""
    model_config, cfg = configurator.parse(argv, GPTConfig, TrainConfig)
    cfg.out_dir = cfg.out_dir or f"out/{model_config.attn}"
    return model_config, cfg



def flops_per_token(model, seq_len=None):
    """Training FLOPs a token, MFU's count: 6 per matmul weight (not the embedding's, a lookup), and 6 per
    multiply-add of attention's q k^T and a v over seq_len keys (the block size by default; all of them,
    not causal half), d_qk + d_h per head and key, or a variant's own attention_macs(seq_len) where its
    heads attend more than once (MLRA's latent heads)."""
    T = seq_len or model.config.block_size
    attns = [block.attn for block in model.blocks]
    macs = [attn.attention_macs(T) if hasattr(attn, "attention_macs") else
            attn.n_head * (attn.qk_dim + attn.head_dim) * T for attn in attns]
    return 6 * (model.get_num_params() - model.wte.weight.numel()) + 6 * sum(macs)


def build(model_config, cfg, device, world_size, dtype, compile, initial=None):
    """What a run trains, before a checkpoint is restored into it: (raw_model, model, train_model,
    optimizers), raw_model the GPT (its weights from initial, a state_dict, if given), model what
    evaluates and train_model what trains (parallel.parallelize)."""
    # every rank draws the whole model, so that a sharded run starts where one process would
    raw_model = GPT(model_config).to(device)
    if initial is not None:
        raw_model.load_state_dict(initial)
    model, train_model = parallelize(raw_model, device, world_size, dtype, compile, cfg.fsdp,
                                     cfg.checkpoint_activations)
    return raw_model, model, train_model, configure_optimizers(raw_model, cfg)


def configure_optimizers(model, cfg, ns_dtype=None):
    """The paper's optimisers: Muon for every matrix inside the blocks, AdamW with their own lrs for
    the token embedding and the unembedding, and at adamw_lr for any other parameter of the blocks (a
    variant's vector or scalar: Muon orthogonalises matrices only); --optimizer=adamw moves the blocks'
    matrices to AdamW at adamw_lr too. The paper's AdamW lrs are kept as they are: nanochat's
    (n_embd / 768) ** -0.5 scaling of them is 1 at the 128M width, and the paper does not say it
    applies it elsewhere.
    Each param group's initial_lr is the peak that the schedule scales; Muon's Newton-Schulz runs in
    ns_dtype (a torch.dtype) if given, else in cfg.ns_dtype."""
    blocks = list(model.blocks.parameters())
    if len(blocks) + 2 != len(list(model.parameters())):
        raise ValueError("GPT has parameters outside wte, lm_head and the blocks: configure_optimizers "
                         "misses them")
    matrices, others = [p for p in blocks if p.ndim == 2], [p for p in blocks if p.ndim != 2]
    adamw_groups = [dict(params=[model.wte.weight], lr=cfg.embedding_lr),
                    dict(params=[model.lm_head.weight], lr=cfg.unembedding_lr)]
    if others:
        adamw_groups.append(dict(params=others, lr=cfg.adamw_lr))
    adamw = dict(betas=(0.9, 0.95), weight_decay=cfg.weight_decay, fused=model.wte.weight.is_cuda)
    if cfg.optimizer == "adamw":
        optimizers = [torch.optim.AdamW([dict(params=matrices, lr=cfg.adamw_lr), *adamw_groups], **adamw)]
    else:
        # Muon scales the orthogonalised update by sqrt(max(1, rows / cols)), Keller Jordan's
        # adjustment (torch.optim.Muon's adjust_lr_fn="original"), so lr 0.02 moves a square matrix
        # by 0.02 times an orthogonal matrix, the convention of modded-nanogpt and nanochat that
        # the paper's 0.02 comes from. Weight decay multiplies each matrix by 1 - lr * weight_decay
        # a step, with the unadjusted lr.
        if ns_dtype is None and cfg.ns_dtype != "auto":
            ns_dtype = getattr(torch, cfg.ns_dtype)
        muon = Muon(matrices, lr=cfg.muon_lr, weight_decay=cfg.weight_decay, ns_dtype=ns_dtype)
        optimizers = [muon, torch.optim.AdamW(adamw_groups, **adamw)]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers


def optimizer_step(model, optimizers, cfg):
    """Clip the global gradient norm to grad_clip (0: no clip), step every optimizer and clear the
    gradients. Returns the norm before the clip, a 0-dim tensor, the same on every rank."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if is_shard(norm):  # FSDP: each rank's norm is of its shards; their sum, once, for every rank
        norm = norm.full_tensor()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grads_with_norm_(params, cfg.grad_clip, norm)
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norm


def backward(train_model, x, y, micro_batch, autocast, device, teacher=None, distill=0.0):
    """Forward and backward over x, y (this rank's share of a step) in micro-batches, accumulating
    the gradients of their mean loss (distill_loss's with a teacher); that loss, detached."""
    accum_steps = len(x) // micro_batch
    loss = torch.zeros((), device=device)
    for i in range(accum_steps):
        micro = slice(i * micro_batch, (i + 1) * micro_batch)
        with no_sync(train_model, last=i == accum_steps - 1):
            with autocast:
                logits, micro_loss = train_model(x[micro].to(device), y[micro].to(device))
                if teacher is not None:
                    micro_loss = distill_loss(micro_loss, logits, teacher, x[micro].to(device), distill)
                del logits  # freed before the backward, which does not need them
            (micro_loss / accum_steps).backward()
        loss += micro_loss.detach() / accum_steps
    return loss


def run_dtype(cfg, device):
    """The run's --dtype, "bfloat16" (autocast) or "float32"; auto: the precision policy's for training."""
    return cfg.dtype if cfg.dtype != "auto" else str(precision("train", device)[0]).removeprefix("torch.")


def precision_line(cfg, device, dtype, ns_dtype):
    """What the run computes in and why: for each use, the policy's reason, or the flag that set it."""
    uses = [("bf16 autocast" if dtype == "bfloat16" else "fp32", "train", cfg.dtype, "--dtype")]
    if ns_dtype is not None:
        ns = f"Newton-Schulz in {PRECISION_NAMES[ns_dtype]}"
        uses.append((ns, "newton_schulz", cfg.ns_dtype, "--ns_dtype"))
    return ", ".join(f"{what} ({precision(use, device)[1] if value == 'auto' else flag})"
                     for what, use, value, flag in uses)


@torch.no_grad()
def evaluate(model, val_tokens, bytes_per_token, block_size, batch_size, autocast, rank, world_size):
    """(mean cross-entropy in nats per token, bits per byte) on the fixed validation slice: its
    consecutive block_size windows, shared out among the ranks. BPB is the summed nats over the
    summed UTF-8 bytes of the target tokens, times 1 / ln 2, with the zero-byte end-of-text token
    left out of both sums, so that it compares across tokenizers."""
    device = bytes_per_token.device
    windows = val_tokens.unfold(0, block_size + 1, block_size)
    totals = torch.zeros(3, dtype=torch.float64)  # nats, nats of byte-carrying targets, bytes
    mine = windows[rank::world_size]
    for i in range(0, len(mine), batch_size):
        batch = mine[i:i + batch_size].to(device)
        with autocast:
            logits, _ = model(batch[:, :-1])
        targets = batch[:, 1:].flatten()
        nats = F.cross_entropy(logits.flatten(0, 1), targets, reduction="none")
        nbytes = bytes_per_token[targets]
        totals += torch.stack([nats.sum(), (nats * (nbytes > 0)).sum(), nbytes.sum()]).cpu().double()
    if world_size > 1:
        totals = totals.to(device)
        dist.all_reduce(totals)
        totals = totals.cpu()
    nats, byte_nats, nbytes = totals.tolist()
    return nats / (len(windows) * block_size), byte_nats / (math.log(2) * nbytes)
