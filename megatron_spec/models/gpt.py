"""Build a megatron-core ``GPTModel`` from an HF decoder config; load and export HF weights.

* :func:`build_gpt_model`: TransformerConfig + layer spec (TransformerEngine when TE imports
  and CUDA exists, megatron-core's local spec otherwise) + GPTModel with RoPE.
* :func:`load_hf_weights`: fill this rank's shards from an HF checkpoint (lazy reads).
* :func:`iter_hf_tensors` / :func:`export_hf_state_dict`: gather shards across the TP group
  one parameter at a time and yield HF-named full tensors (checkpoint export);
  :func:`iter_hf_views` yields the same tensors as views, without per-tensor copies (weight
  streaming packs them straight into buckets).

The vocabulary is padded Megatron-style; padded logits are masked by the log-prob code
(``megatron_spec.capture.logprobs``) and padded rows are dropped on export.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_spec.compat import ensure_megatron_compat
from megatron_spec.models.checkpoint import CheckpointError, HFCheckpoint
from megatron_spec.models.convert import (
    canonical_name,
    hf_to_megatron_shards,
    megatron_rules,
    padded_vocab_size,
    validate_hf_names,
)
from megatron_spec.models.hf_config import DecoderConfig

logger = logging.getLogger(__name__)


def te_available() -> bool:
    """TransformerEngine imports and a CUDA device exists."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401 (imported to learn whether it is installed)
    except Exception:  # TE raises OSError/RuntimeError too when its CUDA libs are missing
        return False
    return True


