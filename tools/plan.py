"""
What a train.py run needs of each GPU, and how long it takes, before any GPU is rented: under DDP
and under FSDP (train.py --fsdp), each with and without --checkpoint_activations, for every
attention variant of one configuration.

    python -m tools.plan config/6.3b.py --gpus=8 --gpu_memory_gib=141
    python -m tools.plan --sizes --attn=lrkv --gpu_memory_gib=80,141     # Table 1's four sizes, a row each
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 -m tools.plan config/demo.py \\
        --fsdp --dtype=float32 --measure

Presets and --name=value flags describe the run as they do to train.py (batch, micro-batch,
optimizer; bf16 unless --dtype=float32); --attn picks the variants (comma-separated; default all).
Memory per GPU, as eager PyTorch allocates it (DDP with --gpus=1 is one process):
- weights, gradients, optimizer states: counted from the parameters. Weights and gradients are
  fp32, and DDP adds its fp32 bucket copy of the gradients; Muon keeps 4 bytes a weight, AdamW 8.
  FSDP divides all of it by the GPUs.
- activations: the peak of the tensors that a forward and backward of the micro-batch allocate,
  found by running model.py's own forward and backward on fake tensors, which allocate nothing
  (LiveBytes), each gradient dropped as it lands; activation checkpointing's recomputation
  included. Where the blocks are all alike, three of them run and the middle one's events are
  replayed for the others (replayed_peaks): the bytes of running them all, at the cost of three.
  Autocast is CPU autocast's policy, which keeps norms in bf16 where CUDA's computes them in fp32.
- FSDP's gathered blocks: the embeddings and two blocks (the one running, the one prefetched)
  gathered whole in the run's dtype, and one block's gradients in the run's dtype and in fp32 on
  their way to the reduce-scatter.
- the optimizer step: what muon.Muon allocates for one GPU's share of the largest shape group
  (Newton-Schulz run on fake tensors, then DDP's all-gather or FSDP's all-to-alls), and AdamW's
  square roots (none where AdamW is fused, on a GPU).
The peak: weights, optimizer states and DDP's bucket copy, plus the larger of the forward and
backward (gradients, activations, gathered blocks; where a step has one micro-batch, simulated
with the gradients appearing as activations are freed) and the optimizer step (gradients and its
temporaries); under FSDP at least the whole fp32 model, which every rank builds before sharding
it. The largest micro-batch that fits divides the GPU's share of the batch, as train.py
requires. torch.compile (on CUDA by default) allocates less: docs/scaling.md compares the plan
with the H200 record and with peaks measured on a CPU.

Time: the preset's tokens x recipe.flops_per_token at an MFU, by default each variant's from the
H200 record (docs/bench/h200-train.json: 128M, one GPU, compiled), on GPUs of --peak_tflops.
Activation checkpointing adds the blocks' forward again to the same hardware throughput.

--measure trains two steps of random tokens on this machine as train.py would, the run's own
--fsdp and --checkpoint_activations, under torchrun or not, and prints each rank's peak tensor
memory beside the plan for that machine (measured_peak says how it is counted).
"""

import argparse
import collections
import dataclasses
import functools
import itertools
import json
import math
import os
import sys
import weakref
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lib.training import hardware

from lib.training import muon

from lib.training import parallel

from lib.training import recipe
from lib.training.recipe import flops_per_token
from tools.bench import variants
from lib.training.configurator import ArgumentParser, ConfigError, positive_int, run_main
from model import GPT, GPTConfig, VARIANTS

GIB = 2**30
REPO = Path(__file__).resolve().parents[1]  # the repository, above tools/
H200_RECORD = REPO / "docs/bench/h200-train.json"
SIZES = {"128M": [], "1.2B": ["config/1.2b.py"], "2.5B": ["config/2.5b.py"], "6.3B": ["config/6.3b.py"]}
MODES = {"DDP": (False, False), "DDP + AC": (False, True), "FSDP": (True, False), "FSDP + AC": (True, True)}


# ---------------------------------------------------------------------------------------------
# Counting what eager PyTorch allocates, on fake tensors

