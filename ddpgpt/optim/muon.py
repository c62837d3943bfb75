"""Muon distributed by whole matrices: each matrix has one owner rank, which alone keeps its
momentum, orthogonalizes it and steps it; the other ranks get the new weights.

The step itself is torch's: `torch.optim.Muon` with adjust_lr_fn = "match_rms_adamw", over the
matrices a rank owns (see optimizer.py). For a matrix W with gradient G and momentum m:

    B <- m·B + (1 - m)·G                  momentum buffer (the only state: 4 bytes per element)
    U <- (1 - m)·G + m·B                  Nesterov
    O <- newton_schulz(U)                 ~ U·Vᵀ of U's SVD, five quintic iterations
    W <- W·(1 - lr·wd) - lr·0.2·sqrt(max(rows, cols))·O

torch iterates Newton-Schulz in bf16, and so do we under bf16 or fp16 precision (`Muon` is then
torch's step, untouched). Under run.precision fp32 it runs in fp32 (`newton_schulz`, torch's
iteration with the dtype as a parameter: bitwise torch's in bf16, tests/unit/test_muon.py): bf16
rounds each iterate to 3 digits, so two runs whose gradients differ only in the order of float
sums (two sync modes, two world sizes) drift apart by ~1e-4 in a few steps, where fp32 keeps
them within 1e-6. The price: on this project's test VM (x86 with AVX512-BF16) the fp32
iteration takes ~4× the bf16 one.

Newton-Schulz multiplies U by itself, so it needs the whole matrix: no element slice of it can be
stepped alone, which is what zero1 and fsdp2 hand an elementwise optimizer. Hence owners.

Who owns what (`plan`, a function of the matrices' shapes and W alone, so every rank computes the
same). The work per matrix is Newton-Schulz's, about rows·cols·min(rows, cols) multiply-adds per
iteration (`ns_cost`); the bytes a matrix moves are its elements. Walking the matrices in the
order the backward finishes them (last layer first), every W matrices of one shape-cost class make
a *round*: one matrix per rank, the same cost and size for each, so the round is perfectly
balanced and, laid out rank by rank, needs no padding. Consecutive rounds are merged into buckets
of up to `bucket_elems` elements (zero1 reduce-scatters a bucket as soon as its gradients are
ready). The matrices left over (fewer than W of a class) go, costliest first, each to the least
loaded rank (ties: the lower rank), into one last bucket. For gpt2-124m that is perfectly
balanced at W = 2 and 4 (every class has a multiple of W matrices) and 1.055 max/mean at W = 8.

`Matrices` holds the whole model's matrices and moves them between their owners and everyone in
one collective: the owners' new weights (after the step, in the modes that replicate the
model) and the momentum buffers (a checkpoint holds torch's Muon state_dict over every matrix).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim._muon import _adjust_lr

from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import DistEnv


def ns_cost(shape: tuple[int, int]) -> int:
    """Multiply-adds of one Newton-Schulz iteration, up to a constant: X·Xᵀ and (X·Xᵀ)·X on the
    short side, rows·cols·min(rows, cols) each."""
    rows, cols = shape
    return rows * cols * min(rows, cols)


@dataclass(frozen=True)
class Layout:
    """buckets[b][r]: the matrices (indices in model order) rank r owns in bucket b."""
    world: int
    buckets: tuple[tuple[tuple[int, ...], ...], ...]
    shapes: tuple[tuple[int, int], ...]

    @property
    def owner(self) -> list[int]:
        out = [0] * len(self.shapes)
        for bucket in self.buckets:
            for rank, mine in enumerate(bucket):
                for i in mine:
                    out[i] = rank
        return out

    def owned(self, rank: int) -> list[int]:
        """Rank `rank`'s matrices in model order: the order of its share in the flat layouts
        and of its Muon's parameters (at W = 1, the whole model's order)."""
        return sorted(i for bucket in self.buckets for i in bucket[rank])

    def elements(self, rank: int) -> int:
        return sum(_numel(self.shapes[i]) for i in self.owned(rank))

    def loads(self) -> list[int]:
        """Newton-Schulz cost per rank."""
        return [sum(ns_cost(self.shapes[i]) for i in self.owned(r)) for r in range(self.world)]

    def balance(self) -> float:
        """The largest rank's cost over the mean: the step waits for the slowest owner."""
        loads = self.loads()
        return max(loads) / (sum(loads) / self.world) if sum(loads) else 1.0

    def padded(self) -> int:
        """Elements of a flat buffer with every rank's share padded to the largest one's."""
        return self.world * max(self.elements(r) for r in range(self.world))


