"""
Muon, the optimiser the paper trains every matrix inside the blocks with: momentum, then the
update orthogonalised by a Newton-Schulz iteration. Batched (the matrices of one shape
orthogonalised together), and split over the ranks of a DDP or FSDP run.
"""

import torch
import torch.distributed as dist

from lib.training.hardware import precision
from lib.training.parallel import is_shard


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update with adjust_lr_fn="original", batched: the matrices of one shape
    are stacked and orthogonalised together, one step for a whole shape group, compiled on CUDA.
    For each matrix W with gradient G, momentum buffer B (zero at first), lr, weight decay wd and
    momentum mu:

        B <- mu B + (1 - mu) G
        U <- (1 - mu) G + mu B     (nesterov; else U <- B)
        O <- NS5(U)                the quintic Newton-Schulz iteration below, in ns_dtype
        W <- (1 - lr wd) W - lr sqrt(max(1, rows / cols)) O

    Under torch.distributed each rank orthogonalises a contiguous share of each shape group, so
    that the Newton-Schulz work divides among the ranks, and each matrix is orthogonalised whole:
    - DDP: every rank holds the same whole gradients (DDP averaged them) and moves every momentum
      buffer (elementwise, cheap next to Newton-Schulz); all_gather hands every rank the new
      weights of the others' shares.
    - FSDP: every rank holds a shard (rows, dim 0) of each matrix, its gradient and its momentum
      buffer, all DTensors, and moves its rows of every buffer. An all-to-all gathers each matrix's
      U whole on the rank that orthogonalises it, and a second hands every rank its rows of each
      O (sharded_step).
    Either way the whole state is every matrix's momentum_buffer, torch.optim.Muon's state, whole
    in rank 0's state_dict under DDP and once checkpoint_dict gathers its shards under FSDP, so that
    one checkpoint resumes under one process, DDP or FSDP alike (and torch.optim.Muon's here).

    ns_dtype: what Newton-Schulz runs in; None: the precision policy's for the parameters' device.
    torch.optim.Muon runs it in bf16 everywhere; the iteration only needs the update's direction
    to a few bits, so fp32 changes no result that matters and spares a CPU without bf16
    instructions its emulated bf16 matmuls, tens of times slower than fp32 ones."""

    def __init__(self, params, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_dtype=None):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov))
        params = [p for group in self.param_groups for p in group["params"]]
        if any(p.ndim != 2 for p in params):
            raise ValueError("Muon: every parameter must be a matrix")
        self.ns_dtype = ns_dtype or precision("newton_schulz", params[0].device)[0]
        distributed = dist.is_initialized()
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        # eager on a CPU, where compiling (a C++ compiler, tens of seconds) costs more than it saves
        compiled = params[0].is_cuda
        self.update = torch.compile(muon_update) if compiled else muon_update
        self.orthogonalise = torch.compile(orthogonalise) if compiled else orthogonalise

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            shapes = {}
            for p in group["params"]:
                if p.grad is not None:
                    shapes.setdefault(p.shape, []).append(p)
            for shape, params in shapes.items():
                for p in params:
                    if "momentum_buffer" not in self.state[p]:
                        self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                bufs = [self.state[p]["momentum_buffer"] for p in params]
                # matrices a rank orthogonalises; the last may have fewer
                n = -(-len(params) // self.world_size)
                # lr as a 0-d tensor: a float that the schedule moves every step would recompile the graph
                lr = torch.tensor(group["lr"], dtype=torch.float64)
                hyper = (lr, group["weight_decay"], group["momentum"], group["nesterov"])
                if is_shard(params[0]):
                    self.sharded_step(params, bufs, n, *hyper)
                else:
                    self.replicated_step(params, bufs, n, *hyper)

    def replicated_step(self, params, bufs, n, lr, weight_decay, momentum, nesterov):
        """One shape group's step from whole gradients, the same on every rank (one process, DDP)."""
        shape, grads = params[0].shape, [p.grad for p in params]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        mine = slice(self.rank * n, (self.rank + 1) * n)
        new = (self.update(params[mine], grads[mine], bufs[mine], lr, weight_decay, momentum, nesterov,
                           self.ns_dtype) if params[mine] else params[0].new_empty(0, *shape))
        if self.world_size > 1:
            padded = torch.cat([new, new.new_zeros(n - len(new), *shape)])
            new = new.new_empty(self.world_size * n, *shape)
            dist.all_gather_into_tensor(new, padded)
        torch._foreach_copy_(params, list(new[:len(params)]))

    def sharded_step(self, params, bufs, n, lr, weight_decay, momentum, nesterov):
        """One shape group's step from FSDP's shards. fully_shard cuts dim 0 as torch.chunk does:
        rank i holds rows [i c, (i + 1) c) of each (rows, cols) matrix, c = ceil(rows / ranks),
        fewer (or none) on the last ranks."""
        (rows, cols), ranks = params[0].shape, self.world_size
        c = -(-rows // ranks)
        W, G, B = ([t.to_local() for t in ts] for ts in (params, [p.grad for p in params], bufs))
        torch._foreach_lerp_(B, G, 1 - momentum)
        U = torch._foreach_lerp(G, B, momentum) if nesterov else B  # this rank's rows of every U
        # send[i, k]: this rank's rows of the k-th matrix that rank i orthogonalises, zero-padded to c
        send = U[0].new_zeros(ranks, n, c, cols)
        for j, u in enumerate(U):
            send[j // n, j % n, :len(u)] = u
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send)
        # received[i, k]: rank i's rows of this rank's k-th matrix; stacked, the matrices whole
        mine = len(params[self.rank * n:(self.rank + 1) * n])
        whole = received.transpose(0, 1).reshape(n, ranks * c, cols)[:mine, :rows]
        O = received.new_zeros(n, ranks * c, cols)
        if mine:
            O[:mine, :rows] = self.orthogonalise(whole, self.ns_dtype)
        dist.all_to_all_single(received, O.view(n, ranks, c, cols).transpose(0, 1).contiguous())
        # received[i, k]: this rank's rows of the O of rank i's k-th matrix, matrix i n + k
        O = [received[j // n, j % n, :len(w)] for j, w in enumerate(W)]
        new = descend(torch.stack(W), torch.stack(O), lr, weight_decay, (rows, cols))
        torch._foreach_copy_(W, list(new))


def orthogonalise(X, ns_dtype):
    """NS5(X) of a stack of matrices X (n, rows, cols), in ns_dtype. The iteration is
    torch.optim.Muon's: its coefficients, eps and 5 steps (in bf16 there), on the transpose of a
    tall matrix, the same fused multiply-adds (addmm there, baddbmm here)."""
    X = X.to(ns_dtype)
    rows, cols = X.shape[-2:]
    if rows > cols:
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)  # spectral norm at most 1
    for _ in range(5):
        A = X @ X.mT
        X = torch.baddbmm(X, torch.baddbmm(A, A, A, beta=-4.7750, alpha=2.0315), X, beta=3.4445)
    return X.mT if rows > cols else X


def descend(W, O, lr, weight_decay, shape):
    """W <- (1 - lr wd) W - lr sqrt(max(1, rows / cols)) O, in place, for W and O stacks of
    (rows of) matrices of shape (rows, cols)."""
    rows, cols = shape
    return W.mul_(1 - lr * weight_decay).sub_(O.to(W.dtype) * (lr * max(1, rows / cols) ** 0.5))


def muon_update(params, grads, bufs, lr, weight_decay, momentum, nesterov, ns_dtype):
    """Muon's new values for whole matrices of one shape, stacked, from their moved momentum buffers."""
    G, B, W = torch.stack(grads), torch.stack(bufs), torch.stack(params)
    U = G.lerp(B, momentum) if nesterov else B
    return descend(W, orthogonalise(U, ns_dtype), lr, weight_decay, W.shape[-2:])