class LiveBytes(TorchDispatchMode):
    """While active, the bytes of the tensor storages that ops create and that are still alive
    (live), and their most after any op (peak). A storage is counted once however many views it
    has, and leaves the count when it is freed, on whichever thread; a DTensor counts as its
    shard; the storages of exclude, which exist already, are not counted. On fake tensors nothing
    is allocated, but every op still makes the outputs, views and saved tensors that eager
    PyTorch would, of the same shapes and dtypes. poll: count each storage at its size after every
    op rather than at its creation, for storages resized in place (FSDP frees gathered weights
    so), at a cost that grows with the storages alive."""

    def __init__(self, exclude=(), poll=False):
        super().__init__()
        self.excluded = {id(t.untyped_storage()) for t in exclude}
        self.storages = {}  # id: weakref
        self.poll = poll
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, DTensor):
                t = t.to_local()
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key not in self.storages and key not in self.excluded:
                self.storages[key] = weakref.ref(storage)
                self.made(key, storage.nbytes())
                weakref.finalize(storage, self.free, key, storage.nbytes())
        if self.poll:
            self.live = sum(storage.nbytes() for ref in list(self.storages.values())
                            if (storage := ref()) is not None)
        self.peak = max(self.peak, self.live)
        return out

    def made(self, key, nbytes):
        self.live += 0 if self.poll else nbytes

    def free(self, key, nbytes):
        del self.storages[key]
        self.live -= 0 if self.poll else nbytes


class Timeline(LiveBytes):
    """LiveBytes that also writes down, in order, what happens to the storages, each event with
    the part of the run it happens in (mark_parts): ("new", part, bytes), ("free", part, name) and
    ("grad", part, name) where a parameter's gradient lands in a storage. A storage's name is the
    part that made it and how many that part had made before."""

    def __init__(self, exclude):
        super().__init__(exclude)
        self.part, self.events, self.names, self.count = "pre", [], {}, collections.Counter()

    def made(self, key, nbytes):
        super().made(key, nbytes)
        self.names[key] = (self.part, self.count[self.part])
        self.count[self.part] += 1
        self.events.append(("new", self.part, nbytes))

    def free(self, key, nbytes):
        super().free(key, nbytes)
        self.events.append(("free", self.part, self.names.pop(key)))

    def landed(self, param):
        self.events.append(("grad", self.part, self.names[id(param.grad.untyped_storage())]))


def mark_parts(model, timeline):
    """Set timeline.part as the run goes: "pre" (the embedding), ("F", k) from block k's forward on,
    "head" from the unembedding on, to the loss and back, ("B", k) once the gradient of block k's
    output is whole, "post" once that of block 0's input is."""
    def set_part(part):
        return lambda *args: setattr(timeline, "part", part)

    def forward_pre(k, block, args):
        timeline.part = ("F", k)
        if k == 0:
            args[0].register_hook(set_part("post"))

    def forward(k, block, args, out):
        out.register_hook(set_part(("B", k)))

    for k, block in enumerate(model.blocks):
        block.register_forward_pre_hook(functools.partial(forward_pre, k))
        block.register_forward_hook(functools.partial(forward, k))
    model.lm_head.register_forward_pre_hook(set_part("head"))


@contextmanager
def default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def activation_bytes(config, micro_batch, weight_dtype, autocast, checkpointed, keep_grads=False):
    """Peak bytes that a forward and backward of micro_batch sequences allocate beyond the
    weights, with weights in weight_dtype (fp32 under DDP, gathered in the run's dtype under FSDP):
    each gradient dropped as soon as it is accumulated, or with keep_grads kept, as they pile up
    while the activations are freed."""
    return simulated_activation_bytes(dataclasses.astuple(config), micro_batch, weight_dtype, autocast,
                                      checkpointed)[keep_grads]


@functools.cache  # a plan asks for the same simulation several times
def simulated_activation_bytes(config_fields, micro_batch, weight_dtype, autocast, checkpointed):
    """(peak dropping each gradient, peak keeping them), from one run that keeps the gradients:
    replayed_peaks drops each where it lands. Where the blocks are all alike (no layers that share
    keys and values, no windows), three of them run and replayed_peaks plays the middle one for the
    others: the peaks of running them all (tests/test_fsdp.py checks), in a fraction of the time."""
    config = GPTConfig(*config_fields)
    step = micro_batch, weight_dtype, autocast, checkpointed
    if config.n_layer > 3 and config.cla == 1 and not config.yoco and config.window is None:
        three = simulated_events(dataclasses.replace(config, n_layer=3), *step)
        if peaks := replayed_peaks(three, config.n_layer):
            return peaks
    return replayed_peaks(simulated_events(config, *step), config.n_layer)