def _numel(shape: tuple[int, int]) -> int:
    return shape[0] * shape[1]


def plan(shapes: list[tuple[int, int]], world: int, bucket_elems: int = 0) -> Layout:
    """Owners and buckets for matrices of these shapes (model order) over `world` ranks."""
    shapes = [tuple(s) for s in shapes]
    rounds, pending = [], {}
    for i in reversed(range(len(shapes))):  # the backward finishes the last layer first
        key = (_numel(shapes[i]), ns_cost(shapes[i]))
        pending.setdefault(key, []).append(i)
        if len(pending[key]) == world:
            rounds.append([[j] for j in pending.pop(key)])  # one matrix each, the same cost
    buckets, filled = [], 0
    for rnd in rounds:
        size = world * _numel(shapes[rnd[0][0]])
        if buckets and filled + size <= bucket_elems:
            for rank in range(world):
                buckets[-1][rank] += rnd[rank]
            filled += size
        else:
            buckets.append(rnd)
            filled = size
    rest = sorted((i for left in pending.values() for i in left),
                  key=lambda i: (-ns_cost(shapes[i]), -i))
    if rest:
        load, last = [0] * world, [[] for _ in range(world)]
        for i in rest:  # the costliest first, each to the least loaded rank
            rank = min(range(world), key=lambda r: (load[r], r))
            last[rank].append(i)
            load[rank] += ns_cost(shapes[i])
        buckets.append([sorted(mine, reverse=True) for mine in last])
    return Layout(world, tuple(tuple(tuple(m) for m in b) for b in buckets), tuple(shapes))


