"""
Training past one process, applied to the GPT and the loop from outside (as torchtitan does):
torchrun's processes, DDP, FSDP2 sharding and activation checkpointing. A run in one process
passes through every function here unchanged.
"""

import functools
import gc
import os
import sys
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint


def world():
    """(rank, local_rank, world_size) from torchrun's environment; `python train.py` is rank 0 of 1."""
    return tuple(int(os.environ.get(name, default)) for name, default in
                 (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))


@contextmanager
def process_group(device, world_size):
    """torch.distributed's process group around a run of several processes. A caller may hold one
    already (test_fsdp.py runs several jobs in one torchrun launch): a group made anew under
    torchrun's store would meet the keys the last one left there."""
    if world_size == 1 or dist.is_initialized():
        yield
        return
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield
    finally:
        # DDP sits in reference cycles, which only the garbage collector frees: free it now, while
        # the process group and the interpreter are whole (at exit, gloo's threads can abort the process)
        gc.collect()
        dist.destroy_process_group()


def parallelize(model, device, world_size, dtype, compile, fsdp, checkpoint_activations):
    """(model, train_model) for a GPT whose weights are set: model what evaluates (compiled or
    not), train_model what trains (model, in DDP under torchrun without fsdp). With fsdp the GPT's
    own parameters become shards, which an optimiser built on them afterwards steps."""
    if checkpoint_activations:
        checkpoint_blocks(model)
    if fsdp:
        shard(model, device, world_size, dtype, compile)
    evaluated = torch.compile(model) if compile and not fsdp else model
    if world_size > 1 and not fsdp:
        return evaluated, DDP(evaluated, device_ids=[device.index] if device.type == "cuda" else None)
    return evaluated, evaluated


def no_sync(train_model, last):
    """The context of one micro-batch's backward: DDP averages the gradients over processes in the
    last micro step's backward only; FSDP reduce-scatters them in every one, as holding whole
    gradients between would undo its saving."""
    return train_model.no_sync() if isinstance(train_model, DDP) and not last else nullcontext()


def shard(model, device, world_size, dtype, compile):
    """FSDP2 over all ranks: fully_shard each block, then the model (its embedding and unembedding),
    every parameter cut along dim 0. Weights, gradients and optimizer states stay fp32, a
    1 / world_size share of each on each rank; a block's weights are gathered whole, in the run's
    dtype, just before its forward and again before its backward, and freed after; gradients are
    reduce-scattered in fp32. Autocast stays on as under DDP, and inputs are not cast to the
    weights' dtype, so that the residual stream stays fp32 and a step computes what a DDP step
    does. Compiled, each block is compiled on its own, the hooks that gather and free weights
    outside its graph (torchtitan's order: compile, then shard)."""
    # imported here, as sharding begins: FSDP's modules take a second to import, which a run in
    # one process, sample.py and analyze.py need not pay
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if dtype == "bfloat16" else None,
                                  reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in model.blocks:
        if compile:
            block.compile()
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def checkpoint_blocks(model):
    """Keep only each block's input from the forward and recompute the block in the backward
    (torch.utils.checkpoint, non-reentrant): one block's activations alive at a time instead of
    every block's, for one more forward (about 8 FLOPs per weight and token instead of 6)."""
    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def is_shard(tensor):
    """Whether tensor is a DTensor, an FSDP shard. There is none before torch.distributed.tensor is
    imported (shard imports it), so nothing imports it to ask."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)


def gathered(state):
    """A state_dict with each DTensor (an FSDP shard) replaced by the whole tensor, in CPU memory on
    rank 0 and None on the other ranks, one tensor at a time: every rank must call it."""
    if is_shard(state):
        whole = state.full_tensor()
        return whole.cpu() if dist.get_rank() == 0 else None
    if isinstance(state, dict):
        return {k: gathered(v) for k, v in state.items()}
    if isinstance(state, list):
        return [gathered(v) for v in state]
    return state


def shard_like(tensor, param):
    """A whole tensor from a checkpoint cut to this rank's shard where param, whose shape it has,
    is sharded (a DTensor); as it is otherwise. Every rank holds the whole checkpoint (mapped)."""
    if is_shard(param) and tensor.shape == param.shape:
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(tensor.to(param.device), param.device_mesh, param.placements,
                                 src_data_rank=None)
    return tensor
