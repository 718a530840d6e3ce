"""``launch/make_draft.py``: a run stopped during the refinement reuses its ModelOpt export only when the
export was made with the same target, settings and training sequences (its ``make_draft.json``)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _make_draft():
    spec = importlib.util.spec_from_file_location("make_draft", os.path.join(ROOT, "launch", "make_draft.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _args(**over):
    base = dict(target="runs/t", steps=150, batch_size=8, lr=3e-3, ttt_steps=3, draft_vocab_size=1024, seed=0)
    return argparse.Namespace(**{**base, **over})


def test_export_reused_only_with_same_settings_and_sequences(tmp_path):
    md = _make_draft()
    seqs = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    export = tmp_path / "eagle3.modelopt"
    stamp = md.modelopt_stamp(_args(), seqs)
    assert not md.reusable_export(str(export), stamp)  # nothing there
    export.mkdir()
    (export / md.STAMP).write_text(json.dumps(stamp))
    assert not md.reusable_export(str(export), stamp)  # no export beside the stamp
    (export / "config.json").write_text("{}")
    assert md.reusable_export(str(export), stamp)
    for other in (
        md.modelopt_stamp(_args(steps=300), seqs),
        md.modelopt_stamp(_args(draft_vocab_size=None), seqs),
        md.modelopt_stamp(_args(target="runs/u"), seqs),
        md.modelopt_stamp(_args(), seqs[:1]),
        md.modelopt_stamp(_args(), [seqs[0], seqs[1][:-1]]),
    ):
        assert not md.reusable_export(str(export), other)
    (export / md.STAMP).write_text("{not json")
    assert not md.reusable_export(str(export), stamp)
