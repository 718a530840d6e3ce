"""Model profiles: parameter counts, active parameters, KV-cache bytes and attention FLOPs.

Built from Hugging Face ``config.json`` fields, for the built-in names (copied from the public
configs on the Hugging Face hub) or any config file. Families understood: dense GQA decoders
(Llama, Qwen2/Qwen3), Qwen3-MoE, and DeepSeek-V3 (MLA attention, shared + routed experts,
MTP layers). Draft profiles (EAGLE-3 head, MTP module, small draft model) are derived here too.

What it does not know: tensor shapes beyond these counts (no weights are read), sliding-window
or linear attention, vision towers, quantisation beyond bytes per weight.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Public config.json fields (huggingface.co/<repo>/blob/main/config.json), only those used here.
_BUILTIN_CONFIGS: dict[str, dict] = {
    # Qwen/Qwen3-8B
    "qwen3-8b": {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "intermediate_size": 12288, "vocab_size": 151936, "tie_word_embeddings": False},
    # Qwen/Qwen3-32B
    "qwen3-32b": {"model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 64,
                  "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                  "intermediate_size": 25600, "vocab_size": 151936, "tie_word_embeddings": False},
    # Qwen/Qwen3-235B-A22B (every layer MoE: decoder_sparse_step 1, mlp_only_layers [])
    "qwen3-235b-a22b": {"model_type": "qwen3_moe", "hidden_size": 4096, "num_hidden_layers": 94,
                        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
                        "intermediate_size": 12288, "moe_intermediate_size": 1536,
                        "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
                        "mlp_only_layers": [], "vocab_size": 151936, "tie_word_embeddings": False},
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8,
                     "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False},
    # meta-llama/Llama-3.1-70B
    "llama-3.1-70b": {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80,
                      "num_attention_heads": 64, "num_key_value_heads": 8,
                      "intermediate_size": 28672, "vocab_size": 128256, "tie_word_embeddings": False},
    # deepseek-ai/DeepSeek-V3
    "deepseek-v3": {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
                    "num_attention_heads": 128, "num_key_value_heads": 128,
                    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
                    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
                    "num_nextn_predict_layers": 1, "vocab_size": 129280, "tie_word_embeddings": False},
    # XiaomiMiMo/MiMo-7B-RL (Qwen2-style with qkv bias; one MTP layer). Shapes as in
    # THUDM/slime scripts/models/mimo-7B-rl.sh (the Megatron args of the HF config).
    "mimo-7b": {"model_type": "mimo", "hidden_size": 4096, "num_hidden_layers": 36,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                "intermediate_size": 11008, "vocab_size": 151680, "tie_word_embeddings": False,
                "num_nextn_predict_layers": 1},
    # Qwen/Qwen3.5-9B text model: 32 layers, every 4th full (gated) attention with 16 query and
    # 4 KV heads of 256, the rest Gated DeltaNet (32 value heads x 128 x 128 state), one MTP layer.
    "qwen3.5-9b": {"model_type": "qwen3_5", "hidden_size": 4096, "num_hidden_layers": 32,
                   "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
                   "intermediate_size": 12288, "vocab_size": 248320, "tie_word_embeddings": False,
                   "full_attention_interval": 4, "linear_num_value_heads": 32, "linear_num_key_heads": 16,
                   "linear_key_head_dim": 128, "linear_value_head_dim": 128, "mtp_num_hidden_layers": 1},
    # Small same-tokenizer draft models. Qwen/Qwen3-0.6B, meta-llama/Llama-3.2-1B.
    "qwen3-0.6b": {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True},
    "llama-3.2-1b": {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                     "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True},
}

MODEL_NAMES = tuple(_BUILTIN_CONFIGS)

#: default external draft model per family (same tokenizer), for ``--draft-kind model``.
DEFAULT_DRAFT_MODEL = {"qwen3": "qwen3-0.6b", "qwen3_moe": "qwen3-0.6b", "qwen2": "qwen3-0.6b",
                       "llama": "llama-3.2-1b"}

#: EAGLE-3 heads usually predict over a reduced vocabulary (ModelOpt / SpecForge default 32000).
EAGLE3_DRAFT_VOCAB = 32000


@dataclass(frozen=True)
class ModelProfile:
    """Counts derived from one decoder-only config. All parameter counts are in elements."""

    name: str
    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int  # dense MLP width (dense layers; EAGLE-3 head width)
    tie_embeddings: bool = False
    # MoE (num_experts 0: dense)
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate: int = 0
    shared_experts: int = 0
    moe_layers: int = 0
    # MLA (kv_lora_rank 0: standard multi-head / grouped-query attention)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mtp_layers: int = 0
    extra_gemm_calls: int = 0  # GEMMs per forward beyond the decoder's (EAGLE-3's fc)
    # Hybrid linear-attention models (Qwen3.5 / Qwen3-Next Gated DeltaNet): only ``attn_layers``
    # layers keep a KV cache (0: every layer does); the others carry a fixed-size recurrent state
    # of ``linear_state_elems`` elements per sequence in all (heads x key dim x value dim x layers).
    # Their projections are counted as the attention shape above (within ~15% for Qwen3.5).
    attn_layers: int = 0
    linear_state_elems: int = 0

    def __post_init__(self) -> None:
        for field_name in ("hidden", "layers", "heads", "kv_heads", "head_dim", "vocab"):
            if getattr(self, field_name) <= 0:
                raise ValueError(f"model {self.name!r}: {field_name}={getattr(self, field_name)} must be > 0")
        if self.num_experts and not 0 < self.experts_per_tok <= self.num_experts:
            raise ValueError(f"model {self.name!r}: experts_per_tok={self.experts_per_tok} must be in "
                             f"[1, num_experts={self.num_experts}]")
        if not 0 <= self.moe_layers <= self.layers:
            raise ValueError(f"model {self.name!r}: moe_layers={self.moe_layers} not in [0, {self.layers}]")

    # ---- structure -------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and self.moe_layers > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kv_layers(self) -> int:
        """Layers with softmax attention over a KV cache."""
        return self.attn_layers or self.layers

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def attn_params_per_layer(self) -> int:
        h = self.hidden
        if self.is_mla:
            qk_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank * self.heads * qk_dim if self.q_lora_rank
                 else h * self.heads * qk_dim)
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv_b = self.kv_lora_rank * self.heads * (self.qk_nope_head_dim + self.v_head_dim)
            o = self.heads * self.v_head_dim * h
            return q + kv_a + kv_b + o
        q_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * q_dim + 2 * h * kv_dim + q_dim * h

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate  # gate, up, down (SwiGLU)

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate

    @property
    def router_params(self) -> int:
        return self.hidden * self.num_experts

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden  # tied or not, the head is read and multiplied

    @property
    def gemm_calls_per_forward(self) -> int:
        """Weight GEMMs one forward launches, routed experts aside: fused qkv and o per layer
        (MLA: its four projections), gate_up and down per dense MLP or shared expert, the
        router, the LM head. Matters where each call has a fixed cost (``gemm_call_s``, CPU)."""
        attn = 4 if self.is_mla else 2
        per_moe = 2 * self.shared_experts + 1
        return (self.layers * attn + self.dense_layers * 2 + self.moe_layers * per_moe + 1
                + self.extra_gemm_calls)

    # ---- totals ----------------------------------------------------------------------------
    @property
    def always_read_params(self) -> int:
        """Weights every forward reads regardless of batch: attention, dense MLPs, shared
        experts, routers and the LM head (not routed experts, not the embedding table)."""
        per_moe_layer = self.shared_experts * self.expert_params + self.router_params
        return (self.layers * self.attn_params_per_layer + self.dense_layers * self.dense_mlp_params
                + self.moe_layers * per_moe_layer + self.lm_head_params)

    @property
    def routed_expert_params(self) -> int:
        return self.moe_layers * self.num_experts * self.expert_params

    @property
    def total_params(self) -> int:
        embed = 0 if self.tie_embeddings else self.embed_params
        return self.always_read_params + self.routed_expert_params + embed

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies through (the N of 2N FLOPs per token)."""
        return self.always_read_params + self.moe_layers * self.experts_per_tok * self.expert_params

    # ---- KV cache and attention --------------------------------------------------------------
    def kv_bytes_per_token(self, kv_dtype_bytes: int = 2) -> int:
        if self.is_mla:  # MLA caches the compressed latent plus the shared rope key
            return self.kv_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * kv_dtype_bytes
        return self.kv_layers * 2 * self.kv_heads * self.head_dim * kv_dtype_bytes

    @property
    def kv_shard_limit(self) -> int:
        """Most ways the KV cache splits under TP (beyond it, heads are replicated)."""
        return 1 if self.is_mla else self.kv_heads

    @property
    def attn_flops_per_ctx(self) -> int:
        """FLOPs one query token spends per cached position (scores + weighted values)."""
        if self.is_mla:  # weight-absorbed MLA: scores over (latent + rope), values over latent
            return self.kv_layers * self.heads * 2 * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        return self.kv_layers * self.heads * 4 * self.head_dim

    def summary(self) -> dict:
        return {"name": self.name, "total_params": self.total_params, "active_params": self.active_params,
                "kv_bytes_per_token_bf16": self.kv_bytes_per_token(2), "moe": self.is_moe, "mla": self.is_mla}