class Matrices:
    """The whole model's Muon matrices (model order), this rank's share, and the one collective
    that gives every rank what each owner holds for its matrices."""

    def __init__(self, params: list[torch.nn.Parameter], env: DistEnv,
                 bucket_elems: int = 0):
        """`params`: the whole model's matrices, in model order (before any sharding)."""
        self.env = env
        self.shapes = [tuple(p.shape) for p in params]
        self.dtype, self.device = params[0].dtype, params[0].device
        self.layout = plan(self.shapes, env.world_size, bucket_elems)
        self.owned = [self.layout.owned(r) for r in range(env.world_size)]
        self.mine = self.owned[env.rank]  # indices, in the order of this rank's share
        self.width = max(self.layout.elements(r) for r in range(env.world_size))

    def gather(self, mine: list[torch.Tensor] | None) -> list[torch.Tensor | None]:
        """Collective: each owner's tensors, one per matrix it owns in `self.mine` order (None:
        it has none, e.g. no momentum before the first step), to every rank; returned for every
        matrix in model order (None where the owner had none). One all_gather of a flat buffer,
        each rank's share padded to the largest share (`Layout.padded`), plus one flag each."""
        # (1 + width,): the has-tensors flag, then the share
        flat = torch.zeros(1 + self.width, dtype=self.dtype, device=self.device)
        if mine is not None:
            flat[0], offset = 1, 1
            for t in mine:
                flat[offset:offset + t.numel()] = t.reshape(-1)
                offset += t.numel()
        everyone = flat.new_empty(self.env.world_size, 1 + self.width)  # (W, 1 + width)
        collectives.all_gather_into(self.env, everyone.view(-1), flat)
        out: list[torch.Tensor | None] = [None] * len(self.shapes)
        flags = everyone[:, 0].tolist()  # one read of the W flags
        for rank in range(self.env.world_size):
            if flags[rank] == 0:
                continue
            offset = 1
            for i in self.owned[rank]:
                n = self.shapes[i][0] * self.shapes[i][1]
                out[i] = everyone[rank, offset:offset + n].view(self.shapes[i])
                offset += n
        return out

    def share(self, params: list[torch.Tensor]) -> None:
        """Collective: every owner's new weights into every rank's whole matrices `params`."""
        mine = set(self.mine)
        with torch.no_grad():
            for i, new in enumerate(self.gather([params[i] for i in self.mine])):
                if i not in mine and new is not None:
                    params[i].copy_(new)

    def full_state(self, muon: torch.optim.Optimizer, steps: list[torch.Tensor]) -> dict:
        """Collective: the state_dict torch.optim.Muon over every matrix (model order) would
        have. `steps`: the tensors `muon` steps, in `self.mine` order."""
        local = muon.state_dict()  # its own indices: position in `steps`
        buffers = [muon.state[p]["momentum_buffer"] for p in steps if p in muon.state]
        full = self.gather(buffers if len(buffers) == len(steps) and buffers else None)
        group = {k: v for k, v in local["param_groups"][0].items() if k != "params"}
        return {"state": {i: {"momentum_buffer": b.clone()} for i, b in enumerate(full)
                          if b is not None},
                "param_groups": [{**group, "params": list(range(len(self.shapes)))}]}

    def load_state(self, muon: torch.optim.Optimizer, steps: list[torch.Tensor],
                   state: dict) -> None:
        """The momentum of this rank's matrices out of a whole-model Muon state_dict."""
        for p, i in zip(steps, self.mine):
            saved = state["state"].get(i)
            if saved is not None:
                muon.state[p] = {"momentum_buffer": saved["momentum_buffer"].to(p.device, p.dtype)
                                 .clone().view(p.shape)}