def simulated_events(config, micro_batch, weight_dtype, autocast, checkpointed):
    """A Timeline's events over a forward and backward of micro_batch sequences, on fake tensors."""
    with FakeTensorMode():
        with default_dtype(weight_dtype):
            model = GPT(config)
        if checkpointed:
            parallel.checkpoint_blocks(model)
        timeline = Timeline(exclude=[*model.parameters(), *model.buffers()])
        mark_parts(model, timeline)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(timeline.landed)
        idx = torch.zeros(micro_batch, config.block_size, dtype=torch.long)
        with timeline:
            with torch.autocast("cpu", torch.bfloat16) if autocast else nullcontext():
                loss = model(idx, idx)[1]
            loss.backward()
    return list(timeline.events)


def replayed_peaks(events, n_layer):
    """(peak dropping each gradient as it lands, peak keeping them) of a model of n_layer blocks,
    from the events of a run of its n_layer blocks or of three. Of three, block 1's forward and
    backward are played for each of blocks 1 to n_layer - 2 in turn. A storage that a block's part
    frees of one other block is that of the block as far from it (a block's backward frees the
    output of the block before); one that the head or the end frees, or a block's part frees of
    several blocks, is freed of every block that they stand for (the forward's end frees each
    layer's keys and values; under checkpointing, block 0's backward frees every block's input).
    None where the blocks do not repeat so: a storage freed that is not alive, or one freed in the
    run and not in the replay, or the other way round. The peak is the most bytes alive as a
    storage is made (LiveBytes' after each op: between, storages are only freed)."""
    runs = [(part, list(run)) for part, run in itertools.groupby(events, key=lambda event: event[1])]
    blocks = 1 + max(part[1] for part, _ in runs if isinstance(part, tuple))
    order = ["pre", *[("F", k) for k in range(blocks)], "head",
             *[("B", k) for k in reversed(range(blocks))], "post"]
    if blocks < n_layer and [part for part, _ in runs] != order:
        return None

    def stands_for(block):  # the blocks of the model that a block of the run stands for
        if blocks == n_layer or block == 0:
            return [block]
        return [n_layer - 1] if block == blocks - 1 else list(range(1, n_layer - 1))

    played = []  # (part of the run, part of the model, the run's events)
    for part, run in runs:
        if isinstance(part, str):
            played.append((part, part, run))
        else:
            ks = stands_for(part[1])
            played += [(part, (part[0], k), run) for k in (ks if part[0] == "F" else reversed(ks))]

    frees_of = collections.defaultdict(set)  # (part, phase, n): the blocks whose storage it frees
    for _, part, (made_in, n) in (event for event in events if event[0] != "new"):
        if isinstance(made_in, tuple):
            frees_of[part, made_in[0], n].add(made_in[1])

    def freed_by(name, part, as_part):  # the model's storages that a free of name in the run frees
        made_in, n = name
        if isinstance(made_in, str):
            return [name]
        if isinstance(part, str) or len(frees_of[part, made_in[0], n]) > 1:
            return [((made_in[0], k), n) for k in stands_for(made_in[1])]
        return [((made_in[0], as_part[1] + made_in[1] - part[1]), n)]

    peaks = []
    for drop_grads in (True, False):
        freed = {name for kind, _, name in events if kind == "free" or kind == "grad" and drop_grads}
        alive, names, made, live, peak = {}, {}, collections.Counter(), 0, 0
        for part, as_part, run in played:
            for kind, _, value in run:
                if kind == "new":
                    storage = as_part, made[as_part]
                    alive[storage], names[storage] = value, (part, made[as_part])
                    made[as_part] += 1
                    live += value
                    peak = max(peak, live)
                elif kind == "free" or drop_grads:
                    for storage in freed_by(value, part, as_part):
                        if storage not in alive:
                            return None
                        live -= alive.pop(storage)
        if any((storage in alive) == (name in freed) for storage, name in names.items()):
            return None
        peaks.append(peak)
    return tuple(peaks)


