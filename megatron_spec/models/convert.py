"""HF <-> Megatron weight layouts for Llama-family decoders, for any tensor-parallel size.

One :class:`ParamRule` per Megatron parameter says which HF tensors it is made of, along
which dimension tensor parallelism splits it, and how to go between the two layouts on the
*gathered* (full) tensor:

* ``linear_qkv``: Megatron fuses q, k, v per query group: for each group g the rows are
  ``[q heads of g (nq/ng * d), k_g (d), v_g (d)]``. A TP rank holds whole groups, so the
  gathered tensor is the plain concatenation of the rank shards.
* ``linear_fc1``: each rank holds ``[gate_r; up_r]``; the gathered tensor is therefore
  ``[gate_0; up_0; gate_1; up_1; ...]`` and depends on the TP size it was gathered from.
* embeddings and the output layer are split along the (padded) vocabulary; padding rows
  are zero on load and dropped on export.

``to_hf_views`` gives each HF tensor as a *view* of the gathered tensor whose row-major
element order is the HF tensor's (its shape may be blocked, e.g. ``[groups, rows, H]`` for
q/k/v, or ``[H, tp, K/tp]`` for a gather along dimension 1); ``to_hf`` materialises those
views as contiguous HF-shaped tensors. Weight streaming copies the views straight into a
bucket, so no per-tensor copy is made on the way.

The same rules serve checkpoint loading, export and weight streaming to the rollout
engine (which gathers one parameter at a time, see ``iter_hf_tensors``). Names follow the
local layer spec; TransformerEngine names (norms fused into ``linear_qkv`` / ``linear_fc1``)
are mapped to them by :func:`canonical_name`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping

import torch

from megatron_spec.models.checkpoint import CheckpointError, is_weight_name
from megatron_spec.models.hf_config import DecoderConfig

_TE_TO_LOCAL = (
    (re.compile(r"^(decoder\.layers\.\d+)\.self_attention\.linear_qkv\.layer_norm_weight$"),
     r"\1.input_layernorm.weight"),
    (re.compile(r"^(decoder\.layers\.\d+)\.mlp\.linear_fc1\.layer_norm_weight$"),
     r"\1.pre_mlp_layernorm.weight"),
)


def canonical_name(name: str) -> str:
    """Megatron parameter name in local-spec form (TE fused-norm names mapped, wrappers stripped)."""
    while name.startswith("module."):
        name = name[len("module."):]
    for pattern, repl in _TE_TO_LOCAL:
        if pattern.match(name):
            return pattern.sub(repl, name)
    return name


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """Megatron-LM's rule: pad the vocabulary to a multiple of ``divisible_by * tp_size``."""
    multiple = max(1, divisible_by) * tp_size
    return -(-vocab_size // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class ParamRule:
    """How one Megatron parameter maps onto HF tensors."""

    megatron_name: str
    hf_names: tuple[str, ...]
    partition_dim: int | None
    """Dimension tensor parallelism splits (None: replicated on every TP rank)."""
    full_shape: tuple[int, ...]
    """Shape of the gathered Megatron tensor (padded vocabulary included)."""
    to_hf: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    from_hf: Callable[[Mapping[str, torch.Tensor]], torch.Tensor]
    to_hf_views: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None = None
    """Like ``to_hf`` but views in HF element order (blocked shapes allowed, no copies)."""

    def shard_shape(self, tp_size: int) -> tuple[int, ...]:
        shape = list(self.full_shape)
        if self.partition_dim is not None:
            shape[self.partition_dim] //= tp_size
        return tuple(shape)


def _materialise(views: Callable[[torch.Tensor], dict[str, torch.Tensor]],
                 shapes: Mapping[str, tuple[int, ...]]) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
    """``to_hf`` from ``to_hf_views``: reshape each view to its HF shape, contiguous."""
    def to_hf(full: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: v.reshape(shapes[name]).contiguous() for name, v in views(full).items()}

    return to_hf


def _qkv_rules(cfg: DecoderConfig, prefix: str, hf: str, bias: bool) -> ParamRule:
    ng, d, h = cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    qpg = cfg.num_attention_heads // ng  # query heads per group
    suffix = "bias" if bias else "weight"
    names = tuple(f"{hf}.self_attn.{p}_proj.{suffix}" for p in "qkv")
    tail = () if bias else (h,)

    def from_hf(t: Mapping[str, torch.Tensor]) -> torch.Tensor:
        q = t[names[0]].reshape(ng, qpg * d, *tail)
        k = t[names[1]].reshape(ng, d, *tail)
        v = t[names[2]].reshape(ng, d, *tail)
        return torch.cat([q, k, v], dim=1).reshape(ng * (qpg + 2) * d, *tail)  # [ng*(qpg+2)*d, H]

    def views(full: torch.Tensor) -> dict[str, torch.Tensor]:
        grouped = full.reshape(ng, (qpg + 2) * d, *tail)
        q, k, v = torch.split(grouped, [qpg * d, d, d], dim=1)  # [ng, rows, H] each, HF row order
        return {names[0]: q, names[1]: k, names[2]: v}

    shapes = {names[0]: (ng * qpg * d, *tail), names[1]: (ng * d, *tail), names[2]: (ng * d, *tail)}
    return ParamRule(f"{prefix}.self_attention.linear_qkv.{suffix}", names, 0,
                     (ng * (qpg + 2) * d, *tail), _materialise(views, shapes), from_hf, views)


def _fc1_rule(cfg: DecoderConfig, prefix: str, hf: str, tp_size: int) -> ParamRule:
    f, h = cfg.intermediate_size, cfg.hidden_size
    names = (f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight")

    def from_hf(t: Mapping[str, torch.Tensor]) -> torch.Tensor:
        gate = t[names[0]].reshape(tp_size, f // tp_size, h)
        up = t[names[1]].reshape(tp_size, f // tp_size, h)
        return torch.cat([gate, up], dim=1).reshape(2 * f, h)  # [gate_0; up_0; gate_1; up_1; ...]

    def views(full: torch.Tensor) -> dict[str, torch.Tensor]:
        per_rank = full.reshape(tp_size, 2, f // tp_size, h)
        return {names[0]: per_rank[:, 0], names[1]: per_rank[:, 1]}  # [tp, f/tp, h], HF row order

    shapes = {names[0]: (f, h), names[1]: (f, h)}
    return ParamRule(f"{prefix}.mlp.linear_fc1.weight", names, 0, (2 * f, h), _materialise(views, shapes),
                     from_hf, views)


def _copy_rule(meg: str, hf: str, shape: tuple[int, ...], partition_dim: int | None) -> ParamRule:
    def views(full: torch.Tensor) -> dict[str, torch.Tensor]:
        return {hf: full}  # may be blocked [N, tp, K/tp] when gathered along dimension 1

    return ParamRule(
        meg, (hf,), partition_dim, shape, _materialise(views, {hf: shape}), lambda t: t[hf], views
    )


def _vocab_rule(meg: str, hf: str, cfg: DecoderConfig, padded_vocab: int) -> ParamRule:
    v, h = cfg.vocab_size, cfg.hidden_size

    def from_hf(t: Mapping[str, torch.Tensor]) -> torch.Tensor:
        w = t[hf]
        if padded_vocab == v:
            return w
        return torch.cat([w, w.new_zeros(padded_vocab - v, h)], dim=0)

    def views(full: torch.Tensor) -> dict[str, torch.Tensor]:
        return {hf: full[:v]}  # padded rows dropped

    return ParamRule(meg, (hf,), 0, (padded_vocab, h), _materialise(views, {hf: (v, h)}), from_hf, views)


def megatron_rules(cfg: DecoderConfig, tp_size: int, padded_vocab: int) -> dict[str, ParamRule]:
    """Every Megatron (local-spec) parameter of ``cfg``'s GPTModel and its HF mapping."""
    cfg.check_tensor_parallel(tp_size)
    h, d = cfg.hidden_size, cfg.head_dim
    rules: list[ParamRule] = [
        _vocab_rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", cfg, padded_vocab),
        _copy_rule("decoder.final_layernorm.weight", "model.norm.weight", (h,), None),
    ]
    if not cfg.tie_word_embeddings:
        rules.append(_vocab_rule("output_layer.weight", "lm_head.weight", cfg, padded_vocab))
    for i in range(cfg.num_layers):
        p, hf = f"decoder.layers.{i}", f"model.layers.{i}"
        rules += [
            _copy_rule(f"{p}.input_layernorm.weight", f"{hf}.input_layernorm.weight", (h,), None),
            _qkv_rules(cfg, p, hf, bias=False),
            _copy_rule(f"{p}.self_attention.linear_proj.weight", f"{hf}.self_attn.o_proj.weight",
                       (h, cfg.q_size), 1),
            _copy_rule(f"{p}.pre_mlp_layernorm.weight", f"{hf}.post_attention_layernorm.weight", (h,), None),
            _fc1_rule(cfg, p, hf, tp_size),
            _copy_rule(f"{p}.mlp.linear_fc2.weight", f"{hf}.mlp.down_proj.weight",
                       (h, cfg.intermediate_size), 1),
        ]
        if cfg.qkv_bias:
            rules.append(_qkv_rules(cfg, p, hf, bias=True))
        if cfg.qk_norm:
            rules += [
                _copy_rule(
                    f"{p}.self_attention.q_layernorm.weight", f"{hf}.self_attn.q_norm.weight", (d,), None
                ),
                _copy_rule(
                    f"{p}.self_attention.k_layernorm.weight", f"{hf}.self_attn.k_norm.weight", (d,), None
                ),
            ]
    return {r.megatron_name: r for r in rules}


def expected_hf_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a checkpoint of ``cfg``."""
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        hf = f"model.layers.{i}"
        shapes.update({
            f"{hf}.input_layernorm.weight": (h,),
            f"{hf}.post_attention_layernorm.weight": (h,),
            f"{hf}.self_attn.q_proj.weight": (cfg.q_size, h),
            f"{hf}.self_attn.k_proj.weight": (cfg.kv_size, h),
            f"{hf}.self_attn.v_proj.weight": (cfg.kv_size, h),
            f"{hf}.self_attn.o_proj.weight": (h, cfg.q_size),
            f"{hf}.mlp.gate_proj.weight": (f, h),
            f"{hf}.mlp.up_proj.weight": (f, h),
            f"{hf}.mlp.down_proj.weight": (h, f),
        })
        if cfg.qkv_bias:
            shapes.update({f"{hf}.self_attn.q_proj.bias": (cfg.q_size,),
                           f"{hf}.self_attn.k_proj.bias": (cfg.kv_size,),
                           f"{hf}.self_attn.v_proj.bias": (cfg.kv_size,)})
        if cfg.qk_norm:
            shapes.update({f"{hf}.self_attn.q_norm.weight": (d,), f"{hf}.self_attn.k_norm.weight": (d,)})
    return shapes


def validate_hf_names(cfg: DecoderConfig, available: Mapping[str, tuple[int, ...]], source: str) -> list[str]:
    """Check an HF tensor set against ``cfg``: missing, misshapen or unknown tensors raise.

    Returns the names that are ignored on purpose (rotary caches; ``lm_head.weight`` of a
    tied model, which must then equal the embedding), so callers can log them.
    """
    expected = expected_hf_shapes(cfg)
    missing = sorted(set(expected) - set(available))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: tensor {missing[0]} missing{more}")
    for name, shape in expected.items():
        if tuple(available[name]) != shape:
            raise CheckpointError(f"{source}: tensor {name} has shape {tuple(available[name])}, "
                                  f"expected {shape} from config.json")
    ignored, unknown = [], []
    for name in sorted(set(available) - set(expected)):
        if not is_weight_name(name, cfg.tie_word_embeddings):
            ignored.append(name)
        else:
            unknown.append(name)
    if unknown:
        raise CheckpointError(f"{source}: unexpected tensor {unknown[0]} for {cfg.architecture}"
                              + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    return ignored


def shard(full: torch.Tensor, rule: ParamRule, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's slice of a gathered Megatron tensor."""
    if rule.partition_dim is None or tp_size == 1:
        return full
    return torch.chunk(full, tp_size, dim=rule.partition_dim)[tp_rank]


def hf_to_megatron_shards(
    cfg: DecoderConfig,
    get_hf: Callable[[str], torch.Tensor],
    param_names: list[str],
    tp_rank: int,
    tp_size: int,
    padded_vocab: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(megatron_name, this rank's shard)`` for each name in ``param_names``."""
    rules = megatron_rules(cfg, tp_size, padded_vocab)
    for name in param_names:
        rule = rules.get(canonical_name(name))
        if rule is None:
            raise CheckpointError(f"Megatron parameter {name} has no HF counterpart for {cfg.architecture}")
        full = rule.from_hf({n: get_hf(n) for n in rule.hf_names})
        if tuple(full.shape) != rule.full_shape:
            raise CheckpointError(f"{name}: built shape {tuple(full.shape)} != expected {rule.full_shape}")
        yield name, shard(full, rule, tp_rank, tp_size)
