"""The optimizer's settings and its schedule's: AdamW or Muon, the learning rate's warmup, shape
and end (optim/schedule.py computes each step's from them), gradient clipping."""

from __future__ import annotations

from dataclasses import dataclass

from ddpgpt.config import choices
from ddpgpt.config.checks import _choice, _finite, _require


@dataclass
class OptimConfig:
    """AdamW, or Muon for the blocks' matrices with AdamW for the rest; linear warmup, then a
    cosine, warmup-stable-decay or constant schedule (optim/schedule.py); gradient clipping."""

    name: choices.Optimizer = "adamw"
    """adamw, or muon: torch's Muon for the blocks' 2-D weight matrices, each stepped by one
    owner rank, and AdamW (lr, betas) for the embeddings, norms and biases (docs/muon.md)."""
    lr: float = 1e-3
    """Peak learning rate, reached after warmup_steps."""
    min_lr: float | None = None
    """Learning rate at the end of the decay (cosine and wsd; the schedule's last step). Unset:
    a tenth of lr, following it (`floor`); config.json keeps it unset."""
    embed_lr: float = 0.0
    """AdamW's peak lr for the token embedding (tied: the head too), min_lr scaled alike; 0: lr."""
    warmup_steps: int = 20
    """Steps of linear warmup from 0 to lr, at the schedule's start."""
    decay_steps: int = 0
    """The step the schedule ends at, its warmup included: lr reaches min_lr there and stays. 0:
    run.steps where the schedule starts (the first start; a new schedule_start), kept on resume
    (more run.steps go on at min_lr); wsd resumed in its flat phase takes the new run.steps."""
    schedule_start: int = 0
    """The step the schedule starts at, its warmup first. Steps past the end of a run's schedule
    train on one of their own from the step they resume at: give that step."""
    schedule: choices.Schedule = "cosine"
    """The lr after warmup: cosine (down to min_lr at the schedule's end), wsd (flat at lr, then
    linear down to min_lr over the last decay_fraction; resumed while flat with more run.steps,
    it decays at the new end) or constant (flat at lr)."""
    decay_fraction: float = 0.2
    """wsd: the share of the schedule, at its end, over which lr falls linearly to min_lr."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices and embeddings only (not biases or norms)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    grad_clip: float = 1.0
    """Clip the global (all-ranks) gradient norm to this; 0 disables clipping."""
    muon_lr: float = 0.02
    """Muon's peak learning rate (updates of RMS 0.2 before it); follows lr's warmup and cosine."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov) after its warmup."""
    muon_momentum_start: float = 0.85
    """Muon's momentum at step 0, rising linearly to muon_momentum."""
    muon_momentum_warmup: int = 100
    """Steps over which Muon's momentum rises to muon_momentum (0: constant)."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations per Muon update."""
    muon_ns: choices.NewtonSchulz = "quintic"
    """Newton-Schulz's polynomials: quintic (torch's) or polar (Polar Express; docs/muon.md)."""
    muon_eq: bool = False
    """MuonEq-R: each row of Muon's update divided by its L2 norm before Newton-Schulz."""
    muon_snap: bool = False
    """Muon's update rescaled after Newton-Schulz to an orthogonal matrix's Frobenius norm."""
    muon_ns_dtype: choices.NewtonSchulzDtype = "auto"
    """Newton-Schulz's dtype: auto (fp32 under run.precision fp32, so that runs compare exactly;
    bf16 otherwise, as torch), fp32 or bf16 (faster where there are bf16 matrix units)."""

    def __post_init__(self):
        _finite(self, "optim.")
        _choice("optim", "name", self.name, choices.Optimizer)
        _require(self.lr > 0, f"optim.lr = {self.lr} must be > 0")
        if self.min_lr is not None:  # unset, it follows lr; set, its flag is the fix
            _require(self.min_lr >= 0, f"optim.min_lr = {self.min_lr:g} must be >= 0")
            _require(self.min_lr <= self.lr, f"optim.min_lr = {self.min_lr:g} is above optim.lr "
                     f"= {self.lr:g}; give --optim.min-lr {self.lr / 10:g} (a tenth of optim.lr, "
                     f"what it is unset) or another value in [0, {self.lr:g}]")
        _choice("optim", "schedule", self.schedule, choices.Schedule)
        _require(0 < self.decay_fraction <= 1,
                 f"optim.decay_fraction = {self.decay_fraction:g} must be in (0, 1]")
        _require(self.warmup_steps >= 0, f"optim.warmup_steps = {self.warmup_steps} must be >= 0")
        _require(self.decay_steps >= 0,
                 f"optim.decay_steps = {self.decay_steps} must be >= 0 (0: run.steps)")
        _require(self.schedule_start >= 0,
                 f"optim.schedule_start = {self.schedule_start} must be >= 0")
        _require(self.weight_decay >= 0, f"optim.weight_decay = {self.weight_decay} must be >= 0")
        for name in ("beta1", "beta2"):
            _require(0 <= getattr(self, name) < 1,
                     f"optim.{name} = {getattr(self, name)} must be in [0, 1)")
        _require(self.eps > 0, f"optim.eps = {self.eps} must be > 0")
        _require(self.grad_clip >= 0, f"optim.grad_clip = {self.grad_clip} must be >= 0 (0: off)")
        _require(self.embed_lr >= 0, f"optim.embed_lr = {self.embed_lr} must be >= 0 (0: lr)")
        _require(self.muon_lr > 0, f"optim.muon_lr = {self.muon_lr} must be > 0")
        for name in ("muon_momentum", "muon_momentum_start"):
            _require(0 <= getattr(self, name) < 1,
                     f"optim.{name} = {getattr(self, name)} must be in [0, 1)")
        _require(self.muon_momentum_warmup >= 0,
                 f"optim.muon_momentum_warmup = {self.muon_momentum_warmup} must be >= 0")
        _require(self.muon_ns_steps >= 1, f"optim.muon_ns_steps = {self.muon_ns_steps} must be > 0")
        _choice("optim", "muon_ns", self.muon_ns, choices.NewtonSchulz)
        _require(self.muon_ns != "polar" or self.muon_ns_steps >= 5,  # optim/muon.py's table
                 f"optim.muon_ns = polar is made for 5 iterations; optim.muon_ns_steps = "
                 f"{self.muon_ns_steps} must be >= 5 with it")
        _choice("optim", "muon_ns_dtype", self.muon_ns_dtype, choices.NewtonSchulzDtype)

    @property
    def floor(self) -> float:
        """The lr the decay ends at: min_lr, or a tenth of lr where min_lr is unset."""
        return self.lr / 10 if self.min_lr is None else self.min_lr
