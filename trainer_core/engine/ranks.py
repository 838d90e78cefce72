"""What a rank under torchrun needs to know of the others: its rank, a vote, and a check that replicas agree.

Every function works alone too (no process group: rank 0 of a world of 1), so callers never branch on it.
"""

from __future__ import annotations

import os

import torch

# Replicas that DDP or ZeRO-1 keep in step get the same reduced gradients and run the same optimizer step,
# so their parameters agree to the last bit; a relative difference above this means they trained apart.
IN_SYNC_RTOL = 1e-6


class ReplicasDiverged(RuntimeError):
    """After training the ranks hold different parameters: the gradients were not synchronized."""


def rank() -> int:
    """This process's global rank under torchrun (0 when it runs alone)."""
    return int(os.environ.get("RANK", "0"))


def _group() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _device() -> torch.device:
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on any: one all-reduce, so all ranks decide the same thing at the
    same step (a stop that only rank 0 heard would leave the others waiting in the next collective)."""
    if not _group():
        return flag
    import torch.distributed as dist

    vote = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_device())
    dist.all_reduce(vote, op=dist.ReduceOp.MAX)
    return bool(vote.item())


def fingerprint(model: torch.nn.Module) -> torch.Tensor:
    """Three float64 sums over the parameters (plain, squared, position-weighted): equal replicas give equal
    sums, and a replica that trained on its own shard differs in all three."""
    total = torch.zeros(3, dtype=torch.float64)
    for i, p in enumerate(model.parameters()):
        x = p.detach().to("cpu", torch.float64)
        plain = x.sum()
        total += torch.stack([plain, (x * x).sum(), plain * (i + 1)])
    return total


def check_in_sync(model: torch.nn.Module) -> float:
    """The largest relative difference of any rank's fingerprint from rank 0's (0.0 alone); raises
    ReplicasDiverged above IN_SYNC_RTOL. Call it on every rank: it is a collective."""
    if not _group():
        return 0.0
    import torch.distributed as dist

    mine = fingerprint(model).to(_device())
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    ref = every[0].cpu()
    diffs = [float(((f.cpu() - ref).abs() / ref.abs().clamp_min(1e-12)).max()) for f in every]
    worst = max(diffs)
    if worst > IN_SYNC_RTOL:
        apart = [r for r, d in enumerate(diffs) if d > IN_SYNC_RTOL]
        raise ReplicasDiverged(
            f"after training, rank(s) {apart} hold parameters that differ from rank 0's (relative difference "
            f"{worst:.3g} > {IN_SYNC_RTOL:g}): the gradients were not synchronized across the ranks"
        )
    return worst