@functools.cache
def newton_schulz_bytes(shape, n, ns_dtype, whole_update):
    """Peak bytes that muon.Muon's Newton-Schulz allocates for n matrices of shape: the whole
    muon_update (stacks of weights, gradients and buffers, then the iteration) if whole_update,
    else orthogonalise alone, given the stacked U (FSDP's sharded_step)."""
    with FakeTensorMode():
        if whole_update:
            W, G, B = ([torch.empty(shape) for _ in range(n)] for _ in range(3))
            lr = torch.tensor(0.02, dtype=torch.float64)
            with LiveBytes(exclude=[*W, *G, *B, lr]) as live:
                muon.muon_update(W, G, B, lr, 0.1, 0.95, True, ns_dtype)
        else:
            U = torch.empty(n, *shape)
            with LiveBytes(exclude=[U]) as live:
                muon.orthogonalise(U, ns_dtype)
    return live.peak


# ---------------------------------------------------------------------------------------------
# The plan

@dataclasses.dataclass(frozen=True)
class Machine:
    """What the plan is for: the run's dtype ("bfloat16", "float32"), Newton-Schulz's dtype and
    whether AdamW is fused (recipe.configure_optimizers fuses it on CUDA)."""
    dtype: str
    ns_dtype: torch.dtype
    fused_adamw: bool


@functools.cache  # a plan reads a model's shapes many times
def meta_model(config_fields):
    """The model on the meta device, which allocates nothing."""
    with torch.device("meta"):
        return GPT(GPTConfig(*config_fields))