def default_model_device() -> torch.device:
    """The current CUDA device when there is one (``init_parallel`` sets it per local rank), else the CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def transformer_config(cfg: DecoderConfig, *, tp_size: int, params_dtype: torch.dtype = torch.float32,
                       sequence_parallel: bool = False, mtp_num_layers: int | None = None, **overrides):
    """megatron-core TransformerConfig for ``cfg`` (dropout off: RL log-probs must be exact)."""
    ensure_megatron_compat()
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg.check_tensor_parallel(tp_size)
    if params_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"params_dtype must be float32 or bfloat16, got {params_dtype}")
    kwargs = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_kv_heads,
        kv_channels=cfg.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.qkv_bias,
        qk_layernorm=cfg.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        sequence_parallel=sequence_parallel and tp_size > 1,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        # the whole layer, megatron-core's default said its current way (not the deprecated "full")
        cuda_graph_scope=[],
    )
    if mtp_num_layers:
        kwargs["mtp_num_layers"] = mtp_num_layers
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt_model(
    cfg: DecoderConfig,
    *,
    tp_size: int | None = None,
    params_dtype: torch.dtype = torch.float32,
    use_te: bool | None = None,
    vocab_divisible_by: int = 128,
    sequence_parallel: bool = False,
    mtp_num_layers: int | None = None,
    device: torch.device | str | None = None,
):
    """A GPTModel for ``cfg`` on this rank (parallel state must be initialised), every parameter and
    buffer on ``device``.

    Args:
        tp_size: defaults to megatron-core's current tensor-parallel size.
        device: where the model lives; None: the current CUDA device when there is one, else the CPU.
            megatron-core creates its linear weights on the current CUDA device
            (``use_cpu_initialization=False``) but the local spec's norms (``torch.nn.RMSNorm`` behind
            ``WrappedTorchNorm``) on the CPU, so the model is moved as a whole, as Megatron-LM's
            ``get_model`` does with ``model.cuda()``. (RoPE's ``inv_freq`` is a plain attribute, made on
            the current CUDA device and moved there by megatron-core's own forward.)
        use_te: force the TransformerEngine (True) or local (False) layer spec; None picks TE
            when it imports and CUDA exists.
        vocab_divisible_by: Megatron-LM's ``--make-vocab-size-divisible-by``.
    """
    ensure_megatron_compat()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    tp = tp_size or ps.get_tensor_model_parallel_world_size()
    if use_te is None:
        use_te = te_available()
    elif use_te and not te_available():
        raise RuntimeError("use_te=True but TransformerEngine is not importable or CUDA is absent")
    tcfg = transformer_config(cfg, tp_size=tp, params_dtype=params_dtype,
                              sequence_parallel=sequence_parallel, mtp_num_layers=mtp_num_layers)
    if use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.qk_norm)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=cfg.qk_norm, normalization="RMSNorm")
    mtp_spec = None
    if mtp_num_layers:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        mtp_spec = get_gpt_mtp_block_spec(tcfg, spec, use_transformer_engine=use_te)
    if float(int(cfg.rope_theta)) != cfg.rope_theta:
        raise ValueError(
            f"rope_theta {cfg.rope_theta} is not an integer; megatron-core takes an int rotary_base"
        )
    padded = padded_vocab_size(cfg.vocab_size, tp, vocab_divisible_by)
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=spec,
        vocab_size=padded,
        max_sequence_length=cfg.max_position_embeddings,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(cfg.rope_theta),
        rope_scaling=cfg.rope_scaling_factor is not None,
        rope_scaling_factor=cfg.rope_scaling_factor or 8.0,
        mtp_block_spec=mtp_spec,
    )
    model.to(default_model_device() if device is None else device)
    model.decoder_config = cfg  # the HF-side description travels with the model
    model.true_vocab_size = cfg.vocab_size
    logger.debug("built GPTModel %s (TP=%d, %s spec, padded vocab %d)", cfg.architecture, tp,
                 "TE" if use_te else "local", padded)
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _policy_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, param) of the policy proper: MTP heads are streamed and loaded separately."""
    return [(n, p) for n, p in unwrap(model).named_parameters() if not n.startswith("mtp.")]


def load_hf_weights(model: torch.nn.Module, ckpt: HFCheckpoint | str) -> None:
    """Copy this TP rank's shards of an HF checkpoint into ``model`` (in place, no grad)."""
    from megatron.core import parallel_state as ps

    ckpt = ckpt if isinstance(ckpt, HFCheckpoint) else HFCheckpoint(ckpt)
    gpt = unwrap(model)
    cfg: DecoderConfig = gpt.decoder_config
    ckpt_cfg = ckpt.decoder_config
    if ckpt_cfg != cfg:
        diff = [k for k, v in cfg.to_dict().items() if ckpt_cfg.to_dict()[k] != v]
        raise CheckpointError(f"{ckpt.path}: config.json differs from the model's config in {diff}")
    ignored = validate_hf_names(cfg, {n: ckpt.shape(n) for n in ckpt.names()}, ckpt.path)
    if ignored:
        logger.info("ignoring HF tensors that carry no weights: %s", ignored)
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    params = dict(_policy_params(model))
    padded = gpt.vocab_size
    with torch.no_grad():
        for name, shard in hf_to_megatron_shards(cfg, ckpt.get, list(params), tp_rank, tp_size, padded):
            param = params[name]
            if tuple(shard.shape) != tuple(param.shape):
                raise CheckpointError(f"{name}: shard shape {tuple(shard.shape)} != parameter shape "
                                      f"{tuple(param.shape)} at TP={tp_size}")
            param.copy_(shard.to(param.dtype))


_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gather(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """Every rank's shard joined along ``dim`` in one buffer (one collective, no concatenation copy).

    For ``dim > 0`` the result is a view of shape ``[..., size, n_dim, ...]`` whose row-major
    order is that of ``torch.cat(shards, dim)``; ``reshape`` it to get the plain layout.
    """
    if size == 1:
        return tensor
    shard = tensor.contiguous()
    out = shard.new_empty((size * shard.shape[0], *shard.shape[1:]))  # shards stacked along dim 0
    _all_gather_single(out, shard, group=group)
    if dim == 0:
        return out
    return out.view(size, *shard.shape).movedim(0, dim)  # [..., tp, n_dim, ...]


def _stream_order(params: list[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters outside the decoder layers (embedding, final norm, output layer) moved to
    the middle of the list: a pipelined stream then starts and ends on small layer tensors
    (its first bucket is packed and its last one loaded with nothing overlapping them)."""
    inner = [(n, p) for n, p in params if ".layers." in n]
    outer = [(n, p) for n, p in params if ".layers." not in n]
    mid = len(inner) // 2
    return inner[:mid] + outer + inner[mid:]


def iter_hf_views(model: torch.nn.Module, tp_group: dist.ProcessGroup | None = None,
                  dtype: torch.dtype | None = None, *, stream_order: bool = False
                  ) -> Iterator[tuple[str, torch.Tensor, tuple[int, ...]]]:
    """Yield ``(hf_name, view, hf_shape)`` for every policy weight, gathering one parameter at a time.

    ``view`` holds the HF tensor's elements in row-major order but may have a blocked shape
    and strides (a view of the parameter at TP=1, of the gathered buffer otherwise); copy it
    with ``dst.view(view.shape).copy_(view)`` into a ``hf_shape`` destination. Valid until
    the next iteration. Collective over the TP group exactly like :func:`iter_hf_tensors`
    (the same gathers in the same order), so ranks may mix the two; with ``stream_order``
    (every rank of the group must pass the same) the order is :func:`_stream_order`'s.
    """
    from megatron.core import parallel_state as ps

    from megatron_spec.models.convert import expected_hf_shapes

    gpt = unwrap(model)
    cfg: DecoderConfig = gpt.decoder_config
    group = tp_group or ps.get_tensor_model_parallel_group()
    tp_size = dist.get_world_size(group) if dist.is_initialized() else 1
    rules = megatron_rules(cfg, tp_size, gpt.vocab_size)
    shapes = expected_hf_shapes(cfg)
    with torch.no_grad():
        params = _policy_params(model)
        for name, param in _stream_order(params) if stream_order else params:
            rule = rules.get(canonical_name(name))
            if rule is None:
                raise CheckpointError(f"Megatron parameter {name} has no HF counterpart")
            data = param.detach()
            if dtype is not None:
                data = data.to(dtype)
            full = data if rule.partition_dim is None else _gather(data, rule.partition_dim, group, tp_size)
            for hf_name, view in rule.to_hf_views(full).items():
                yield hf_name, view, shapes[hf_name]


def iter_hf_tensors(model: torch.nn.Module, tp_group: dist.ProcessGroup | None = None,
                    dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for every policy weight, gathering one parameter at a time.

    Collective over the TP group: every TP rank must iterate to the end. Peak extra memory
    is one gathered parameter (plus one HF tensor where the layouts differ).
    """
    for name, view, shape in iter_hf_views(model, tp_group, dtype):
        yield name, view.reshape(shape).contiguous()


def export_hf_state_dict(
    model: torch.nn.Module, tp_group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """All policy weights as an HF state dict (collective over the TP group)."""
    return dict(iter_hf_tensors(model, tp_group))