def _get(cfg: dict, key: str, default=None, *, source: str):
    if key in cfg:
        return cfg[key]
    if default is None:
        raise ValueError(f"{source}: config has no {key!r}")
    return default


def profile_from_hf_config(cfg: dict, name: str = "custom") -> ModelProfile:
    """A :class:`ModelProfile` from the fields of a Hugging Face ``config.json``."""
    src = f"model {name!r}"
    if "text_config" in cfg and "hidden_size" not in cfg:  # multimodal wrappers
        cfg = cfg["text_config"]
    model_type = str(cfg.get("model_type", "llama"))
    hidden = int(_get(cfg, "hidden_size", source=src))
    layers = int(_get(cfg, "num_hidden_layers", source=src))
    heads = int(_get(cfg, "num_attention_heads", source=src))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    vocab = int(_get(cfg, "vocab_size", source=src))
    intermediate = int(cfg.get("intermediate_size") or 4 * hidden)
    kw: dict = {}
    num_experts = int(
        cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0
    )
    if num_experts:
        experts_per_tok = int(_get(cfg, "num_experts_per_tok", source=src))
        moe_intermediate = int(cfg.get("moe_intermediate_size") or intermediate)
        if "first_k_dense_replace" in cfg:  # DeepSeek
            freq = int(cfg.get("moe_layer_freq", 1))
            first = int(cfg["first_k_dense_replace"])
            moe_layers = sum(1 for i in range(layers) if i >= first and i % freq == 0)
        else:  # Qwen-MoE / Mixtral
            step = int(cfg.get("decoder_sparse_step", 1) or 1)
            dense_only = set(cfg.get("mlp_only_layers") or [])
            moe_layers = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
        shared = int(cfg.get("n_shared_experts") or 0)
        if not shared and cfg.get("shared_expert_intermediate_size"):
            shared = max(1, round(cfg["shared_expert_intermediate_size"] / moe_intermediate))
        kw.update(num_experts=num_experts, experts_per_tok=experts_per_tok,
                  moe_intermediate=moe_intermediate, shared_experts=shared, moe_layers=moe_layers)
    if cfg.get("kv_lora_rank"):
        kw.update(q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=int(cfg["kv_lora_rank"]),
                  qk_nope_head_dim=int(_get(cfg, "qk_nope_head_dim", source=src)),
                  qk_rope_head_dim=int(_get(cfg, "qk_rope_head_dim", source=src)),
                  v_head_dim=int(_get(cfg, "v_head_dim", source=src)))
    kw["mtp_layers"] = int(cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers") or 0)
    layer_types = cfg.get("layer_types")
    if layer_types or cfg.get("full_attention_interval"):
        full = (sum(1 for t in layer_types if t == "full_attention") if layer_types
                else layers // int(cfg["full_attention_interval"]))
        if 0 < full < layers:
            kw["attn_layers"] = full
            kw["linear_state_elems"] = (
                (layers - full)
                * int(_get(cfg, "linear_num_value_heads", source=src))
                * int(_get(cfg, "linear_key_head_dim", source=src))
                * int(_get(cfg, "linear_value_head_dim", source=src))
            )
    return ModelProfile(name=name, family=model_type, hidden=hidden, layers=layers, heads=heads,
                        kv_heads=kv_heads, head_dim=head_dim, vocab=vocab, intermediate=intermediate,
                        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), **kw)


def get_model(name_or_path: str) -> ModelProfile:
    """A built-in model by name (case-insensitive) or a path to an HF ``config.json``."""
    key = name_or_path.lower()
    if key in _BUILTIN_CONFIGS:
        return profile_from_hf_config(_BUILTIN_CONFIGS[key], name=key)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        if not path.exists():
            raise ValueError(f"model config {path} does not exist")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"model config {path} is not valid JSON: {err}") from None
        return profile_from_hf_config(cfg, name=str(path))
    raise ValueError(f"unknown model {name_or_path!r}; expected one of {', '.join(MODEL_NAMES)} "
                     "or a path to an HF config.json")


