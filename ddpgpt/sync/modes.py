"""The table of sync modes (run.sync): what each can do and what it costs. It imports no torch
and nothing of ddpgpt but the config's error, so whatever must know a mode's abilities
(preflight's refusals, `make`, `ddpgpt bench`, benchmarks/scaling.py, the tests) reads one row,
never a mode's name. A new mode is its file under sync/ and one row here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ddpgpt.config.checks import _choice


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
    shards_params: bool              # each rank keeps 1/W of the weights (else all, alike)
    loss_scaler: bool                # works with fp16's GradScaler
    compression: bool                # run.grad_compress bf16
    reduce_scatter: bool             # its buckets are reduce-scattered (else all-reduced)
    sent: Callable[[Traffic], float]                      # bytes per rank per optimizer step
    exposed: Callable[[Traffic, float, float], float]     # (traffic, bandwidth, micro-step s)
    memory: Callable[[int, int], float]                   # AdamW: bytes/parameter/rank (W, layers)
    why_not: dict[str, str] = field(default_factory=dict)  # per declaration that is False


_REPLICATED = dict(shards_state=False, shards_params=False, loss_scaler=True, compression=True,
                   sent=_replicated_bytes, memory=lambda world, layers: 16.0)
_SHARDED_GRADS = ("it shards the gradients, and the loss scaler would check only this rank's "
                  "shard for overflow")

MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("ddp", "ddpgpt.sync.ddp:DDPSync",
         "torch's DistributedDataParallel: its buckets all-reduce during the last backward",
         reduce_scatter=False, exposed=_ddp_exposed, **_REPLICATED),
    Mode("allreduce", "ddpgpt.sync.buckets:BucketSync",
         "our flat buckets: one asynchronous all_reduce each, issued as soon as it is ready",
         reduce_scatter=False, exposed=_ddp_exposed, **_REPLICATED),
    Mode("rs-ag", "ddpgpt.sync.buckets:BucketSync",
         "the same buckets, each a reduce-scatter then an all-gather (a ring all-reduce's halves)",
         reduce_scatter=True, exposed=_rs_ag_exposed, **_REPLICATED),
    Mode("zero1", "ddpgpt.sync.zero1:Zero1Sync",
         "reduce-scatter; each rank steps its 1/W of the parameters and state; all-gather",
         shards_state=True, shards_params=False, loss_scaler=False, compression=True,
         reduce_scatter=True,
         sent=_zero1_bytes, exposed=_zero1_exposed,
         memory=lambda world, layers: 8 + 12 / world,
         why_not={"loss_scaler": _SHARDED_GRADS}),
    Mode("fsdp2", "ddpgpt.sync.fsdp2:FSDP2Sync",
         "torch's fully_shard: parameters, gradients and optimizer state sharded 1/W",
         shards_state=True, shards_params=True, loss_scaler=False, compression=False,
         reduce_scatter=False,
         sent=_fsdp2_bytes, exposed=_fsdp2_exposed,
         # 1/W of everything, plus two blocks' whole weights and gradients while they compute
         memory=lambda world, layers: 16 / world + 2 * 8 / layers,
         why_not={"loss_scaler": _SHARDED_GRADS,
                  "compression": "it reduces the gradients itself, in their own dtype"}),
)}


def check(name: str, where: str = "run.sync") -> Mode:
    """The row of `name`, or one line naming the modes there are."""
    section, _, field_name = where.rpartition(".")
    _choice(section, field_name, name, tuple(MODES))  # the config's own one-line refusal
    return MODES[name]
