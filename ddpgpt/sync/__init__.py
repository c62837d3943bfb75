"""How gradients are synchronized across ranks (run.sync): one table of modes, and one small
interface (sync/base.py) that the Trainer calls the same way whatever the mode.

    sync = make(cfg.run.sync, model, groups, env, bucket_mb)   # wraps the model, lays it out
    optimizer = Optimizer(groups, sync.params(), ...)           # over what this rank steps
    for each micro-step m of A:
        with sync.micro_step(last=m == A - 1):
            sync.model(x, y), backward   # on the last one, the gradient sync starts in backward
    sync.finish()                        # every rank holds the mean gradient (zero1: its shards)
    norm = sync.clip(max_norm)           # the global gradient norm
    sync.before_update(); optimizer.step(); sync.after_update(); sync.zero_grad()
    sync.model_state(), sync.optimizer_state(optimizer)   # checkpoints: full tensors, the layout
                                                          # of torch's optimizers over the whole
                                                          # model, whatever the mode and W

The table (`MODES`) is the one place that says what a mode can do: where its code lives, whether
it shards the optimizer state, whether it works with fp16's loss scaler and with gradient
compression, whether it can step whole-matrix optimizers (Muon), and the bytes a rank sends per
step, with the schedule that decides how much of them the backward hides. Config validation,
preflight's refusals, `make`, `ddpgpt bench`, benchmarks/scaling.py and the tests read it. A new
mode is one file under sync/ and one row here.

This module imports no torch: the config validates run.sync against the table before any heavy
import. At world size 1 every mode is the model itself, with no collective (unless a one-rank
group was asked for: `ddpgpt bench --group`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Traffic:
    """What one optimizer step moves, for the byte formulas (elements, not bytes)."""
    params: int            # N: every parameter of the model
    world: int             # W
    accum: int = 1         # A: micro-steps per optimizer step
    grad_bytes: int = 4    # bytes per gradient element on the wire (2 with grad_compress bf16)
    matrices: int = 0      # elements of Muon's matrices (0: AdamW for everything)
    padded: int = 0        # W × the largest owner's share of them (muon.Layout.padded)

    @property
    def ring(self) -> float:
        """What one pass of a ring collective sends per rank, as a fraction of its tensor."""
        return (self.world - 1) / self.world


# Bytes one rank sends per step. A ring all-reduce is two passes (reduce-scatter, all-gather).
def _replicated_bytes(t: Traffic) -> float:
    """The gradients all-reduced; with Muon, then every owner's new matrices all-gathered."""
    return t.ring * (2 * t.grad_bytes * t.params + 4 * t.padded)


def _zero1_bytes(t: Traffic) -> float:
    """Gradients reduce-scattered, parameters all-gathered; Muon's matrices laid out by owner
    (whole matrices per rank, each rank's share padded to the largest)."""
    elements = t.params - t.matrices + t.padded
    return t.ring * (t.grad_bytes + 4) * elements


def _fsdp2_bytes(t: Traffic) -> float:
    """Each micro-step all-gathers the weights for its forward and again for its backward, the
    last one reduce-scatters the gradients. With Muon, one all-to-all brings each owner its
    matrices' weights and gradients (8 bytes) from the other ranks' shards and one sends the new
    weights back (4): each rank sends only its 1/W rows of the matrices others own."""
    return t.ring * ((2 * t.accum * 4 + t.grad_bytes) * t.params + 12 * t.matrices / t.world)


# Seconds of that traffic that no computation hides, given a bandwidth and the compute time of
# one micro-step (forward 1/3, backward 2/3): the ring's passes as each mode schedules them.
# Latency and the slowdown of kernels sharing the device with communication are left out.
def _passes(t: Traffic, bandwidth: float, elements: int, nbytes: int) -> float:
    return t.ring * elements * nbytes / bandwidth


def _ddp_exposed(t: Traffic, bandwidth: float, micro_s: float) -> float:
    """All-reduce during the last backward; Muon's all-gather after the step."""
    grads = _passes(t, bandwidth, t.params, t.grad_bytes)
    return max(0.0, 2 * grads - 2 * micro_s / 3) + _passes(t, bandwidth, t.padded, 4)


def _rs_ag_exposed(t: Traffic, bandwidth: float, micro_s: float) -> float:
    """Reduce-scatter during the last backward, all-gather after it."""
    grads = _passes(t, bandwidth, t.params, t.grad_bytes)
    return max(0.0, grads - 2 * micro_s / 3) + grads + _passes(t, bandwidth, t.padded, 4)