# ---- draft profiles ----------------------------------------------------------------------------
def eagle3_draft(target: ModelProfile, draft_vocab: int = EAGLE3_DRAFT_VOCAB) -> ModelProfile:
    """The EAGLE-3 head: one decoder layer whose q/k/v read [embed; hidden] (2H), an fc fusing
    three aux hidden states (3H -> H) and an LM head over the draft vocabulary. Modelled as a
    one-layer dense decoder with the target's attention shape; the 2H input and the fc are
    folded in by widening the MLP so the parameter count matches (see ``eagle3_extra_params``)."""
    h = target.hidden
    q_dim, kv_dim = target.heads * target.head_dim, target.kv_heads * target.head_dim
    extra = 3 * h * h + h * (q_dim + 2 * kv_dim)  # fc + the second H of the q/k/v inputs
    width = target.intermediate + extra // (3 * h)
    return ModelProfile(name=f"eagle3[{target.name}]", family="eagle3", hidden=h, layers=1,
                        heads=target.heads, kv_heads=target.kv_heads, head_dim=target.head_dim,
                        vocab=min(draft_vocab, target.vocab), intermediate=width, tie_embeddings=True,
                        extra_gemm_calls=1)


def mtp_draft(target: ModelProfile) -> ModelProfile:
    """The target's own MTP module (DeepSeek-V3 style): one full decoder layer of the target
    (MoE if the target is MoE), an eh_proj (2H -> H), and the target's LM head (shared)."""
    if target.mtp_layers <= 0:
        raise ValueError(f"model {target.name!r} has no MTP layers (num_nextn_predict_layers=0); "
                         "use --draft-kind eagle3, model or ngram")
    h = target.hidden
    moe = target.is_moe
    return ModelProfile(
        name=f"mtp[{target.name}]", family="mtp", hidden=h, layers=1, heads=target.heads,
        kv_heads=target.kv_heads, head_dim=target.head_dim, vocab=target.vocab,
        # eh_proj (2H x H) folded into the dense width of the one layer
        intermediate=(target.intermediate if not moe else 0) + (2 * h * h) // (3 * h),
        tie_embeddings=True,
        num_experts=target.num_experts if moe else 0, experts_per_tok=target.experts_per_tok if moe else 0,
        moe_intermediate=target.moe_intermediate if moe else 0,
        shared_experts=target.shared_experts if moe else 0, moe_layers=1 if moe else 0,
        q_lora_rank=target.q_lora_rank, kv_lora_rank=target.kv_lora_rank,
        qk_nope_head_dim=target.qk_nope_head_dim, qk_rope_head_dim=target.qk_rope_head_dim,
        v_head_dim=target.v_head_dim)


def draft_profile(kind: str, target: ModelProfile, draft_model: str | None = None) -> ModelProfile | None:
    """The draft network for ``kind`` (None for n-gram, which has no network)."""
    if kind == "eagle3":
        return eagle3_draft(target)
    if kind == "mtp":
        return mtp_draft(target)
    if kind == "ngram":
        return None
    if kind == "model":
        name = draft_model or DEFAULT_DRAFT_MODEL.get(target.family)
        if name is None:
            raise ValueError(f"no default draft model for family {target.family!r} of {target.name!r}; "
                             "pass --draft-model NAME|CONFIG.json")
        draft = get_model(name)
        if draft.vocab != target.vocab:
            raise ValueError(f"draft model {draft.name!r} vocab_size {draft.vocab} != target "
                             f"{target.name!r} vocab_size {target.vocab}: they must share a tokenizer")
        return draft
    raise ValueError(f"unknown draft kind {kind!r}; expected eagle3, mtp, model or ngram")
