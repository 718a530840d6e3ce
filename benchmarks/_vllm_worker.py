"""One vLLM engine in its own process, for benchmarks/bench_vs_vllm.py (run by the vLLM environment's
Python: nothing of megatron_spec is imported here).

    VLLM_PYTHON _vllm_worker.py --model DIR --dtype float32 --max-num-seqs 16 --max-model-len 512
        [--spec '{"method": "ngram", "num_speculative_tokens": 3, ...}']

Reads one JSON object a line on stdin and answers one on stdout:
``{"prompts": [[ids...], ...], "max_tokens": 64}`` -> ``{"wall_s": s, "outputs": [[ids...], ...]}``
(greedy, EOS ignored, every prompt generated once; the wall time of ``LLM.generate`` alone).
The first line it writes is ``{"ready": true, "load_s": s}`` once the engine is up. vLLM spawns its
engine process, hence the ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-seqs", type=int, required=True)
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--spec", default=None, help="vLLM speculative_config as JSON")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        seed=args.seed,
        speculative_config=json.loads(args.spec) if args.spec else None,
    )
    out = sys.stdout
    out.write(json.dumps({"ready": True, "load_s": time.perf_counter() - t0}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        sp = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        t = time.perf_counter()
        res = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t
        out.write(json.dumps({"wall_s": wall, "outputs": [list(r.outputs[0].token_ids) for r in res]}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
