"""The offline evaluator: chain speculative decoding in PyTorch with the HF target and the draft.

It reproduces what vLLM's EAGLE-3 proposer does, greedily, one prompt at a time:
- after each target step, the draft first runs over the newly verified positions with the target's
  aux states (position i: fc(aux_i) and the embedding of token i+1), appending to its KV cache;
- from the last verified position it proposes k tokens in a chain, feeding back its own pre-norm
  output and its own token; those chain entries are dropped from its cache afterwards (vLLM
  overwrites them with the next pass);
- the target verifies [last token, d_1..d_k] in one forward pass; d_i is accepted while it equals
  the target's greedy token; the first mismatch (or the bonus after k) is the target's token.
Statistics are counted as vLLM counts them (see acceptance.py), so on the same prompts the two
agree up to floating-point ties.
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

    def __init__(self, path, layer_ids, dtype: torch.dtype, device):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
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
    def forward(self, ids: list, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """(greedy next tokens [T], aux [T, n_aux*H]) for ``ids`` appended to ``cache``."""
        self._captured.clear()
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, past_key_values=cache, use_cache=True)
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
        attn = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=keys.shape[1] != q.shape[1])
        out = m.midlayer.post_attention(attn.transpose(1, 2).flatten(2), residual)[0]
        self.k_cache, self.v_cache = keys, vals
        if commit:
            self.committed = keys.shape[2]
        return out

    @torch.inference_mode()
    def commit(self, aux: torch.Tensor, next_tokens: list) -> torch.Tensor:
        """Step-0 pass over newly verified positions; returns the pre-norm output of the last one."""
        self.drop_speculative()
        h = self.module.fuse(aux[None].to(self.dtype))[0]
        return self._run(h, next_tokens, self.committed, commit=True)[-1]

    @torch.inference_mode()
    def chain_step(self, hidden: torch.Tensor, token: int) -> torch.Tensor:
        pos = self.k_cache.shape[2]
        return self._run(hidden[None], [token], pos, commit=False)[-1]

    def drop_speculative(self) -> None:
        if self.k_cache is not None and self.k_cache.shape[2] > self.committed:
            self.k_cache = self.k_cache[:, :, : self.committed]
            self.v_cache = self.v_cache[:, :, : self.committed]

    @torch.inference_mode()
    def predict(self, out: torch.Tensor) -> int:
        logits = self.module.logits(out[None])[0].float()
        return int(self.kept[int(logits.argmax())])


def speculative_generate(target: HFTarget, draft: DraftRunner, prompt: list, k: int, max_tokens: int,
                         stop_ids: set, stats: AcceptanceStats) -> list:
    """Greedy chain speculative decoding of one prompt; updates ``stats``; returns the new tokens."""
    from transformers import DynamicCache

    cache = DynamicCache()
    draft.reset()
    nxt, aux = target.forward(prompt, cache)
    seq = list(prompt) + [int(nxt[-1])]
    out = [seq[-1]]
    stats.target_steps += 1
    if seq[-1] in stop_ids or len(out) >= max_tokens:
        return out
    h = draft.commit(aux, seq[1:])
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
        h = draft.commit(aux[: a + 1], new)
        for t in new:
            seq.append(t)
            out.append(t)
            if t in stop_ids or len(out) >= max_tokens:
                return out


def offline_acceptance(target_path, ckpt: DraftCheckpoint, prompts: list, k: int, max_tokens: int,
                       stop_ids, dtype: str = "float32", device: str = "auto", progress: bool = False,
                       target: Optional[HFTarget] = None) -> AcceptanceStats:
    """Acceptance of ``ckpt`` on ``prompts`` (token id lists) with chain drafts of ``k`` tokens."""
    from tqdm.auto import tqdm

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    tdtype = getattr(torch, dtype)
    own = target is None
    if own:
        target = HFTarget(target_path, ckpt.config.aux_layer_ids, tdtype, device)
    try:
        draft = DraftRunner(ckpt, target.embed_weight(), tdtype, device)
        stats = AcceptanceStats(k=k, num_prompts=len(prompts))
        for p in tqdm(prompts, desc=f"offline eval k={k}", disable=not progress, unit="prompt"):
            out = speculative_generate(target, draft, list(p), k, max_tokens, set(stop_ids), stats)
            stats.outputs.append(out)
            stats.generated_tokens += len(out)
        return stats
    finally:
        if own:
            target.close()
