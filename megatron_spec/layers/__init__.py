"""Inference layers the native rollout engine and the draft heads both stand on.

- :mod:`.linear`: :class:`Linear` (weight stored transposed, optional oneDNN-prepacked copy),
  :class:`TiedLinear` (the same over a table another module owns: a tied LM head),
  :func:`pack_linears`, :func:`warm_linears`.
- :mod:`.kv_cache`: :class:`KVCache` (preallocated, slot-based), :func:`read_length` (cache
  lengths read in buckets), :func:`attention_mask`.
- :mod:`.decoder`: :class:`RMSNorm`, :class:`Rotary`, :class:`Attention` (GQA over the slot
  cache through :func:`attend`: the extension's fp32 kernel on CPU, else torch's fused kernel or
  :func:`gqa_attention` as :func:`use_fused_attention` picks),
  :class:`MLP`, :class:`DecoderLayer` (one or several row segments per forward), :func:`gather_rows`.
- :mod:`.fused_layers`: :func:`fused_stack` (when a stack of decoder layers may run as the extension's
  ``megatron_spec::decoder_layers``, and that call's arguments).

The target model (``megatron_spec.rollout.native.model``) and the drafters
(``megatron_spec.draft``) import these; this package imports neither, nor anything about
requests, sampling, weight names or drafting.
"""