def _zero1_exposed(t: Traffic, bandwidth: float, micro_s: float) -> float:
    """Reduce-scatter during the last backward, the parameters' all-gather after the step."""
    elements = t.params - t.matrices + t.padded
    grads = _passes(t, bandwidth, elements, t.grad_bytes)
    return max(0.0, grads - 2 * micro_s / 3) + _passes(t, bandwidth, elements, 4)


def _fsdp2_exposed(t: Traffic, bandwidth: float, micro_s: float) -> float:
    """Weights gathered behind each forward and backward; the last backward also reduce-scatters;
    Muon's all-to-alls come between the backward and the step."""
    weights = _passes(t, bandwidth, t.params, 4)
    grads = _passes(t, bandwidth, t.params, t.grad_bytes)
    forward, backward = micro_s / 3, 2 * micro_s / 3
    plain = max(0.0, weights - forward) + max(0.0, weights - backward)
    last = max(0.0, weights - forward) + max(0.0, weights + grads - backward)
    return (t.accum - 1) * plain + last + _passes(t, bandwidth, t.matrices / t.world, 12)


@dataclass(frozen=True)
class Mode:
    """What a sync mode can do, and what it costs."""
    name: str
    impl: str                        # "module:Class" of its Sync
    summary: str                     # one line, for help texts
    shards_state: bool               # each rank keeps 1/W of the optimizer state
    loss_scaler: bool                # works with fp16's GradScaler
    compression: bool                # run.grad_compress bf16
    whole_matrices: bool             # can step an optimizer that needs whole matrices (Muon)
    sent: Callable[[Traffic], float]                      # bytes per rank per optimizer step
    exposed: Callable[[Traffic, float, float], float]     # (traffic, bandwidth, micro-step s)
    memory: Callable[[int, int], float]                   # AdamW: bytes/parameter/rank (W, layers)
    why_not: dict[str, str] = field(default_factory=dict)  # per declaration that is False


_REPLICATED = dict(shards_state=False, loss_scaler=True, compression=True, whole_matrices=True,
                   sent=_replicated_bytes, memory=lambda world, layers: 16.0)
_SHARDED_GRADS = ("it shards the gradients, and the loss scaler would check only this rank's "
                  "shard for overflow")

MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("ddp", "ddpgpt.sync.ddp:DDPSync",
         "torch's DistributedDataParallel: its buckets all-reduce during the last backward",
         exposed=_ddp_exposed, **_REPLICATED),
    Mode("allreduce", "ddpgpt.sync.buckets:BucketSync",
         "our flat buckets: one asynchronous all_reduce each, issued as soon as it is ready",
         exposed=_ddp_exposed, **_REPLICATED),
    Mode("rs-ag", "ddpgpt.sync.buckets:BucketSync",
         "the same buckets, each a reduce-scatter then an all-gather (a ring all-reduce's halves)",
         exposed=_rs_ag_exposed, **_REPLICATED),
    Mode("zero1", "ddpgpt.sync.zero1:Zero1Sync",
         "reduce-scatter; each rank steps its 1/W of the parameters and state; all-gather",
         shards_state=True, loss_scaler=False, compression=True, whole_matrices=True,
         sent=_zero1_bytes, exposed=_zero1_exposed,
         memory=lambda world, layers: 8 + 12 / world,
         why_not={"loss_scaler": _SHARDED_GRADS}),
    Mode("fsdp2", "ddpgpt.sync.fsdp2:FSDP2Sync",
         "torch's fully_shard: parameters, gradients and optimizer state sharded 1/W",
         shards_state=True, loss_scaler=False, compression=False, whole_matrices=True,
         sent=_fsdp2_bytes, exposed=_fsdp2_exposed,
         # 1/W of everything, plus two blocks' whole weights and gradients while they compute
         memory=lambda world, layers: 16 / world + 2 * 8 / layers,
         why_not={"loss_scaler": _SHARDED_GRADS,
                  "compression": "it reduces the gradients itself, in their own dtype"}),
)}


def make(mode: str, model, groups: list, env, bucket_mb: float = 25.0, compress: str = "none"):
    """The Sync of `mode` around the single-device `model`, which it wraps and lays out for
    `groups` (optim.groups: the optimizer's parameter groups over the whole model). mode=None, or
    no process group: the model alone, no collective. `compress` bf16: gradients travel in
    bfloat16 (they still accumulate in fp32)."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"unknown sync mode {mode!r}")
    if mode is None or env.backend is None:
        from ddpgpt.sync.base import Sync
        return Sync(model, groups, env, bucket_mb)
    module, name = MODES[mode].impl.split(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(model, groups, env, bucket_mb, mode=mode, compress=compress)
