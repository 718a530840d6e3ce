"""Issue 15, defect 11: the hidden states SGLang 0.5.23 feeds an EAGLE-3 draft for a ModelOpt export
are the ones our capture hooks train it on.

ModelOpt's ``eagle_aux_hidden_state_layer_ids`` means "the output of layer i". SGLang runs its own
``Qwen3ForCausalLM.set_eagle3_layers_to_capture`` on those ids (here: the real method, on a stand-in
for the built model, which needs CUDA layers): it stores ``i + 1``, and ``Qwen3Model.forward`` hands
layer ``j``'s capture to ``Qwen3DecoderLayer.forward``, which captures at the layer's entry
(``attn_boundary.prepare(..., capture=...)``): the input of layer ``i + 1`` = the output of layer i
(checked in the installed source below). vLLM 0.32 takes the ids literally, one layer early
(docs/serving_exports.md).
"""

from __future__ import annotations

import ast
import types

import pytest
import torch

from megatron_spec.capture import Capture, CaptureConfig
from megatron_spec.capture.config import default_aux_layer_ids
from tests.sync import sglang_support as ss

pytestmark = pytest.mark.sglang
pytest.importorskip("sglang")


def _layers_to_capture(cls, ids: list[int], num_layers: int) -> list[int]:
    model = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True),
                                  config=types.SimpleNamespace(num_hidden_layers=num_layers),
                                  model=types.SimpleNamespace())
    cls.set_eagle3_layers_to_capture(model, ids)
    assert model.capture_aux_hidden_states is True
    return model.model.layers_to_capture


def test_sglang_captures_layer_inputs_at_ids_plus_one():
    """The loop and the layer, read from the installed source: layer ``i`` gets the capture when
    ``i in self.layers_to_capture`` and captures its own input."""
    _, tree = ss.source("srt/models/qwen3.py")
    loop = ast.unparse(ss._method(ss._class(tree, "Qwen3Model"), "forward"))
    assert "capture_output=aux_hidden_states.capture if i in self.layers_to_capture else None" in loop
    assert "hidden_states = self.layers[i](" in loop
    layer = ss._method(ss._class(tree, "Qwen3DecoderLayer"), "forward")
    first = ast.unparse(layer.body[0])  # the first thing the layer does: its attention entry
    assert (
        first.startswith("hidden_states = self.attn_boundary.prepare(") and "capture=capture_output" in first
    )
    qwen3 = ss.srt()["sglang.srt.models.qwen3"].Qwen3ForCausalLM
    llama = ss.srt()["sglang.srt.models.llama"].LlamaForCausalLM
    assert _layers_to_capture(qwen3, [1, 3, 4], 8) == _layers_to_capture(llama, [1, 3, 4], 8) == [2, 4, 5]


def test_what_sglang_feeds_the_draft_is_what_we_train_it_on(policy, capture_target):
    import transformers

    cfg = policy.decoder_config
    aux_ids = default_aux_layer_ids(cfg.num_layers)  # ModelOpt's default, written to the export
    capture = _layers_to_capture(ss.srt()["sglang.srt.models.qwen3"].Qwen3ForCausalLM, list(aux_ids),
                                 cfg.num_layers)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, cfg.vocab_size, (2, 12), generator=g)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 1:] = True
    cap = Capture(CaptureConfig(storage_dtype="float32", teacher_topk=5))
    with torch.no_grad(), cap.record(policy, mask):
        policy(ids, torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None)
    cache = cap.take()
    hf = transformers.AutoModelForCausalLM.from_pretrained(capture_target, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states  # hs[j] = input of layer j
    b, t = mask.nonzero(as_tuple=True)
    sglang_fed = torch.cat([hs[j][b, t - 1] for j in capture], -1)  # layer j's input, as SGLang captures it
    assert (cache.aux - sglang_fed).abs().max().item() < 1e-5
    literal = torch.cat([hs[i][b, t - 1] for i in aux_ids], -1)  # the ids taken literally (vLLM 0.32)
    assert (cache.aux - literal).abs().max().item() > 1e-2
