"""The native engine's MTP drafter: megatron-core MTP heads proposing k tokens (see :class:`MtpDrafter`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_spec.rollout.native.drafters import Drafter, draw, stack_probs
from megatron_spec.rollout.native.rows import pad_rows


class MtpDrafter(Drafter):
    """Multi-token-prediction heads (``megatron_spec.draft.mtp_head``: megatron-core's MTP layer math).

    Depth j (1-based) at row r pairs depth j-1's output at r (the target's final-normed hidden state
    for j = 1) with the embedding of ``x_{r+j}``, at RoPE position r, and predicts ``x_{r+j+1}``. With
    ``N`` the position of a row's last token, draft step j <= U = min(k, D) is depth j at row ``N-1``,
    exactly as trained: depth j's rows ``<= N-j`` hold verified tokens and are kept in its cache;
    rows ``N-j+1 .. N-1`` hold drafted tokens and are recomputed (and rolled back) at every propose.
    ``inputs[j][slot]`` holds depth j's hidden inputs for the rows after its cache that it has not
    consumed yet (one row for j >= 2; the verified target states for j = 1).

    Draft steps beyond U reuse depth U autoregressively (its own output as the next hidden state,
    EAGLE style), as SGLang and vLLM do for models with fewer MTP layers than draft steps.
    """

    kind = "mtp"
    supports_skip = False  # depth j's pending rows assume one proposal per verify step

    def __init__(self, head, target, num_draft_tokens: int) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.head = head
        self.target = target
        self.depth = min(num_draft_tokens, head.num_layers)
        self.aux_layers = (target.cfg.num_layers - 1,)  # the last layer's raw output; normed here
        self.caches = None
        self.inputs: list[list[torch.Tensor]] = []

    # ------------------------------------------------------------------ helpers
    @property
    def device(self) -> torch.device:
        return self.target.embed_tokens.weight.device

    def _empty(self) -> torch.Tensor:
        w = self.target.embed_tokens.weight
        return torch.zeros(0, self.target.cfg.hidden_size, dtype=w.dtype, device=w.device)

    def _h0(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's final-normed hidden state (megatron's decoder output) from its last layer's output."""
        return self.target.norm(aux)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.target.head(h)

    def _run(
        self,
        d: int,
        slot_offset: int,
        starts: torch.Tensor,
        hiddens: Sequence[torch.Tensor],
        tokens: Sequence[Sequence[int]],
        want_logits: bool,
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Depth ``d`` (0-based) on rows ``starts[i] ..`` of slots ``slot_offset + i``; per slot the
        outputs ``[c_i, H]`` and, with ``want_logits``, the logits ``[B, V]`` of each slot's last row."""
        b, dev = len(tokens), self.device
        n = [len(t) for t in tokens]
        m = max(n) if b else 0
        if m == 0:
            return [self._empty() for _ in range(b)], None
        counts = torch.tensor(n, device=dev)
        h = hiddens[0].shape[-1] if hiddens else self.target.cfg.hidden_size
        ids = pad_rows(tokens, m, 0, dev)
        hid = self._empty().new_zeros(b, m, h)
        for i, (tok, hs) in enumerate(zip(tokens, hiddens)):
            if tok:
                hid[i, :len(tok)] = hs
        positions = starts.view(-1, 1) + torch.arange(m, device=dev)  # [B, M]
        out = self.head.layers[d](self.target.embed_tokens(ids), hid, positions, self.target.rotary,
                                  self.caches[d], (starts + counts).clamp(min=1), slot_offset)  # [B, M, H]
        outs = [out[i, :n[i]] for i in range(b)]
        logits = None
        if want_logits:
            last = (counts - 1).clamp(min=0).view(b, 1, 1).expand(-1, 1, out.shape[-1])
            logits = self._logits(out.gather(1, last)[:, 0])  # [B, V]
        return outs, logits

    # ------------------------------------------------------------------ Drafter
    def allocate(self, num_slots, max_len):
        self.caches = self.head.new_caches(num_slots, max_len, self.target.embed_tokens.weight.dtype)
        self.inputs = [[self._empty() for _ in range(num_slots)] for _ in range(self.depth)]

    def release(self):
        self.caches = None

    def move(self, src, dst):
        for d, cache in enumerate(self.caches[:self.depth]):
            cache.move(src, dst)
            self.inputs[d][dst] = self.inputs[d][src]

    def copy_prefix(self, src, dsts):
        for d, cache in enumerate(self.caches[:self.depth]):
            cache.copy_prefix(src, list(dsts), int(cache.lens[src]))
            for dst in dsts:
                self.inputs[d][dst] = self.inputs[d][src]

    def prefill(self, slot_offset, prompts, aux):
        # Depth j keeps prompt rows r <= P-1-j (their token x_{r+j} is in the prompt); the target
        # state at P-1 waits for the first sampled token (start()).
        p = len(prompts)
        h0 = self._h0(aux)  # [P, T, H]
        prev = [h0[i, :max(0, len(x) - 1)] for i, x in enumerate(prompts)]
        zeros = torch.zeros(p, dtype=torch.long, device=self.device)
        for d in range(self.depth):
            n_rows = [max(0, len(x) - 1 - d) for x in prompts]
            toks = [list(x[d + 1:d + 1 + n]) for x, n in zip(prompts, n_rows)]
            outs, _ = self._run(d, slot_offset, zeros, [pv[:n] for pv, n in zip(prev, n_rows)], toks, False)
            self.caches[d].lens[slot_offset:slot_offset + p] = torch.tensor(n_rows, device=self.device)
            for i, x in enumerate(prompts):
                if d + 1 < self.depth:  # depth d+2 (1-based) will need row P-2-d of this depth's output
                    lo = max(0, len(x) - 2 - d)
                    self.inputs[d + 1][slot_offset + i] = outs[i][lo:n_rows[i]]
            prev = outs

    def start(self, slot, prompt, first_token, last_aux):
        self.inputs[0][slot] = self._h0(last_aux.reshape(1, -1))

    def propose(self, tokens, k, sampling, generator):
        b = len(tokens)
        last = [len(t) - 1 for t in tokens]  # N: position of each row's last token
        drafts: list[list[int]] = [[] for _ in range(b)]
        probs = []
        prev_out: list[torch.Tensor] | None = None
        new_inputs: dict[int, list[torch.Tensor]] = {}
        chain_h = None
        for d in range(self.depth):
            cache = self.caches[d]
            starts = cache.lens[:b].clone()
            start = starts.tolist()  # one host read per depth
            hiddens, toks = [], []
            for i in range(b):
                s0, n = start[i], last[i]
                h_in = self.inputs[d][i] if prev_out is None else torch.cat([self.inputs[d][i], prev_out[i]])
                if h_in.shape[0] != n - s0:
                    raise RuntimeError(
                        f"MTP depth {d + 1}: {h_in.shape[0]} pending states for rows {s0}..{n - 1} "
                        f"(engine bookkeeping bug)"
                    )
                hiddens.append(h_in)
                toks.append(
                    [tokens[i][r + d + 1] if r + d + 1 <= n else drafts[i][r + d - n] for r in range(s0, n)]
                )
            outs, logits = self._run(d, 0, starts, hiddens, toks, True)
            tok, q = draw(logits, sampling, generator)  # [B], [B, V]
            probs.append(q)
            for i, t in enumerate(tok.tolist()):
                drafts[i].append(t)
            kept = [max(0, n - d) for n in last]  # rows <= N-1-d hold verified tokens only
            if d + 1 < self.depth:
                new_inputs[d + 1] = [
                    outs[i][max(0, last[i] - d - 1) - start[i] : kept[i] - start[i]] for i in range(b)
                ]
            cache.lens[:b] = torch.tensor(kept, device=self.device)
            chain_h = torch.stack([o[-1] for o in outs]).unsqueeze(1)  # [B, 1, H] output at row N-1
            prev_out = outs
        for i in range(b):
            self.inputs[0][i] = self._empty()
        for d, rows in new_inputs.items():
            for i in range(b):
                self.inputs[d][i] = rows[i]
        top = self.depth - 1
        base = torch.tensor(last, device=self.device)
        for j in range(self.depth, k):  # beyond the trained depths: reuse the last one autoregressively
            pos = (base - 1 + (j - top)).unsqueeze(1)  # [B, 1]
            ids = torch.tensor([[dr[-1]] for dr in drafts], device=self.device)
            chain_h = self.head.layers[top](self.target.embed_tokens(ids), chain_h, pos, self.target.rotary,
                                            self.caches[top], pos.squeeze(1) + 1)
            tok, q = draw(self._logits(chain_h[:, 0]), sampling, generator)
            probs.append(q)
            for i, t in enumerate(tok.tolist()):
                drafts[i].append(t)
        return torch.tensor(drafts, dtype=torch.long, device=self.device), stack_probs(probs)

    def commit(self, emitted, num_accepted, verify_aux):
        h0 = self._h0(verify_aux)  # [B, k+1, H]
        for b, em in enumerate(emitted):
            self.inputs[0][b] = torch.cat([self.inputs[0][b], h0[b, :len(em)]])