# The polynomial each Newton-Schulz iteration applies to the singular values, a·σ + b·σ³ + c·σ⁵.
# quintic: torch's (Keller Jordan's) one polynomial, every iteration. polar: Polar Express (Amsel,
# Persson, Musco, Gower 2025, arXiv:2505.16932; num_iters 5, safety factor 2e-2, cushion 2), one
# polynomial per iteration, each the best for the interval the previous one left; it reaches
# σ ≈ 1 in fewer iterations than quintic (docs/muon.md, "Newton-Schulz").
NS_COEFFICIENTS = {
    "quintic": ((3.4445, -4.7750, 2.0315),),
    "polar": ((8.156554524902461, -22.48329292557795, 15.878769915207462),
              (4.042929935166739, -2.808917465908714, 0.5000178451051316),
              (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
              (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
              (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)),
}
# The norm a polynomial schedule divides by first, as a multiple of the Frobenius norm: polar's
# polynomials assume the spectral norm at most 1/(1 + safety factor).
NS_NORM_SCALE = {"quintic": 1.0, "polar": 1.02}


def ns_polynomials(name: str, steps: int) -> list[tuple[float, float, float]]:
    """The `steps` polynomials of schedule `name`: its own, then its last one repeated (which
    keeps σ near 1). A schedule is made for its length: polar cut to 4 or 3 iterations leaves
    singular values up to 2.9 or 4.1 (measured), so fewer is refused (config.schema)."""
    table = NS_COEFFICIENTS[name]
    if steps < len(table):
        raise ValueError(f"Newton-Schulz schedule {name} needs at least {len(table)} steps")
    return [*table, *[table[-1]] * (steps - len(table))]


def newton_schulz(g: torch.Tensor, polys: list[tuple[float, float, float]], eps: float,
                  dtype: torch.dtype = torch.float32, norm_scale: float = 1.0) -> torch.Tensor:
    """torch's _zeropower_via_newtonschulz in `dtype`: U·f(S)·Vᵀ for g = U·S·Vᵀ, f(σ) ~ 1; one
    iteration per (a, b, c) of `polys` (ns_polynomials). In fp32 or fp64, a matrix whose long side
    is at least GRAM_RATIO times its short one iterates on its Gram matrix (`_gram_iterations`:
    the same polynomials, ~30% fewer multiply-adds at 256 × 704)."""
    x = g.to(dtype, copy=True)
    tall = g.size(0) > g.size(1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.T
    x.div_((x.norm() * norm_scale).clamp(min=eps))  # every singular value into (0, 1]
    if dtype in (torch.float32, torch.float64) and x.size(1) >= GRAM_RATIO * x.size(0):
        x = _gram_iterations(x, polys)
    else:
        for a, b, c in polys:
            gram = x @ x.T
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b·gram + c·gram²
            x = torch.addmm(x, poly, x, beta=a)                     # a·x + poly·x
    return x.T if tall else x


# Long side over short side from which the Gram form costs less: 2·m²n + 17·m³ multiply-adds for
# five iterations of an m × n matrix (m <= n), against 10·m²n + 5·m³, so from n = 1.5·m.
GRAM_RATIO = 1.5


def _gram_iterations(x: torch.Tensor, polys: list[tuple[float, float, float]]) -> torch.Tensor:
    """The iterations x <- q(A)·x, q(A) = a·I + b·A + c·A², A = x·xᵀ, for x (m, n), m <= n, carried
    on m × m matrices alone: with x_k = P_k·x_0, A_{k+1} = q_k·A_k·q_k (q_k is a polynomial in A_k,
    so it is symmetric and commutes with it) and P_{k+1} = q_k·P_k; x_0·xᵀ_0 and P·x_0 are the
    only products with n. Exact in exact arithmetic; in fp32 within ~1e-6 of the fp64 iteration
    on Gaussian matrices and ~1e-5 on ones of condition number 100, where the x-form is within
    ~5e-7 (entries ~0.2; torch's bf16 iteration rounds at ~1e-2)."""
    gram = x @ x.T  # (m, m)
    p = None
    for i, (a, b, c) in enumerate(polys):
        q = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b·A + c·A²
        q.diagonal().add_(a)                                 # + a·I
        p = q if p is None else q @ p
        if i < len(polys) - 1:
            gram = q @ gram @ q
    return p @ x  # (m, n)


class Muon(torch.optim.Muon):
    """torch.optim.Muon; its step as torch's unless the Newton-Schulz iteration runs in another
    dtype (`ns_dtype` float32) or with another polynomial schedule (`ns` polar), or the update is
    reshaped around it: `eq` (MuonEq-R: each row of the Nesterov update divided by its L2 norm
    before the iteration, so that no row's scale dominates the orthogonalization) or `snap` (the
    iteration's result rescaled to the Frobenius norm sqrt(min(rows, cols)) of an exactly
    orthogonal matrix, whatever the polynomials left)."""

    def __init__(self, params, ns_dtype: torch.dtype = torch.bfloat16, ns: str = "quintic",
                 eq: bool = False, snap: bool = False, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype, self.ns, self.eq, self.snap = ns_dtype, ns, eq, snap

    @torch.no_grad()
    def step(self, closure=None):
        if self.ns_dtype == torch.bfloat16 and self.ns == "quintic" and not (self.eq or self.snap):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:  # torch's _single_tensor_muon, but for the iteration
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)
            m = group["momentum"]
            polys = ns_polynomials(self.ns, group["ns_steps"])
            for p, grad, buf in zip(params, grads, buffers):
                buf.lerp_(grad, 1 - m)
                update = grad.lerp(buf, m) if group["nesterov"] else buf
                if self.eq:
                    update = update / update.norm(dim=1, keepdim=True).clamp(min=group["eps"])
                update = newton_schulz(update, polys, group["eps"], self.ns_dtype,
                                       NS_NORM_SCALE[self.ns])
                if self.snap:
                    update.mul_(min(p.shape) ** 0.5 / update.norm().clamp(min=group["eps"]))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], p.shape))
        return loss
