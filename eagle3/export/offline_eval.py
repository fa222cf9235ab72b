"""The offline evaluator: chain speculative decoding in PyTorch with the HF target and the draft.

It reproduces what vLLM's EAGLE-3 proposer does, greedily:
- after each target step, the draft first runs over the newly verified positions with the target's
  aux states (position i: fc(aux_i) and the embedding of token i+1), appending to its KV cache;
- from the last verified position it proposes k tokens in a chain, feeding back its own pre-norm
  output and its own token; those chain entries are dropped from its cache afterwards (vLLM
  overwrites them with the next pass);
- the target verifies [last token, d_1..d_k] in one forward pass; d_i is accepted while it equals
  the target's greedy token; the first mismatch (or the bonus after k) is the target's token.
Statistics are counted as vLLM counts them (see acceptance.py).

Two implementations:
- ``decode``: literally the loop above, one prompt at a time, the target verifying with a KV cache.
  The reference; one target forward per round.
- ``replay`` (default): with greedy verification every accepted token is the target's greedy token,
  and what the draft sees at a round (target features of the accepted prefix, causal) is the same
  whatever happened in earlier rounds. So the target's greedy continuation is generated once
  (batched), the target's aux states over it come from one teacher-forced pass, the draft's step-0
  pass over the whole sequence gives every round's committed KV cache and first proposal, and each
  round only runs the draft's k-1 chain steps. Same statistics (tests compare the two), a fraction
  of the time on CPU.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F

from .acceptance import AcceptanceStats
from .checkpoint import DraftCheckpoint

log = logging.getLogger("eagle3.export")


class HFTarget:
    """The target in transformers with hooks that capture aux states in vLLM's id convention."""

    def __init__(self, path, layer_ids, dtype: torch.dtype, device, trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                          trust_remote_code=trust_remote_code).to(device).eval()
        self.device = torch.device(device)
        base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        layers = getattr(base, "layers", None)
        if layers is None:
            raise RuntimeError(f"{type(self.model).__name__} keeps no decoder layers in .layers")
        self.layer_ids = list(layer_ids)
        self._captured: dict = {}
        self._hooks = []
        L = len(layers)
        for k in self.layer_ids:
            if k < L:
                self._hooks.append(layers[k].register_forward_pre_hook(self._pre(k), with_kwargs=True))
            else:  # id L: the output of the last layer, before the final norm
                self._hooks.append(layers[L - 1].register_forward_hook(self._post(k)))

    def _pre(self, k):
        def hook(module, args, kwargs):
            self._captured[k] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _post(self, k):
        def hook(module, args, output):
            self._captured[k] = output[0] if isinstance(output, (tuple, list)) else output
        return hook

    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @torch.inference_mode()
    def forward(self, ids: list, cache, all_logits: bool = True, keep: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(greedy next tokens [T] (only the last ``keep`` with all_logits=False), aux [T, n_aux*H]) for
        ``ids`` appended to ``cache``."""
        self._captured.clear()
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, past_key_values=cache, use_cache=True,
                         logits_to_keep=0 if all_logits else max(1, int(keep)))
        aux = torch.cat([self._captured[k][0] for k in self.layer_ids], dim=-1)
        return out.logits[0].float().argmax(-1), aux

    def close(self) -> None:
        """Free the model (before vLLM starts in the same process and sizes its KV cache)."""
        import gc

        for h in self._hooks:
            h.remove()
        self._captured.clear()
        del self.model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class DraftRunner:
    """The draft with a KV cache: committed positions (target features) + a speculative chain."""

    def __init__(self, ckpt: DraftCheckpoint, target_embed: torch.Tensor, dtype: torch.dtype, device):
        self.module = ckpt.to_module(dtype=dtype, device=device)
        # vLLM uses the draft's own embedding when its checkpoint has one, else the target's.
        embed = ckpt.embed if ckpt.embed is not None else target_embed
        self.embed = embed.to(device=device, dtype=dtype)
        self.kept = ckpt.kept_ids.to(device)
        self.dtype, self.device = dtype, torch.device(device)
        self.reset()

    def reset(self) -> None:
        self.k_cache: Optional[torch.Tensor] = None
        self.v_cache: Optional[torch.Tensor] = None
        self.committed = 0

    def _run(self, hidden: torch.Tensor, tokens: list, start: int, commit: bool) -> torch.Tensor:
        """Process positions start..start+T-1 (hidden [T, H] = fc output or fed-back state)."""
        m = self.module
        T = hidden.shape[0]
        pos = torch.arange(start, start + T, device=self.device)[None]
        cos, sin = m.rope(pos, self.dtype)
        emb = F.embedding(torch.tensor(tokens, device=self.device)[None], self.embed)
        q, k, v, residual = m.midlayer.pre_attention(hidden[None].to(self.dtype), emb, cos, sin)
        keys = k if self.k_cache is None else torch.cat([self.k_cache, k], dim=2)
        vals = v if self.v_cache is None else torch.cat([self.v_cache, v], dim=2)
        S0 = keys.shape[2] - T
        mask = torch.arange(keys.shape[2], device=self.device)[None, :] <= (S0 + torch.arange(T, device=self.device))[:, None]
        attn = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=m.attn_scale,
                                              enable_gqa=keys.shape[1] != q.shape[1])
        out = m.midlayer.post_attention(attn.transpose(1, 2).flatten(2), residual)[0]
        self.k_cache, self.v_cache = keys, vals
        if commit:
            self.committed = keys.shape[2]
        return out

    @torch.inference_mode()
    def commit(self, aux: torch.Tensor, next_tokens: list) -> torch.Tensor:
        """Step-0 pass over newly verified positions; their pre-norm outputs [T, H]."""
        self.drop_speculative()
        h = self.module.fuse(aux[None].to(self.dtype))[0]
        return self._run(h, next_tokens, self.committed, commit=True)

    def keep_prefix(self, n: int) -> None:
        """Make the committed cache positions 0..n-1 only (a view; replay mode)."""
        self.k_cache, self.v_cache = self.k_cache[:, :, :n], self.v_cache[:, :, :n]
        self.committed = n

    @torch.inference_mode()
    def chain_step(self, hidden: torch.Tensor, token: int) -> torch.Tensor:
        pos = self.k_cache.shape[2]
        # ``hidden`` is the previous step's pre-norm output; norm_output feeds its normed form
        return self._run(self.module.feedback(hidden)[None], [token], pos, commit=False)[-1]

    def drop_speculative(self) -> None:
        if self.k_cache is not None and self.k_cache.shape[2] > self.committed:
            self.k_cache = self.k_cache[:, :, : self.committed]
            self.v_cache = self.v_cache[:, :, : self.committed]

    @torch.inference_mode()
    def predict(self, out: torch.Tensor) -> int:
        logits = self.module.logits(out[None])[0].float()
        return int(self.kept[int(logits.argmax())])

    @torch.inference_mode()
    def predict_all(self, outs: torch.Tensor) -> list:
        return self.kept[self.module.logits(outs).float().argmax(-1)].tolist()


def speculative_generate(target: HFTarget, draft: DraftRunner, prompt: list, k: int, max_tokens: int,
                         stop_ids: set, stats: AcceptanceStats) -> list:
    """Greedy chain speculative decoding of one prompt; updates ``stats``; returns the new tokens."""
    from transformers import DynamicCache

    cache = DynamicCache()
    draft.reset()
    nxt, aux = target.forward(prompt, cache, all_logits=False)
    seq = list(prompt) + [int(nxt[-1])]
    out = [seq[-1]]
    stats.target_steps += 1
    if seq[-1] in stop_ids or len(out) >= max_tokens:
        return out
    h = draft.commit(aux, seq[1:])[-1]
    while True:
        proposal = [draft.predict(h)]
        hc = h
        for _ in range(k - 1):
            hc = draft.chain_step(hc, proposal[-1])
            proposal.append(draft.predict(hc))
        draft.drop_speculative()
        n = len(seq)
        greedy, aux = target.forward([seq[-1]] + proposal, cache)
        greedy = greedy.tolist()
        a = 0
        while a < k and proposal[a] == greedy[a]:
            a += 1
        stats.observe(k, a)
        stats.target_steps += 1
        new = proposal[:a] + [greedy[a]]
        surplus = cache.get_seq_length() - (n + a)  # KV of the rejected drafts
        if surplus > 0:
            cache.crop(-surplus)
        h = draft.commit(aux[: a + 1], new)[-1]
        for t in new:
            seq.append(t)
            out.append(t)
            if t in stop_ids or len(out) >= max_tokens:
                return out


def replay_on_greedy_path(draft: DraftRunner, aux: torch.Tensor, seq: list, prompt_len: int, k: int,
                          max_tokens: int, stop_ids: set, stats: AcceptanceStats) -> list:
    """The rounds of chain speculative decoding replayed on ``seq`` = prompt + the target's greedy
    continuation (at least max_tokens + k + 1 tokens of it), ``aux`` its states [len(seq), n_aux*H]."""
    if len(seq) < prompt_len + max_tokens + k + 1:
        raise ValueError("the greedy continuation must cover max_tokens + k + 1 tokens")
    draft.reset()
    outs0 = draft.commit(aux[: len(seq) - 1], seq[1:])  # position i: target features i, token i+1
    first = draft.predict_all(outs0)  # each round's first proposal, from its last committed position
    keys, vals = draft.k_cache, draft.v_cache
    n = prompt_len + 1  # tokens known after the prefill step
    out = [seq[prompt_len]]
    stats.target_steps += 1
    if out[-1] in stop_ids or len(out) >= max_tokens:
        return out
    while True:
        p = n - 2  # the last position with target features; its step-0 pass proposes d_1
        proposal = [first[p]]
        if k > 1:
            draft.k_cache, draft.v_cache, draft.committed = keys, vals, keys.shape[2]
            draft.keep_prefix(p + 1)
            h = outs0[p]
            for _ in range(k - 1):
                h = draft.chain_step(h, proposal[-1])
                proposal.append(draft.predict(h))
        a = 0
        while a < k and proposal[a] == seq[n + a]:
            a += 1
        stats.observe(k, a)
        stats.target_steps += 1
        for t in seq[n: n + a + 1]:
            n += 1
            out.append(t)
            if t in stop_ids or len(out) >= max_tokens:
                return out


@torch.inference_mode()
def greedy_continuations(target: HFTarget, prompts: list, num_tokens: int, batch_size: int = 8,
                         progress: bool = False) -> list:
    """The target's greedy continuation of each prompt, ``num_tokens`` long, never stopping early
    (a draft round that crosses a stop token still has its drafts verified past it)."""
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    dev = target.device
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # similar lengths per batch
    result: list = [None] * len(prompts)
    for b in tqdm(range(0, len(order), batch_size), desc="target greedy", disable=not progress, unit="batch"):
        idx = order[b:b + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for r, i in enumerate(idx):  # left padding: every row's next token is in the last column
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        cache = DynamicCache()
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        gen = []
        x = ids
        for _ in range(num_tokens):
            logits = target.model(input_ids=x, attention_mask=mask, position_ids=pos, past_key_values=cache,
                                  use_cache=True, logits_to_keep=1).logits[:, -1]
            x = logits.float().argmax(-1, keepdim=True)
            gen.append(x)
            mask = torch.cat([mask, torch.ones_like(x)], dim=1)
            pos = pos[:, -1:] + 1
        gen = torch.cat(gen, dim=1).tolist()
        for r, i in enumerate(idx):
            result[i] = gen[r]
    return result


def offline_acceptance(target_path, ckpt: DraftCheckpoint, prompts: list, k: int, max_tokens: int,
                       stop_ids, dtype: str = "float32", device: str = "auto", progress: bool = False,
                       target: Optional[HFTarget] = None, method: str = "replay",
                       continuations: Optional[list] = None, trust_remote_code: bool = False,
                       check_outputs: Optional[list] = None) -> AcceptanceStats:
    """Acceptance of ``ckpt`` on ``prompts`` (token id lists) with chain drafts of ``k`` tokens.

    ``continuations``: greedy continuations to replay on (replay mode), from an earlier call to reuse
    across k, or vLLM's plain greedy decoding (export verification: then no transformers decoding runs).
    ``check_outputs``: greedy outputs of another engine (vLLM's plain decoding, each a prefix of its
    continuation): ``stats.hf_agrees[i]`` says whether the target in transformers, teacher-forced on the
    continuation, picks every one of prompt i's tokens itself, i.e. whether its own greedy decoding
    would have produced the same output.
    """
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    if method not in ("replay", "decode"):
        raise ValueError(f"method {method!r} is not 'replay' or 'decode'")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    tdtype = getattr(torch, dtype)
    own = target is None
    if own:
        target = HFTarget(target_path, ckpt.config.aux_layer_ids, tdtype, device, trust_remote_code)
    try:
        draft = DraftRunner(ckpt, target.embed_weight(), tdtype, device)
        stats = AcceptanceStats(k=k, num_prompts=len(prompts))
        stops = set(stop_ids)
        if method == "replay":
            need = max_tokens + k + 1
            if continuations is None or any(len(c) < need for c in continuations):
                continuations = greedy_continuations(target, prompts, need, progress=progress)
            stats.continuations = continuations
        for i, p in enumerate(tqdm(prompts, desc=f"offline eval k={k}", disable=not progress, unit="prompt")):
            before = (stats.num_drafts, stats.num_accepted, stats.num_draft_tokens, stats.target_steps,
                      list(stats.accepted_per_pos))
            if method == "decode":
                out = speculative_generate(target, draft, list(p), k, max_tokens, stops, stats)
            else:
                seq = list(p) + list(continuations[i])
                ref = None if check_outputs is None else [int(t) for t in check_outputs[i]]
                # logits for the positions that predict the reference's tokens (the last len(seq) - len(p) + 1)
                greedy, aux = target.forward(seq, DynamicCache(), all_logits=False,
                                             keep=1 if ref is None else len(seq) - len(p) + 1)
                out = replay_on_greedy_path(draft, aux, seq, len(p), k, max_tokens, stops, stats)
                if ref is not None:
                    if list(continuations[i][: len(ref)]) != ref:
                        raise ValueError(f"prompt {i}: the output to check is not a prefix of its continuation")
                    stats.hf_agrees.append(greedy[: len(ref)].tolist() == ref)
            stats.outputs.append(out)
            stats.generated_tokens += len(out)
            # this prompt's own counts (AcceptanceStats.subset: per domain, per context length)
            stats.per_request.append({"tokens": len(out), "steps": stats.target_steps - before[3],
                                      "drafts": stats.num_drafts - before[0], "accepted": stats.num_accepted - before[1],
                                      "draft_tokens": stats.num_draft_tokens - before[2],
                                      "accepted_per_pos": [a - b for a, b in zip(stats.accepted_per_pos, before[4])]})
        return stats
    finally:
        if own:
            target.close()


def offline_acceptance_by_k(target, ckpt: DraftCheckpoint, prompts: list, ks: list, max_tokens: int, stop_ids,
                            dtype: str = "float32", device: str = "auto", progress: bool = False) -> dict:
    """{k: AcceptanceStats} for each k of ``ks`` (in that order) with one HF target
    (``target``: eagle3.target.TargetInfo), the largest k first: its greedy continuations are long
    enough for every smaller k."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = HFTarget(target.path, ckpt.config.aux_layer_ids, getattr(torch, dtype), device, target.trust_remote_code)
    results, cont = {}, None
    try:
        for kk in sorted(ks, reverse=True):
            results[kk] = offline_acceptance(target.path, ckpt, prompts, kk, max_tokens, stop_ids, dtype=dtype,
                                             device=device, progress=progress, target=hf, continuations=cont)
            cont = results[kk].continuations
    finally:
        hf.close()
    return {kk: results[kk] for kk in ks}
