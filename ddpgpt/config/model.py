"""The model's settings: its shape, and its architecture as pieces that can each be switched on
their own (for measuring them one at a time), with `model.arch` a named bundle of them. Every
piece left unset takes the arch's value; `ModelConfig.resolved()` fills them in, and config.json
records them all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple, get_args

from ddpgpt.config.checks import _choice, _finite, _require
from ddpgpt.config.choices import Arch, Attention, Gelu, Kernels, Mlp, Norm


class Pieces(NamedTuple):
    """What an architecture is made of: the values a model.arch gives the pieces left unset."""
    rope: bool
    norm: Norm
    qk_norm: bool
    mlp: Mlp
    bias: bool
    tie_embeddings: bool
    zero_init_proj: bool


ARCHS: dict[str, Pieces] = {
    # GPT-2's of 2019: learned positions, LayerNorm, GELU, biases, the head tied to the embedding.
    "gpt2": Pieces(rope=False, norm="layernorm", qk_norm=False, mlp="gelu", bias=True,
                   tie_embeddings=True, zero_init_proj=False),
    # Llama's and Qwen3's, with the output projections zero at init (modded-nanogpt, nanochat).
    "modern": Pieces(rope=True, norm="rmsnorm", qk_norm=True, mlp="swiglu", bias=False,
                     tie_embeddings=False, zero_init_proj=True),
}
PIECES = Pieces._fields


@dataclass
class ModelConfig:
    """The decoder: its shape, and its architecture (model.arch, a bundle of pieces that can each
    be set on their own: docs/model.md)."""

    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention (query) heads per block; must divide n_embd unless head_dim is set."""
    n_embd: int = 256
    """Residual stream width."""
    block_size: int = 256
    """Longest context in tokens (the rows of the learned position embedding; with rope, the
    longest training sequence and the sampling window)."""
    vocab_size: int = 0
    """Output vocabulary; 0 takes the dataset's, rounded up to a multiple of 64 for fast matmuls
    where that adds no more than a hundredth (GPT-2's 50,257 -> 50,304)."""
    arch: Arch = "modern"
    """The architecture, a named bundle of the pieces below (rope, norm, qk_norm, mlp, bias,
    tie_embeddings, zero_init_proj): each piece left unset takes the arch's value, and config.json
    records them all. modern is the default for new runs (docs/performance.md, "Time to a loss");
    a config saved before model.arch existed is gpt2, as --init-from gpt2 is. gpt2: GPT-2's
    (learned positions, LayerNorm, GELU, biases, the head tied to the embedding). modern: rotary
    positions, RMSNorm, QK-norm, SwiGLU, no biases, an untied head, zero-initialized output
    projections (Qwen3's; ddpgpt export writes it as Qwen3ForCausalLM)."""
    rope: bool | None = None
    """Rotary position embeddings (each query and key turned by an angle proportional to its
    position; nothing learned) instead of a learned embedding of block_size positions. Unset:
    model.arch's."""
    norm: Norm | None = None
    """The normalization before each attention and MLP and before the head: layernorm (centred
    and scaled; a gain, and a shift with model.bias) or rmsnorm (scaled by the root mean square;
    a gain). Unset: model.arch's."""
    qk_norm: bool | None = None
    """RMSNorm of every head's queries and keys (a gain per head dimension, shared by the heads)
    before the rotary turn, as Qwen3: attention logits stay bounded. Unset: model.arch's."""
    mlp: Mlp | None = None
    """The MLP: gelu (GPT-2's; model.gelu picks which), relu2 (ReLU squared, as modded-nanogpt
    and nanochat) or swiglu (SiLU of a gate projection times an up projection, as Llama and
    Qwen3). Unset: model.arch's."""
    mlp_hidden: int = 0
    """The MLP's hidden width; 0: 4 × n_embd, or with swiglu (three matrices, not two) 8/3 ×
    n_embd rounded up to a multiple of 32, about the same parameters."""
    bias: bool | None = None
    """Biases in the linear layers and LayerNorms (GPT-2 has them). Unset: model.arch's."""
    tie_embeddings: bool | None = None
    """The output head is the token embedding (GPT-2) rather than a matrix of its own. Unset:
    model.arch's."""
    zero_init_proj: bool | None = None
    """Initialize every block's output projections (attention's and the MLP's) to zero, so that
    each block starts as the identity, rather than GPT-2's N(0, 0.02 / sqrt(2 · n_layer)). Unset:
    model.arch's."""
    logit_softcap: float = 0.0
    """Squash the logits into (-cap, cap) as cap · tanh(logits / cap) (modded-nanogpt and nanochat
    use 15 to 30); 0: off."""
    n_kv_head: int = 0
    """Key and value heads, each shared by n_head / n_kv_head query heads (grouped-query
    attention, as most small open models); 0: n_head."""
    head_dim: int = 0
    """Width of every attention head; 0: n_embd / n_head (Qwen3's small models have wider
    heads)."""
    rope_theta: float = 10000.0
    """The rotary base: the i-th of a head's head_dim / 2 pairs turns by position ×
    rope_theta^(-2i / head_dim) radians."""
    norm_eps: float = 1e-5
    """The epsilon added to the variance (layernorm) or mean square (rmsnorm)."""
    doc_mask: bool | None = None
    """Attention stays inside each document of a row: a token attends to the earlier tokens of
    its own document only (documents begin at model.bos_id). Unset: on with data.align bos, off
    otherwise."""
    bos_id: int = -1
    """The token that begins a document, for model.doc_mask; -1: the dataset's end-of-text id
    (prepare places it before every document)."""
    attention: Attention = "auto"
    """How masked attention (model.doc_mask's documents; sampling's sliding band) is computed:
    sdpa (scaled_dot_product_attention with a dense (B, 1, T, T) mask, which computes every masked
    block) or flex (FlexAttention, torch >= 2.5: one block mask per batch, shared by every layer;
    the kernel skips the blocks it rules out; on a CPU its backward is ddpgpt's). Unmasked
    attention is SDPA's causal kernel either way, and the weights are the same: a run resumes
    with the other. auto: flex on CUDA; on a CPU flex for document-masked rows of 2,048 tokens
    or more, sdpa below (docs/performance.md, "Attention that skips what it masks")."""
    kernels: Kernels = "eager"
    """How a training step on a CPU runs the elementwise work around the matrix products: eager
    (torch's ops, a pass over the activations each) or compiled (RMSNorm, QK-norm with the rotary
    turn, SwiGLU's or ReLU²'s activation and the cross-entropy each one torch.compile kernel
    forward and one backward: a few seconds of the system's C compiler at the first step, cached
    for later runs; where it cannot build them, one line says so and eager runs). Evaluation,
    sampling, CUDA and a compiled model (run.compile) run eager's. The same numbers to rounding:
    a run resumes with either (docs/performance.md, "The step")."""
    dropout: float = 0.0
    """Dropout probability on attention, residual and embedding outputs (0 for pretraining)."""
    gelu: Gelu = "tanh"
    """The MLP's GELU (model.mlp gelu): tanh (its tanh approximation, GPT-2's gelu_new) or exact
    (erf, as nn.GELU and nanoGPT; on a CPU about half the time of tanh's)."""
    vocab_limit: int = 0
    """Ids from this one up to vocab_size are padding and get a logit of -inf: never predicted,
    never trained. 0: every row is live (a fresh model learns to avoid its padding rows).
    --init-from sets it to the weights' vocabulary."""
    init_from: str = field(default="", metadata={"alias": "--init-from"})
    """Start from pretrained weights instead of a random init: gpt2, gpt2-medium, gpt2-large,
    gpt2-xl (Hugging Face hub), a transformers directory (GPT-2, Llama, Qwen3 or Apertus),
    .safetensors file, or a ddpgpt run or checkpoint. The shape comes from the weights (the
    vocabulary grows by the chat template's tokens); a resume uses its own checkpoints."""

    def __post_init__(self):
        _finite(self, "model.")
        for name, choices in (("arch", Arch), ("norm", Norm), ("mlp", Mlp),
                              ("attention", Attention),
                              ("kernels", Kernels)):
            if getattr(self, name) is not None:
                _choice("model", name, getattr(self, name), get_args(choices))
        for name in ("n_layer", "n_head", "n_embd", "block_size"):
            _require(getattr(self, name) >= 1, f"model.{name} = {getattr(self, name)} must be >= 1")
        _require(self.vocab_size >= 0,
                 f"model.vocab_size = {self.vocab_size} must be >= 0 (0: from the dataset)")
        for name in ("mlp_hidden", "n_kv_head", "head_dim"):
            _require(getattr(self, name) >= 0,
                     f"model.{name} = {getattr(self, name)} must be >= 0 (0: the default)")
        _require(self.head_dim or self.n_embd % self.n_head == 0,
                 f"model.n_head = {self.n_head} must divide model.n_embd = {self.n_embd}")
        _require(self.n_head % self.kv_heads == 0,
                 f"model.n_kv_head = {self.n_kv_head} must divide model.n_head = {self.n_head}")
        _require(not self.piece("rope") or self.head_width % 2 == 0,
                 f"rotary positions turn pairs of dimensions: the head width {self.head_width} "
                 "(model.n_embd / model.n_head, or model.head_dim) must be even")
        _require(0 <= self.dropout < 1, f"model.dropout = {self.dropout} must be in [0, 1)")
        _choice("model", "gelu", self.gelu, Gelu)
        _require(self.logit_softcap >= 0,
                 f"model.logit_softcap = {self.logit_softcap:g} must be >= 0 (0: off)")
        _require(self.rope_theta > 0, f"model.rope_theta = {self.rope_theta:g} must be > 0")
        _require(self.norm_eps > 0, f"model.norm_eps = {self.norm_eps:g} must be > 0")
        _require(self.bos_id >= -1,
                 f"model.bos_id = {self.bos_id} must be >= 0, or -1 (the dataset's end-of-text)")
        _require(self.vocab_limit >= 0 and (not self.vocab_size
                                            or self.vocab_limit <= self.vocab_size),
                 f"model.vocab_limit = {self.vocab_limit} must be in [0, model.vocab_size = "
                 f"{self.vocab_size}]")

    def piece(self, name: str):
        """The piece `name` as set, or else model.arch's."""
        value = getattr(self, name)
        return getattr(ARCHS[self.arch], name) if value is None else value

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_width(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    def resolved(self) -> ModelConfig:
        """Every piece and width set: the arch's pieces where unset, and mlp_hidden, n_kv_head
        and head_dim where 0 (what config.json records)."""
        mlp = self.piece("mlp")
        hidden = self.mlp_hidden or (-(-8 * self.n_embd // 96) * 32 if mlp == "swiglu"
                                     else 4 * self.n_embd)
        return dataclasses.replace(self, **{name: self.piece(name) for name in PIECES},
                                   mlp_hidden=hidden, n_kv_head=self.kv_heads,
                                   head_dim=self.head_width)