def memory(config, cfg, gpus, micro_batch, fsdp, checkpointed, machine):
    """Bytes per GPU, by part: {weights, gradients, optimizer, activations, gathered, step, peak}
    (gathered: FSDP's whole blocks; step: the optimizer step's temporaries)."""
    model = meta_model(dataclasses.astuple(config))
    params = dict(model.named_parameters())
    n_params = sum(p.numel() for p in params.values())
    adamw = (n_params if cfg.optimizer == "adamw" else
             sum(p.numel() for name, p in params.items() if not name.startswith("blocks.")))
    share = gpus if fsdp else 1
    run_bytes = 2 if machine.dtype == "bfloat16" else 4
    grads, bucket = 4 * n_params / share, 4 * n_params if gpus > 1 and not fsdp else 0
    part = dict(weights=4 * n_params / share, gradients=grads + bucket,
                optimizer=(4 * (n_params - adamw) + 8 * adamw) / share)
    weight_dtype = torch.bfloat16 if fsdp and machine.dtype == "bfloat16" else torch.float32
    autocast = machine.dtype == "bfloat16"
    part["activations"] = activation_bytes(config, micro_batch, weight_dtype, autocast, checkpointed)
    block = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)  # the largest block gathered
    part["gathered"] = (run_bytes * (2 * model.wte.weight.numel() + 2 * block) + (run_bytes + 4) * block
                        if fsdp else 0)
    step = 4 * adamw / share if not machine.fused_adamw else 0
    if cfg.optimizer == "muon":
        groups = {}
        for p in model.blocks.parameters():
            groups[p.shape] = groups.get(p.shape, 0) + 1
        for shape, n in groups.items():
            mine, size = -(-n // gpus), 4 * math.prod(shape)  # a rank's matrices, and one's fp32 bytes
            if fsdp:
                # this rank's rows of every U; its share whole four times (the all-to-all's two
                # buffers, the gathered U, the new update), then Newton-Schulz
                muon = (n * size / gpus + 4 * mine * size
                        + newton_schulz_bytes(shape, mine, machine.ns_dtype, False))
            else:
                muon = newton_schulz_bytes(shape, mine, machine.ns_dtype, True)
                if gpus > 1:  # the new weights, padded, then every rank's gathered
                    muon = max(muon, (2 + gpus) * mine * size)
            step = max(step, muon)
    part["step"] = step
    # Later micro steps start with the last one's gradients; in a step's only one, whole (not
    # FSDP's) gradients appear as the activations are freed: simulated with them
    if fsdp or micro_batch < cfg.batch_size // gpus:
        forward_backward = grads + part["activations"] + part["gathered"]
    else:
        forward_backward = activation_bytes(config, micro_batch, weight_dtype, autocast, checkpointed,
                                            keep_grads=True)
    part["peak"] = (part["weights"] + part["optimizer"] + bucket
                    + max(forward_backward, grads + part["step"]))
    if fsdp:  # every rank draws the whole model in fp32 before it shards it (recipe.build)
        part["peak"] = max(part["peak"], 4 * n_params)
    return part


def micro_batches(cfg, gpus):
    """The micro-batches train.py accepts: the divisors of a GPU's share of the batch, largest first."""
    share = cfg.batch_size // gpus
    return [b for b in range(share, 0, -1) if share % b == 0]


def largest_fit(config, cfg, gpus, fsdp, checkpointed, machine, limit):
    """The largest micro-batch whose peak fits in limit bytes, or None."""
    for b in micro_batches(cfg, gpus):
        if memory(config, cfg, gpus, b, fsdp, checkpointed, machine)["peak"] <= limit:
            return b
    return None


def hours(model, cfg, gpus, mfu, peak_flops, checkpointed):
    """Hours for the run's tokens at mfu of gpus x peak_flops; with checkpointing the blocks'
    forward (a third of their 6 FLOPs per weight, and of attention's) runs twice."""
    T = model.config.block_size
    flops = flops_per_token(model, T)
    if checkpointed:
        flops += (flops - 6 * model.lm_head.weight.numel()) / 3
    return cfg.max_steps * cfg.batch_size * T * flops / (gpus * peak_flops * mfu) / 3600


def recorded_mfu():
    """{variant: MFU} measured on one H200 (docs/bench/h200-train.json)."""
    record = json.loads(H200_RECORD.read_text())
    return {attn: v["train"]["mfu"] for attn, v in record["variants"].items() if "train" in v}


def assumed_mfu(attn, args, recorded):
    """(MFU, where it comes from) of a variant: --mfu, else its H200 record, else MHA's record (a
    variant not measured yet, as the rivals)."""
    if args.mfu:
        return args.mfu, "given"
    if attn in recorded:
        return recorded[attn], "H200 record"
    return recorded["mha"], "MHA's H200 record: not measured"


def variant_config(config, attn):
    return dataclasses.replace(config, attn=attn)


def plan_tables(config, cfg, args, machine):
    """The markdown tables of one configuration: per variant, then memory per variant and mode."""
    mfu = recorded_mfu()
    limits = [g * GIB for g in args.gpu_memory_gib]
    T = config.block_size
    tokens = cfg.max_steps * cfg.batch_size * T
    lines = [f"{tokens / 1e9:.1f}B tokens, {cfg.batch_size} x {T} a step, on {args.gpus} GPUs of "
             f"{'/'.join(f'{g:g}' for g in args.gpu_memory_gib)} GiB, {args.peak_tflops:g} TFLOP/s each; "
             f"{machine.dtype}, {cfg.optimizer}", "",
             "| variant | params | KV cache at T=" + f"{T} (bf16, a sequence) | GFLOP/token | MFU | hours | "
             "hours with AC |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for attn in args.attn:
        model = meta_model(dataclasses.astuple(variant_config(config, attn)))
        m, source = assumed_mfu(attn, args, mfu)
        h, h_ac = (hours(model, cfg, args.gpus, m, args.peak_tflops * 1e12, ac) for ac in (False, True))
        cache_mib = model.kv_cache_bytes(1, T, torch.bfloat16) / 2**20
        lines.append(f"| {attn} | {model.get_num_params() / 1e9:.3f}B | {cache_mib:.1f} MiB | "
                     f"{flops_per_token(model, T) / 1e9:.2f} | {100 * m:.1f}% ({source}) | {h:,.0f} | "
                     f"{h_ac:,.0f} |")
    micro = min(cfg.micro_batch_size, cfg.batch_size // args.gpus)
    fits = " | ".join(f"largest micro-batch, {g:g} GiB" for g in args.gpu_memory_gib)
    lines += ["", f"Memory per GPU, GiB, at micro-batch {micro} (eager):", "",
              "| variant | mode | weights | gradients | optimizer | activations | gathered | step | peak | "
              f"{fits} |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(limits)]
    for attn in args.attn:
        for name, (fsdp, checkpointed) in MODES.items():
            c = variant_config(config, attn)
            part = memory(c, cfg, args.gpus, micro, fsdp, checkpointed, machine)
            best = [largest_fit(c, cfg, args.gpus, fsdp, checkpointed, machine, limit) for limit in limits]
            lines.append(f"| {attn} | {name} | " + " | ".join(f"{part[k] / GIB:.1f}" for k in
                         ("weights", "gradients", "optimizer", "activations", "gathered", "step", "peak"))
                         + " | " + " | ".join(str(b) if b else "-" for b in best) + " |")
    return "\n".join(lines)


def sizes_table(args, machine):
    """One row per size of Table 1 and variant: for each GPU memory, the first of DDP, FSDP,
    DDP + AC, FSDP + AC that fits (the cheapest first: FSDP adds communication, AC a third more
    compute), at its largest micro-batch, its peak and the hours it takes."""
    mfu = recorded_mfu()
    heads = " | ".join(f"{g:g} GiB: mode, micro-batch, peak GiB, hours" for g in args.gpu_memory_gib)
    source = f"MFU {args.mfu:g}" if args.mfu else "each variant's MFU in the H200 record"
    lines = [f"{args.gpus} GPUs, {args.peak_tflops:g} TFLOP/s each, {machine.dtype}, {source}", "",
             f"| size | variant | params | tokens | KV cache, a sequence of T | {heads} |",
             "|---|---|---:|---:|---:|" + "---|" * len(args.gpu_memory_gib)]
    for size, presets in SIZES.items():
        config, cfg = recipe.parse_args([str(REPO / p) for p in presets] + args.flags)
        for attn in args.attn:
            c = variant_config(config, attn)
            model = meta_model(dataclasses.astuple(c))
            cells = []
            for gib in args.gpu_memory_gib:
                cell = "does not fit"
                for name in ("DDP", "FSDP", "DDP + AC", "FSDP + AC"):
                    fsdp, checkpointed = MODES[name]
                    b = largest_fit(c, cfg, args.gpus, fsdp, checkpointed, machine, gib * GIB)
                    if b:
                        peak = memory(c, cfg, args.gpus, b, fsdp, checkpointed, machine)["peak"]
                        h = hours(model, cfg, args.gpus, assumed_mfu(attn, args, mfu)[0],
                                  args.peak_tflops * 1e12, checkpointed)
                        cell = f"{name}, {b}, {peak / GIB:.0f}, {h:,.0f}"
                        break
                cells.append(cell)
            tokens = cfg.max_steps * cfg.batch_size * c.block_size
            cache_mib = model.kv_cache_bytes(1, c.block_size, torch.bfloat16) / 2**20
            lines.append(f"| {size} | {attn} | {model.get_num_params() / 1e9:.2f}B | {tokens / 1e9:.0f}B | "
                         f"{cache_mib:.0f} MiB | {' | '.join(cells)} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Measuring

def measured_peak(config, cfg, device, world_size, micro_batch, dtype):
    """Peak bytes of tensor memory on this rank over two train.py steps (the second with the
    optimizer states the first made) on random tokens, from before the model is built: on a GPU
    the caching allocator's count, on a CPU LiveBytes' on the real tensors, polled. (In one
    process torch.profiler's allocator events give the same peak to within kernels' scratch, a
    few KiB; under torchrun they miss the frees that gloo's threads make.)"""
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()
    share = cfg.batch_size // world_size
    x = torch.randint(config.vocab_size, (share, config.block_size))

    def two_steps():
        torch.manual_seed(cfg.seed)
        raw_model, _, train_model, optimizers = recipe.build(config, cfg, device, world_size, dtype, False)
        for _ in range(2):
            recipe.backward(train_model, x, x, micro_batch, autocast, device)
            recipe.optimizer_step(raw_model, optimizers, cfg)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        two_steps()
        return torch.cuda.max_memory_allocated(device)
    with LiveBytes(poll=True) as live:
        two_steps()
    return live.peak


def measure(config, cfg, args):
    """Print this rank's measured peak beside the plan, per variant; under torchrun every rank
    measures and rank 0 prints all of them."""
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = hardware.pick_device(cfg.device, local_rank)
    dtype = recipe.run_dtype(cfg, device)
    machine = Machine(dtype, hardware.precision("newton_schulz", device)[0], device.type == "cuda")
    micro = min(cfg.micro_batch_size, cfg.batch_size // world_size)
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    mode = ("FSDP" if cfg.fsdp else "DDP" if world_size > 1 else "one process") + (
        " + AC" if cfg.checkpoint_activations else "")
    rows = []
    for attn in args.attn:
        c = variant_config(config, attn)
        peak = torch.tensor(float(measured_peak(c, cfg, device, world_size, micro, dtype)), device=device)
        peaks = [peak]
        if world_size > 1:
            peaks = [torch.zeros_like(peak) for _ in range(world_size)]
            dist.all_gather(peaks, peak)
        planned = memory(c, cfg, world_size, micro, cfg.fsdp, cfg.checkpoint_activations, machine)["peak"]
        measured = max(p.item() for p in peaks)
        rows.append(f"| {attn} | {mode} | {world_size} | {micro} | {planned / 2**20:.2f} | "
                    + " / ".join(f"{p.item() / 2**20:.2f}" for p in peaks)
                    + f" | {planned / measured - 1:+.1%} |")
    if world_size > 1:
        dist.destroy_process_group()
    if rank == 0:
        print(f"{device.type}, {dtype}, {cfg.optimizer}: planned and measured peak per process, MiB\n\n"
              "| variant | mode | processes | micro-batch | planned | measured, rank 0 / 1 / ... | "
              "plan vs largest |\n"
              "|---|---|---:|---:|---:|---:|---:|\n" + "\n".join(rows))


# ---------------------------------------------------------------------------------------------

def gib_list(text):
    """--gpu_memory_gib's values: GPU memories in GiB, distinct, comma-separated."""
    values = [float(v) for v in text.split(",")]
    if not all(1 <= v <= 10_000 for v in values) or len(set(values)) < len(values):  # `not` refuses nan
        raise argparse.ArgumentTypeError(f"{text}: must be a GPU's memory in GiB, from 1 to 10,000 "
                                         "(distinct ones, comma-separated)")
    return values


def between(least, most):
    """An argparse type: a number from least to most (neither nan nor inf)."""
    def number(text):
        value = float(text)
        if not least <= value <= most:  # `not` also refuses nan
            raise argparse.ArgumentTypeError(f"{text}: must be from {least:,g} to {most:,g}")
        return value
    return number


def main(argv=None):
    """Print the plan (or measure); the exit code: 0 done, 2 bad input."""
    parser = ArgumentParser(prog="plan.py", description=__doc__.strip().split("\n\n")[0],
                            allow_abbrev=False)
    parser.add_argument("--gpus", type=positive_int, default=8)
    parser.add_argument("--gpu_memory_gib", type=gib_list, default=[80.0, 141.0],
                        help="the GPU's memory, 1-10,000; comma-separated for several (default: 80,141)")
    parser.add_argument("--peak_tflops", type=between(1, 100_000),
                        default=dict(hardware.PEAK_BF16_FLOPS)["H200"] / 1e12,
                        help="a GPU's dense bf16 peak, 1-100,000 (default: an H100's or H200's, "
                        "PEAK_BF16_FLOPS)")
    parser.add_argument("--mfu", type=between(0.01, 1),
                        help="model FLOPs utilisation, 0.01-1 (default: the H200 record's)")
    parser.add_argument("--attn", type=variants, default=list(VARIANTS),
                        help="comma-separated variants (default: all)")
    parser.add_argument("--sizes", action="store_true", help="Table 1's four sizes, a line per variant")
    parser.add_argument("--measure", action="store_true", help="measure two steps here beside the plan")
    try:
        args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
        if args.sizes and any(not r.startswith("--") for r in rest):
            raise ConfigError("--sizes plans the four sizes' presets: give no preset")
        if args.sizes and args.measure:
            raise ConfigError("--measure measures one configuration: not with --sizes")
        args.flags = rest
        config, cfg = recipe.parse_args(rest)
        gpus = int(os.environ.get("WORLD_SIZE", 1)) if args.measure else args.gpus
        share = cfg.batch_size // gpus
        if cfg.batch_size % gpus or share % min(cfg.micro_batch_size, share):
            raise ConfigError(f"--batch_size={cfg.batch_size} does not split over {gpus} GPUs "
                                    f"in micro-batches of --micro_batch_size={cfg.micro_batch_size}")
        if args.measure and cfg.fsdp and gpus == 1:
            raise ConfigError("--measure --fsdp shards over torchrun's processes: "
                                    "run it under torchrun")
        if args.measure:
            measure(config, cfg, args)
            return 0
    except ConfigError as e:
        print(f"plan.py: {e}", file=sys.stderr)
        return 2
    machine = Machine("float32" if cfg.dtype == "float32" else "bfloat16", torch.bfloat16, True)
    print(sizes_table(args, machine) if args.sizes else plan_tables(config, cfg, args, machine))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
