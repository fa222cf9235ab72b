"""The train stage: TTT attention and loss against references, the loop (overfit, resume after
kill -9, two processes), and the stage through the manifest. CPU, float32."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eagle3.config import ExtractConfig, TrainConfig
from eagle3.model.draft import Eagle3Draft, Eagle3DraftConfig, Eagle3MidLayer
from eagle3.train.attention import TTTMask, _ttt_mask_mod, naive_ttt_attention, ttt_attention
from eagle3.train.data import collate, epoch_order
from eagle3.train.metrics import expected_acceptance_lengths
from eagle3.train.target_head import TargetHead
from eagle3.train.ttt import STAT_NAMES, TTTModel

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def _small_cfg(H=64, V=120, Vd=60, heads=2, kv=1, n_aux=3) -> Eagle3DraftConfig:
    return Eagle3DraftConfig(hidden_size=H, target_hidden_size=H, num_attention_heads=heads, num_key_value_heads=kv,
                             head_dim=32, intermediate_size=2 * H, rms_norm_eps=1e-6, vocab_size=V,
                             draft_vocab_size=Vd, aux_layer_ids=list(range(1, n_aux + 1)), rope_theta=10000.0)


# -- attention -----------------------------------------------------------------------------------

def test_attention_backends_equal_naive_reference():
    torch.manual_seed(0)
    B, T, Hq, Hkv, D, S = 2, 64, 4, 2, 32, 4
    doc = torch.tensor([[0] * 15 + [1] * 20 + [2] * 29, [5] * 64])  # packed row / single document
    q = torch.randn(B, Hq, T, D, dtype=torch.float64)
    ks = [torch.randn(B, Hkv, T, D, dtype=torch.float64) for _ in range(S)]
    vs = [torch.randn(B, Hkv, T, D, dtype=torch.float64) for _ in range(S)]
    dense, flex = TTTMask(doc, S, "sdpa"), TTTMask(doc, S, "flex", block_size=16)
    for j in range(S):
        ref = naive_ttt_attention(q, ks[:j + 1], vs[:j + 1], doc)
        out_sdpa = ttt_attention(q, ks[:j + 1], vs[:j + 1], dense.dense(j))
        # flex runs unfused on CPU (forward only there; its fused kernel is checked on GPU by bench --check)
        qf, kf, vf = q.float(), [k.float() for k in ks[:j + 1]], [v.float() for v in vs[:j + 1]]
        out_stacked = ttt_attention(qf, kf, vf, flex.block(j))
        out_flex = ttt_attention(qf, kf, vf, flex.prefix_block())  # prefix kernel + merged diagonals
        assert (out_sdpa - ref).abs().max() < 1e-12
        assert (out_stacked.double() - ref).abs().max() < 1e-5
        assert (out_flex.double() - ref).abs().max() < 1e-5
    # the reference itself sees the right keys: step 1 differs from step 0 at every position
    assert (naive_ttt_attention(q, ks[:2], vs[:2], doc) - naive_ttt_attention(q, ks[:1], vs[:1], doc)).abs().min() > 0


def test_diagonal_merge_gradients_equal_naive_reference():
    """The flex backend's merge of the prefix attention with the diagonals, differentiated through
    the prefix's log-sum-exp, has the naive reference's gradients (float64; the prefix attention
    written densely here because flex has no CPU backward: bench/train.py --check runs the fused
    kernel's gradients on a GPU)."""
    from eagle3.train.attention import merge_diagonals

    torch.manual_seed(1)
    B, T, Hq, Hkv, D, S = 2, 24, 4, 2, 16, 4
    doc = torch.tensor([[0] * 10 + [1] * 14, [3] * 24])
    q = torch.randn(B, Hq, T, D, dtype=torch.float64, requires_grad=True)
    ks = [torch.randn(B, Hkv, T, D, dtype=torch.float64, requires_grad=True) for _ in range(S)]
    vs = [torch.randn(B, Hkv, T, D, dtype=torch.float64, requires_grad=True) for _ in range(S)]
    scale = D ** -0.5
    mask = TTTMask(doc, S, "sdpa").dense(0)  # [B,1,T,T] step-0 prefix
    for j in range(S):
        k0, v0 = (x.repeat_interleave(Hq // Hkv, 1) for x in (ks[0], vs[0]))
        scores = (q @ k0.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        out = merge_diagonals(q, torch.softmax(scores, -1) @ v0, torch.logsumexp(scores, -1), ks[1:j + 1],
                              vs[1:j + 1], scale).double()
        ref = naive_ttt_attention(q, ks[:j + 1], vs[:j + 1], doc).view(B, T, Hq, D).transpose(1, 2)
        assert (out - ref).abs().max() < 1e-6  # float32 inside the merge
        grad = torch.randn_like(ref)
        inputs = [q] + ks[:j + 1] + vs[:j + 1]
        got = torch.autograd.grad((out * grad).sum(), inputs)
        want = torch.autograd.grad((ref * grad).sum(), inputs)
        for a, b in zip(got, want):
            assert (a - b).abs().max() < 1e-5 * max(1.0, b.abs().max().item())


def _dense_blocks(num, idx, ncols):
    out = torch.zeros(*idx.shape[:-1], ncols, dtype=torch.bool)
    for ix in np.ndindex(*idx.shape[:-1]):
        out[ix + (idx[ix][: int(num[ix])].long(),)] = True
    return out


def test_flex_block_structure_equals_create_block_mask():
    """The fused kernel only visits listed blocks: ours (built from block maps) must list exactly
    what flex's own create_block_mask finds from the token-level mask, for every step and for the
    prefix-only mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    T, bs, S = 256, 32, 4
    doc = torch.tensor([[0] * 40 + [1] * 100 + [2] * 116, [0] * 256])
    mask = TTTMask(doc, S, "flex", bs)
    for j in range(S):
        mine = mask.block(j)
        ref = create_block_mask(_ttt_mask_mod(doc, T, torch.tensor(j)), B=2, H=None, Q_LEN=T, KV_LEN=S * T,
                                device="cpu", BLOCK_SIZE=bs)
        for num, idx, n in (("kv_num_blocks", "kv_indices", S * T // bs),
                            ("full_kv_num_blocks", "full_kv_indices", S * T // bs),
                            ("q_num_blocks", "q_indices", T // bs), ("full_q_num_blocks", "full_q_indices", T // bs)):
            assert torch.equal(_dense_blocks(getattr(mine, num), getattr(mine, idx), n),
                               _dense_blocks(getattr(ref, num), getattr(ref, idx), n)), (j, num)
    # the flex backend's prefix-only mask (one for every step)
    from eagle3.train.attention import _prefix_mask_mod

    mine = mask.prefix_block()
    ref = create_block_mask(_prefix_mask_mod(doc), B=2, H=None, Q_LEN=T, KV_LEN=T, device="cpu", BLOCK_SIZE=bs)
    for num, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                     ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        assert torch.equal(_dense_blocks(getattr(mine, num), getattr(mine, idx), T // bs),
                           _dense_blocks(getattr(ref, num), getattr(ref, idx), T // bs)), num


# -- target head ---------------------------------------------------------------------------------

def test_target_head_chunks_equal_full_vocab():
    g = torch.Generator().manual_seed(0)
    V, H, N = 97, 16, 23
    lm = torch.randn(V, H, generator=g)
    kept = torch.randperm(V, generator=g)[:40].sort().values
    norm = torch.rand(H, generator=g) + 0.5
    head = TargetHead(torch.randn(V, H, generator=g), norm, lm, 1e-6, kept, vocab_chunk=7, row_chunk=5)
    x = torch.randn(2, N, H, generator=g)
    probs, in_vocab = head.targets(x)
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
    full = xn @ lm.T  # what must never be materialised for a real vocabulary
    assert torch.allclose(probs, full[..., kept].softmax(-1), atol=1e-6)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    assert torch.equal(in_vocab, t2d[full.argmax(-1)])
    assert 0 < in_vocab.float().mean() < 1  # both cases occur


# -- the TTT loss against a hand-written reference -------------------------------------------------

def _reference_ttt(draft, aux, embeds, probs, in_vocab, loss_mask, doc, pos, S, decay):
    """Position by position, step by step, written out (float64): each position's own chain of
    hidden states, attention over its document's step-0 prefix plus its own earlier steps."""
    B, T, _ = embeds.shape
    layer = draft.midlayer
    zero = torch.zeros_like(embeds[:, :1])
    emb_at = lambda b, i: embeds[b, i] if i < T else zero[b, 0]  # noqa: E731
    h0 = draft.fuse(aux)
    # step-0 keys of every position (what the prefix attends to)
    k0, v0 = [], []
    for b in range(B):
        e = torch.stack([emb_at(b, t + 1) for t in range(T)])[None]
        cos, sin = draft.rope(pos[b:b + 1], embeds.dtype)
        _, k, v, _ = layer.pre_attention(h0[b:b + 1], e, cos, sin)
        k0.append(k[0])
        v0.append(v[0])
    ce_sum, counts, correct = torch.zeros(S, dtype=torch.float64), torch.zeros(S), torch.zeros(S)
    for b in range(B):
        for t in range(T):
            h = h0[b:b + 1, t:t + 1]
            diag_k, diag_v = [], []
            for j in range(S):
                cos, sin = draft.rope(pos[b:b + 1, t:t + 1] + j, embeds.dtype)
                q, k, v, res = layer.pre_attention(h, emb_at(b, t + j + 1)[None, None], cos, sin)
                if j > 0:
                    diag_k.append(k[0, :, 0])
                    diag_v.append(v[0, :, 0])
                prefix = [s for s in range(t + 1) if doc[b, s] == doc[b, t]]
                K = torch.cat([k0[b][:, prefix]] + [x[:, None] for x in diag_k], dim=1)
                V = torch.cat([v0[b][:, prefix]] + [x[:, None] for x in diag_v], dim=1)
                rep = q.shape[1] // K.shape[0]
                K, V = K.repeat_interleave(rep, 0), V.repeat_interleave(rep, 0)
                scale = draft.attn_scale or q.shape[-1] ** -0.5  # the MLA draft's own (YaRN mscale)
                w = torch.softmax((K @ q[0, :, 0, :, None]).squeeze(-1) * scale, -1)
                attn = (w[..., None] * V).sum(1).reshape(1, 1, -1)
                out = layer.post_attention(attn, res)
                n = t + j + 2  # the token this step predicts
                if n < T and loss_mask[b, n] and doc[b, n] == doc[b, t]:
                    counts[j] += 1
                    if in_vocab[b, t + j + 1]:
                        logq = torch.log_softmax(draft.logits(out)[0, 0], -1)
                        p = probs[b, t + j + 1]
                        ce_sum[j] += -(p * logq).sum()
                        correct[j] += int(logq.argmax() == p.argmax())
                h = draft.feedback(out)  # out itself, or norm(out) with norm_output
    loss = sum(decay ** j * ce_sum[j] / counts[j] for j in range(S))
    return loss, ce_sum, counts, correct


@pytest.mark.parametrize("architecture,norm_before_residual,eagle31", [("llama", True, False), ("qwen3", False, False),
                                                                         ("llama", True, True), ("qwen3", False, True),
                                                                         ("deepseek", True, False),
                                                                         ("deepseek", False, True)])
def test_ttt_loss_equals_hand_computed_reference(architecture, norm_before_residual, eagle31):
    """eagle31: norm_before_fc, fc_norm and norm_output set (the hand reference feeds back
    draft.feedback(out); tests/test_draft.py proves fuse and feedback against vLLM's arithmetic)."""
    torch.manual_seed(0)
    cfg = _small_cfg()
    cfg.architecture, cfg.norm_before_residual = architecture, norm_before_residual
    cfg.norm_before_fc = cfg.fc_norm = cfg.norm_output = eagle31
    if architecture == "deepseek":  # MLA (v width != q/k width), YaRN; vLLM's MLA draft has no norm_before_fc
        cfg = dataclasses.replace(cfg, num_key_value_heads=2, head_dim=48, q_lora_rank=24, kv_lora_rank=40,
                                  qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, norm_before_fc=False,
                                  rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8,
                                                    beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0))
    draft = Eagle3Draft(cfg).double()
    if eagle31:
        with torch.no_grad():  # non-trivial norm weights, so that a norm left out would show
            for n, p in draft.named_parameters():
                if "norm" in n:
                    p.copy_(1 + 0.3 * torch.randn_like(p))
    B, T, S, decay = 2, 21, 4, 0.8
    aux = torch.randn(B, T, 3 * 64, dtype=torch.float64)
    embeds = torch.randn(B, T, 64, dtype=torch.float64)
    probs = torch.softmax(3 * torch.randn(B, T, cfg.draft_vocab_size, dtype=torch.float64), -1)
    in_vocab = torch.rand(B, T) > 0.2
    loss_mask = (torch.rand(B, T) > 0.25).long()
    doc = torch.tensor([[0] * 9 + [1] * 12, [0] * 21])
    pos = torch.cat([torch.arange(9), torch.arange(12)]).expand(B, T).clone()
    pos[1] = torch.arange(T)
    model = TTTModel(draft, num_steps=S, decay=decay, attention="sdpa")
    projected = []  # the rows whose embeddings the TTT forward projects
    real = Eagle3MidLayer.project_embeds

    def spy(self, e, w=None):
        projected.append(tuple(e.shape))
        return real(self, e, w)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Eagle3MidLayer, "project_embeds", spy)
        loss, stats = model(aux, embeds, probs, in_vocab, loss_mask, pos, doc)
    # once per row, tokens x_1 .. x_{T+S-1} (the steps read windows of it), not once per step
    assert projected == [(B, T + S - 1, 64)]
    ref_loss, ce, counts, correct = _reference_ttt(draft, aux, embeds, probs, in_vocab, loss_mask, doc, pos, S, decay)
    assert torch.allclose(loss.double(), ref_loss, rtol=1e-9), (float(loss), float(ref_loss))
    # and every parameter's gradient, through the shared projection's windows. The two agree to
    # ~1e-7 of the largest entry, not to float64's precision: the rotary tables are float32.
    named = [(n, p) for n, p in draft.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], retain_graph=True)
    ref_grads = torch.autograd.grad(ref_loss, [p for _, p in named])
    for (name, _), g, r in zip(named, grads, ref_grads):
        err, big = float((g - r).abs().max()), float(r.abs().max())
        assert big > 0 and err <= 1e-6 * big, (name, err, big)
    assert torch.allclose(stats[:, STAT_NAMES.index("ce_sum")], ce, rtol=1e-9)
    assert torch.equal(stats[:, STAT_NAMES.index("counted")].float(), counts)
    assert torch.equal(stats[:, STAT_NAMES.index("correct")].float(), correct)
    # the decay weights and the per-step normalisation matter: another decay gives another loss
    other, _ = TTTModel(draft, num_steps=S, decay=0.5, attention="sdpa")(aux, embeds, probs, in_vocab, loss_mask, pos, doc)
    assert not torch.allclose(other, loss)


def test_gradients_reach_only_draft_parameters():
    torch.manual_seed(0)
    cfg = _small_cfg()
    draft = Eagle3Draft(cfg)
    g = torch.Generator().manual_seed(1)
    V, H = cfg.vocab_size, cfg.hidden_size
    head = TargetHead(torch.randn(V, H, generator=g), torch.ones(H), torch.randn(V, H, generator=g), 1e-6,
                      draft.kept_token_ids + torch.arange(cfg.draft_vocab_size))  # ids 0, 2, 4, ...
    ids = torch.randint(0, V, (2, 30), generator=g)
    last = torch.randn(2, 30, H, generator=g, requires_grad=True)
    aux = torch.randn(2, 30, 3 * H, generator=g, requires_grad=True)
    probs, in_vocab = head.targets(last)
    embeds = head.embed(ids)
    assert not probs.requires_grad and not embeds.requires_grad  # targets and embeddings are constants
    loss, _ = TTTModel(draft, num_steps=3)(aux, embeds, probs, in_vocab, torch.ones(2, 30, dtype=torch.long),
                                          torch.arange(30).expand(2, 30), torch.zeros(2, 30, dtype=torch.long))
    loss.backward()
    for name, p in draft.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(not t.requires_grad and t.grad is None for t in head.buffers())
    assert list(head.parameters()) == []
    assert last.grad is None  # the target side is never differentiated
    assert draft.d2t.grad is None and draft.t2d.grad is None


def test_expected_acceptance_length():
    assert expected_acceptance_lengths([1.0, 1.0, 1.0]) == [2.0, 3.0, 4.0]
    assert expected_acceptance_lengths([0.5, 0.5]) == [1.5, 1.75]
    assert expected_acceptance_lengths([0.0, 1.0]) == [1.0, 1.0]


# -- data ------------------------------------------------------------------------------------------

def test_packing_order_and_collation():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 50, size=40)
    order = epoch_order(lengths, 64, seed=3, epoch=0, packing=True)
    flat = [i for row in order.rows for i in row]
    assert sorted(flat) == [i for i in range(40) if lengths[i] >= 3]  # each usable sample once
    assert all(sum(min(lengths[i], 64) for i in row) <= 64 for row in order.rows)
    assert order.rows == epoch_order(lengths, 64, seed=3, epoch=0, packing=True).rows  # deterministic
    assert order.rows != epoch_order(lengths, 64, seed=3, epoch=1, packing=True).rows  # reshuffled per epoch
    # a global batch does not depend on its split over processes and accumulation steps
    one = [r for a in range(2) for r in order.micro_batch(1, a, 0, 2, 2, 1)]  # 1 process, batch 2, accum 2
    two = [r for a in range(2) for rank in range(2) for r in order.micro_batch(1, a, rank, 1, 2, 2)]  # 2 x batch 1
    assert one == two == order.rows[4:8]
    item = lambda n, v: {"input_ids": torch.full((n,), v), "loss_mask": torch.ones(n, dtype=torch.bool),  # noqa: E731
                         "aux_hidden_states": torch.full((n, 3, 4), float(v)), "last_hidden_state": torch.zeros(n, 4)}
    b = collate([[item(3, 1), item(4, 2)], [item(5, 3)]], max_len=16, pad_to_multiple=4)
    assert b["input_ids"].shape == (2, 8)
    assert b["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert b["doc_ids"][0].tolist() == [0, 0, 0, 1, 1, 1, 1, -1] and b["doc_ids"][1].tolist()[-3:] == [-1] * 3
    assert b["loss_mask"][1].tolist() == [1] * 5 + [0] * 3 and b["aux_hidden_states"].shape == (2, 8, 12)


# -- the loop on a real store ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from conftest import build_tiny_llama

    # larger weights than the default init: the target's distributions are peaked, so there is
    # something to learn beyond the near-uniform distribution of a freshly initialised model
    return build_tiny_llama(tmp_path_factory.mktemp("target"), initializer_range=0.2)


@pytest.fixture(scope="module")
def store_dir(target_dir, tmp_path_factory):
    """A real hidden-state store (the extract stage's hf backend) of a few token sequences."""
    import datasets

    from eagle3.extract import DatasetSamples, EngineSpec, extract_store
    from eagle3.store import StoreLayout

    rng = np.random.default_rng(0)
    splits = {}
    for split, n in (("train", 12), ("eval", 3)):
        ids = [rng.integers(3, 300, size=int(rng.integers(20, 48))).tolist() for _ in range(n)]
        mask = [[0] * 4 + [1] * (len(x) - 4) for x in ids]
        splits[split] = DatasetSamples(datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": mask}))
    out = tmp_path_factory.mktemp("store")
    layout = StoreLayout(layer_ids=(1, 2, 3), last_layer_id=4, hidden_size=64, dtype="float32")
    engine = EngineSpec.for_splits(target_dir, layout, "float32",
                                   ExtractConfig(backend="hf", device="cpu", samples_per_shard=4), splits)
    res = extract_store(out, splits, engine, progress=False)
    assert res.complete
    return out


def make_inputs(store_dir, target_dir, eval_split="eval", full_vocab=False):
    """TrainInputs from a store and a target dir (also used by the subprocess runner)."""
    from eagle3.store import open_hidden_states
    from eagle3.target_weights import read_target_head
    from eagle3.train.loop import TrainInputs

    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    train = open_hidden_states(store_dir, "train")
    V = cfg["vocab_size"]
    Vd = V if full_vocab else 256
    kept = torch.arange(Vd)  # the first ids: the sampled sequences use ids 3..299
    d2t, t2d = kept - torch.arange(Vd), torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    dcfg = Eagle3DraftConfig.from_target(cfg, list(train.layer_ids), Vd)
    return TrainInputs(train_store=train, eval_store=open_hidden_states(store_dir, eval_split) if eval_split else None,
                       target=read_target_head(target_dir), rms_norm_eps=cfg["rms_norm_eps"], d2t=d2t, t2d=t2d,
                       draft_config=dcfg)


def test_tiny_draft_overfits_tiny_store(store_dir, target_dir, tmp_path):
    from eagle3.train.loop import train

    # eval on the training split itself: how well the draft fits what it was trained on
    inputs = make_inputs(store_dir, target_dir, eval_split="train", full_vocab=True)
    tcfg = TrainConfig(ttt_steps=2, max_steps=400, lr=5e-3, warmup_steps=10, batch_size=2, max_seq_len=128,
                       log_every=50, eval_every=400, save_every=400)
    result = train(tcfg, inputs, tmp_path, progress=False)
    acc0 = result.eval.acc_per_step[0]
    assert acc0 > 0.95, result.eval
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert result.train.loss < first["train/loss"]
    assert (tmp_path / "draft.safetensors").exists() and (tmp_path / "draft_vllm_config.json").exists()


def test_a_compiled_run_says_it_compiles_and_how_long_the_first_step_took(store_dir, target_dir, tmp_path,
                                                                          monkeypatch, caplog):
    """The first compiled step can take minutes in silence (progress off): the loop says it compiles,
    with how many threads, and how long the first step took. (torch.compile returns the function
    itself here: the loop's compiled path without a CPU compilation.)"""
    import logging

    from eagle3.train.loop import train

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    tcfg = TrainConfig(ttt_steps=2, max_steps=2, batch_size=2, max_seq_len=128, compile="true", attention="sdpa",
                       log_every=1, eval_every=100, save_every=100)
    with caplog.at_level(logging.INFO, logger="eagle3.train"):
        train(tcfg, make_inputs(store_dir, target_dir, eval_split=None), tmp_path, progress=False)
    said = [r.getMessage() for r in caplog.records if r.name == "eagle3.train"]
    assert any(m.startswith("train: compiling the training step (torch.compile, ") and "compile threads" in m
               for m in said), said
    assert sum(m.startswith("train: first step done in ") for m in said) == 1, said


def test_prefetch_thread_trains_the_same_model(store_dir, target_dir, tmp_path):
    """The loop's batches read and collated in a background thread (what a GPU run does with
    train.num_workers=0) give the same losses, evals and weights as reading them on the loop's thread."""
    from safetensors.torch import load_file

    from eagle3.train.loop import train

    tcfg = TrainConfig(ttt_steps=2, max_steps=12, lr=1e-3, warmup_steps=2, batch_size=2, max_seq_len=128,
                       log_every=1, eval_every=6, save_every=100)
    for name, prefetch in (("inline", False), ("thread", True)):
        train(tcfg, make_inputs(store_dir, target_dir, eval_split="eval"), tmp_path / name, progress=False,
              prefetch=prefetch)
    assert _losses(tmp_path / "thread") == _losses(tmp_path / "inline")
    a, b = load_file(tmp_path / "inline" / "draft.safetensors"), load_file(tmp_path / "thread" / "draft.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_prefetcher_keeps_order_raises_errors_and_stops():
    import itertools
    import threading

    from eagle3.train.data import Prefetcher

    assert list(Prefetcher(iter(range(50)), depth=3)) == list(range(50))

    def failing():
        yield 1
        raise OSError("disk gone")

    p = Prefetcher(failing())
    assert next(p) == 1
    with pytest.raises(OSError, match="disk gone"):
        next(p)
    with pytest.raises(StopIteration):  # after an error it is finished
        next(p)
    p.close()

    # close() while the thread waits for room in a full queue, over an endless source
    p = Prefetcher(itertools.count(), depth=1)
    assert [next(p) for _ in range(3)] == [0, 1, 2]
    p.close()
    assert not any(t.name == "eagle3-prefetch" and t.is_alive() for t in threading.enumerate())


RUNNER = """
import json, logging, sys
logging.basicConfig(level=logging.INFO)
sys.path.insert(0, {tests!r})
from pathlib import Path
from eagle3.config import TrainConfig
from eagle3.train.loop import train
from test_train import make_inputs
kw = json.loads(sys.argv[2])
train(TrainConfig(**kw), make_inputs({store!r}, {target!r}, eval_split="eval"), Path(sys.argv[1]), progress=False)
"""


def _runner(tmp_path, store_dir, target_dir) -> Path:
    p = tmp_path / "runner.py"
    p.write_text(RUNNER.format(tests=str(TESTS), store=str(store_dir), target=str(target_dir)))
    return p


def _env():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("WANDB_MODE", None)
    return env


def _losses(out: Path) -> list:
    return [(r["step"], r.get("train/loss", r.get("eval/loss")), r.get("grad_norm"))
            for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def test_resume_after_kill9_logs_the_same_losses(store_dir, target_dir, tmp_path):
    runner = _runner(tmp_path, store_dir, target_dir)
    kw = json.dumps(dict(ttt_steps=2, max_steps=150, lr=1e-3, warmup_steps=3, batch_size=2, max_seq_len=128,
                         log_every=1, save_every=10, eval_every=25, keep_last=2))
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    subprocess.run([sys.executable, str(runner), str(whole), kw], check=True, env=_env(), timeout=600)
    proc = subprocess.Popen([sys.executable, str(runner), str(broken), kw], env=_env())
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:  # kill mid-run, after a checkpoint exists
        m = broken / "metrics.jsonl"
        if (broken / "checkpoints" / "step-00000020" / "COMPLETE").exists() and m.exists() \
                and len(m.read_text().splitlines()) >= 25:
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.01)
    assert proc.wait(timeout=60) == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (broken / "draft.safetensors").exists()
    subprocess.run([sys.executable, str(runner), str(broken), kw], check=True, env=_env(), timeout=600)
    assert _losses(broken) == _losses(whole)
    assert len(_losses(whole)) == 150 + 6  # every step logged once, and the evals
    assert len(list((broken / "checkpoints").glob("step-*"))) == 2  # keep_last


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_two_processes_and_accumulation_train_the_same_model_as_one(optimizer, store_dir, target_dir, tmp_path):
    """muon: each rank holds the whole all-reduced gradient of every matrix, so Muon's per-matrix
    update is the same on every rank and equals the one-process update; FastMuon computes each
    matrix's on one rank and broadcasts it (train.muon_shard)."""
    from safetensors.torch import load_file

    runner = _runner(tmp_path, store_dir, target_dir)
    base = dict(ttt_steps=2, max_steps=4, lr=1e-3, warmup_steps=1, max_seq_len=128, log_every=1,
                save_every=100, eval_every=4, optimizer=optimizer)
    one, two = tmp_path / "one", tmp_path / "two"
    subprocess.run([sys.executable, str(runner), str(one), json.dumps(dict(base, batch_size=2))], check=True,
                   env=_env(), timeout=600)
    # gloo on CPU; ACCELERATE_USE_CPU is what `accelerate launch --cpu` sets
    run2 = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           "29533", str(runner), str(two), json.dumps(dict(base, batch_size=1))],
                          env=dict(_env(), ACCELERATE_USE_CPU="1"), timeout=600, capture_output=True, text=True)
    assert run2.returncode == 0, run2.stdout[-3000:] + run2.stderr[-3000:]
    # FastMuon split the Newton-Schulz work over the two processes (train.muon_shard, its default)
    assert ("Newton-Schulz split over 2 processes" in run2.stderr) == (optimizer == "muon"), run2.stderr[-3000:]
    # and one process accumulating two micro-batches of one row
    accum = tmp_path / "accum"
    subprocess.run([sys.executable, str(runner), str(accum), json.dumps(dict(base, batch_size=1, grad_accum=2))],
                   check=True, env=_env(), timeout=600)
    a, b, c = (load_file(str(d / "draft.safetensors")) for d in (one, two, accum))
    diff = max((a[k] - x[k]).abs().max().item() for x in (b, c) for k in a if a[k].is_floating_point())
    # torch's Muon orthogonalises in bfloat16 (_zeropower_via_newtonschulz): gradients that differ in
    # float32 summation order (all-reduce, accumulation) may round to another bf16 value, moving an
    # update by up to ~2 bf16 ulps of its size (lr x 0.2 sqrt(192) for the widest matrix, fc) per step
    bound = 1e-5 if optimizer == "adamw" else base["max_steps"] * TrainConfig().muon_lr * 0.2 * 192 ** 0.5 * 2 ** -7
    assert diff < bound, (diff, bound)
    rtol = 1e-5 if optimizer == "adamw" else 1e-4
    assert np.allclose([x for _, x, _ in _losses(accum)], [x for _, x, _ in _losses(one)], rtol=rtol)
    la, lb = _losses(one), _losses(two)
    assert [s for s, _, _ in la] == [s for s, _, _ in lb]
    assert np.allclose([x for _, x, _ in la], [x for _, x, _ in lb], rtol=rtol)
    assert np.allclose([g for _, _, g in la if g], [g for _, _, g in lb if g], rtol=1e-4)
    assert len({round(x, 6) for _, x, _ in la}) > 2  # the model did change between steps


def test_target_head_ties_resolve_as_full_vocab_argmax():
    """Exact ties between a kept and an other token (as bf16 logits often have): in_vocab follows
    argmax over the full row, i.e. the lower target id wins, whichever side of the split it is on."""
    V, H = 12, 4
    lm = torch.zeros(V, H)
    lm[:, 0] = torch.arange(V, dtype=torch.float32) * 0.01  # distinct, small
    kept = torch.tensor([1, 3, 4, 8, 10])
    lm[3] = lm[6] = torch.tensor([0.0, 2.0, 0.0, 0.0])  # kept 3 ties other 6: 3 wins
    lm[7] = lm[10] = torch.tensor([0.0, 0.0, 2.0, 1.0])  # other 7 ties kept 10: 7 wins
    lm[5] = torch.tensor([0.0, 0.0, 0.0, 3.0])  # an other token alone at the top
    lm[8] = torch.tensor([0.0, -4.0, 0.0, 0.0])  # a kept token alone at the top
    head = TargetHead(torch.zeros(V, H), torch.ones(H), lm, 1e-6, kept, vocab_chunk=2, row_chunk=3)
    x = torch.tensor([[0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 2.0, 1.0], [0.0, 0.0, 0.0, 1.0], [0.0, -1.0, 0.0, 0.0],
                      [1.0, 0.0, -1.0, -1.0]])
    probs, in_vocab = head.targets(x)
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    full = xn @ lm.T
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    assert full.argmax(-1).tolist() == [3, 7, 5, 8, 11]
    assert in_vocab.tolist() == t2d[full.argmax(-1)].tolist() == [True, False, False, True, False]
    assert torch.allclose(probs, full[:, kept].softmax(-1), atol=1e-6)
    assert torch.equal(head.kept_lm_head(), lm[kept])


def test_clip_folded_into_fused_adamw_is_clip_grad_norm():
    """fold_clip + fused AdamW takes the steps clip_grad_norm_ + fused AdamW takes, for gradients
    above and below the clipping norm, and returns the same norm."""
    from conftest import fold_against_clip

    from eagle3.train.optim import can_fold

    def make():
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(300, generator=g)), torch.nn.Parameter(torch.randn(7, 5, generator=g))]
        return torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01, fused=True), ps, g

    (folded, n1), (plain, n2) = fold_against_clip(make)
    assert n1 == pytest.approx(n2, rel=1e-6) and max(n1) > 0.5 > min(n1)  # both regimes occur
    assert torch.allclose(folded, plain, rtol=0, atol=1e-6)
    assert not can_fold(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], foreach=True))


@pytest.mark.parametrize("compile_", [False, True])
def test_compiled_adamw_takes_fused_adamws_steps(compile_):
    """train.adamw_impl=compiled: the same parameters and state as fused AdamW after steps with a
    changing rate, clip coefficient and per-group weight decay; compiled (on CPU here, with no
    recompilation after its first step) and eager alike."""
    import torch._dynamo
    from conftest import compiled_adamw_against_fused
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # what earlier tests compiled in this process
    with torch._dynamo.config.patch(error_on_recompile=False):
        mine, ref, opt, ref_opt = compiled_adamw_against_fused(compile_)
    for a, b in zip(mine, ref):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max(), float((a - b).abs().max())
        sa, sb = opt.state[a], ref_opt.state[b]
        assert float(sa["step"]) == float(sb["step"]) == 12.0
        assert sa["step"].dtype == sb["step"].dtype == torch.float32
        for k in ("exp_avg", "exp_avg_sq"):  # lerp against fused's beta1 m + (1 - beta1) g: float32 rounding apart
            assert (sa[k] - sb[k]).abs().max() <= 1e-6 * sb[k].abs().max(), k
    # every step moved the parameters: the comparison is not of two idle optimizers
    g = torch.Generator().manual_seed(0)
    assert (mine[0] - torch.randn(64, 33, generator=g)).abs().min() > 0
    if compile_:  # per group, one graph with grad_scale and one without: 12 rates and step counts, no new graph
        assert counters["stats"]["unique_graphs"] == 4, dict(counters["stats"])


def test_compiled_adamw_checkpoint_resumes_in_fused_adamw_and_folds_the_clip():
    """Its state_dict loads into fused AdamW (and back) and continues the same run; fold_clip with
    it is clip_grad_norm_ then the step."""
    from conftest import fold_against_clip

    from eagle3.train.optim import CompiledAdamW, can_fold

    def run(first, second, n1=3, n2=3):
        g = torch.Generator().manual_seed(1)
        ps = [torch.nn.Parameter(torch.randn(40, 7, generator=g))]
        kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.05)
        make = {"compiled": lambda: CompiledAdamW(ps, compile=False, **kw),
                "fused": lambda: torch.optim.AdamW(ps, fused=True, **kw)}
        opt = make[first]()
        for i in range(n1 + n2):
            if i == n1:
                state = opt.state_dict()
                opt = make[second]()
                opt.load_state_dict(state)
            ps[0].grad = torch.randn(40, 7, generator=g)
            opt.step()
        return ps[0].detach().clone()
    straight = run("fused", "fused")
    for first, second in (("compiled", "fused"), ("fused", "compiled"), ("compiled", "compiled")):
        assert torch.allclose(run(first, second), straight, rtol=0, atol=1e-6), (first, second)

    def make():
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(300, generator=g)), torch.nn.Parameter(torch.randn(7, 5, generator=g))]
        return CompiledAdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01, compile=False), ps, g
    assert can_fold(make()[0])
    (folded, n1), (plain, n2) = fold_against_clip(make)
    assert n1 == pytest.approx(n2, rel=1e-6) and max(n1) > 0.5 > min(n1)
    assert torch.allclose(folded, plain, rtol=0, atol=1e-6)


def test_adamw_impl_picks_the_optimizer_for_both_recipes():
    from eagle3.config import TrainConfig
    from eagle3.train.optim import CompiledAdamW, MuonWithAdamW, build_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    base = dict(lr=1e-3, compile="false")
    cpu = torch.device("cpu")
    for impl, cls in (("auto", torch.optim.AdamW), ("fused", torch.optim.AdamW), ("compiled", CompiledAdamW)):
        opt = build_optimizer(model, TrainConfig(optimizer="adamw", adamw_impl=impl, **base), cpu)
        assert type(opt) is cls and (cls is CompiledAdamW or opt.defaults["fused"]), impl
        muon = build_optimizer(model, TrainConfig(optimizer="muon", adamw_impl=impl, **base), cpu)
        assert isinstance(muon, MuonWithAdamW) and type(muon.adamw) is cls, impl
    with pytest.raises(ValueError, match="train.adamw_impl='apex' is not one of"):
        TrainConfig(adamw_impl="apex")
    # auto: compiled on CUDA when the step is compiled and the parameters are whole; FSDP shards refuse compiled
    from eagle3.train.optim import adamw_impl

    cuda = torch.device("cuda")
    for compile_, sharded, want in (("auto", False, "compiled"), ("true", False, "compiled"),
                                    ("false", False, "fused"), ("auto", True, "fused")):
        assert adamw_impl(TrainConfig(adamw_impl="auto", compile=compile_), cuda, sharded) == want
    assert adamw_impl(TrainConfig(adamw_impl="auto", compile="true"), cpu) == "fused"
    # Muon's AdamW half: fused under auto, compiled when asked for
    assert adamw_impl(TrainConfig(adamw_impl="auto", compile="auto"), cuda, auto_compiled=False) == "fused"
    assert adamw_impl(TrainConfig(adamw_impl="compiled", compile="auto"), cuda, auto_compiled=False) == "compiled"
    with pytest.raises(ValueError, match="not supported with FSDP"):
        adamw_impl(TrainConfig(adamw_impl="compiled", compile="auto"), cuda, sharded=True)


def test_ttt_forward_traces_as_one_graph():
    """The unrolled TTT forward is compiled as one graph on GPU (train.compile=auto); a graph
    break (an op dynamo cannot trace, e.g. reading a tensor's storage offset) silently splits it
    and runs the rest op by op (measured: 70 -> 90 ms per step on the H200). Traced here with
    fullgraph=True through AOTAutograd (forward and backward), on the sdpa path: everything but
    the attention call is the code the flex path runs."""
    torch.manual_seed(0)
    cfg = _small_cfg()
    draft = Eagle3Draft(cfg)
    B, T, S = 2, 24, 3
    args = (torch.randn(B, T, 3 * 64), torch.randn(B, T, 64),
            torch.softmax(torch.randn(B, T, cfg.draft_vocab_size), -1), torch.rand(B, T) > 0.2,
            torch.ones(B, T, dtype=torch.long), torch.arange(T).expand(B, T), torch.zeros(B, T, dtype=torch.long))
    eager = TTTModel(draft, num_steps=S, attention="sdpa")
    ref_loss, ref_stats = eager(*args)
    traced = TTTModel(draft, num_steps=S, attention="sdpa")
    traced._core = torch.compile(traced._core, fullgraph=True, backend="aot_eager", dynamic=False)
    loss, stats = traced(*args)  # raises on any graph break
    loss.backward()
    assert torch.allclose(loss, ref_loss, rtol=1e-5) and torch.equal(stats, ref_stats)
    assert all(p.grad is not None for p in draft.parameters())


def _random_head(seed: int, n_kept: int, lead: tuple, V: int = 97, H: int = 16, **chunks):
    """(a TargetHead of random V x H tensors keeping ``n_kept`` random ids, random last hidden states
    [*lead, H])."""
    g = torch.Generator().manual_seed(seed)
    kept = torch.randperm(V, generator=g)[:n_kept].sort().values
    head = TargetHead(torch.randn(V, H, generator=g), torch.rand(H, generator=g) + 0.5, torch.randn(V, H, generator=g),
                      1e-6, kept, **chunks)
    return head, torch.randn(*lead, H, generator=g)


def test_compiled_target_head_traces_as_one_graph_and_equals_eager():
    """The target head is compiled on GPU with the TTT model (train.compile=auto): traced whole
    (fullgraph, AOTAutograd) it gives what the eager head gives, several row and vocab chunks."""
    head, x = _random_head(3, 30, (3, 10), vocab_chunk=16, row_chunk=7)
    probs, in_vocab = head.targets(x)
    head.compile = True
    head._compiled = torch.compile(head._targets, fullgraph=True, backend="aot_eager", dynamic=False)
    cprobs, cin = head.targets(x)
    assert torch.equal(cin, in_vocab) and 0 < in_vocab.float().mean() < 1
    assert torch.allclose(cprobs, probs, rtol=0, atol=1e-7)


def test_fsdp_must_wrap_the_draft_as_one_unit():
    """FSDP only runs on GPU process groups (Accelerate turns it off on CPU), so the accelerator is
    a stand-in here: a wrap policy that would shard submodules apart is refused with the fix."""
    import functools
    from types import SimpleNamespace

    from accelerate.utils import DistributedType
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    from eagle3.train.loop import check_fsdp_wrapping

    def acc(kind, policy):
        return SimpleNamespace(distributed_type=kind, state=SimpleNamespace(fsdp_plugin=SimpleNamespace(auto_wrap_policy=policy)))
    check_fsdp_wrapping(acc(DistributedType.FSDP, None))  # NO_WRAP
    check_fsdp_wrapping(acc(DistributedType.MULTI_GPU, functools.partial(size_based_auto_wrap_policy)))
    with pytest.raises(ValueError, match="NO_WRAP") as e:
        check_fsdp_wrapping(acc(DistributedType.FSDP, functools.partial(size_based_auto_wrap_policy, min_num_params=10)))
    assert "size_based_auto_wrap_policy" in str(e.value)


def test_checkpoints_hold_only_trained_state_and_the_draft_the_vocab_mapping(store_dir, target_dir, tmp_path):
    """What the loop shards, checkpoints and gathers is the trained parameters alone (Accelerate's
    FSDP2 loading takes every state-dict entry for a sharded parameter, so a buffer there fails);
    the vocabulary mapping, an input, is written into draft.safetensors as given."""
    import dataclasses

    from safetensors.torch import load_file

    from eagle3.train.loop import train

    inputs = make_inputs(store_dir, target_dir, eval_split=None)
    V, Vd = inputs.t2d.numel(), inputs.d2t.numel()
    kept = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    inputs = dataclasses.replace(inputs, d2t=kept - torch.arange(Vd), t2d=t2d)
    train(TrainConfig(ttt_steps=2, max_steps=2, batch_size=2, max_seq_len=128, save_every=2), inputs, tmp_path,
          progress=False)
    saved = load_file(str(tmp_path / "checkpoints" / "step-00000002" / "model.safetensors"))
    params = {"draft." + n for n, _ in Eagle3Draft(inputs.draft_config).named_parameters()}
    assert set(saved) == params
    draft = load_file(str(tmp_path / "draft.safetensors"))
    assert torch.equal(draft["d2t"], kept - torch.arange(Vd)) and torch.equal(draft["t2d"], t2d)
    assert set(draft) == {n[len("draft."):] for n in params} | {"d2t", "t2d"}


def test_accelerate_launch_trains_the_one_process_model(tmp_path):
    """`accelerate launch --multi_gpu` as users start the loop (here gloo processes, with
    ACCELERATE_USE_CPU): bench/train_dist.py's check trains one process with batch 2 and two with
    batch 1 each, deletes the second run's last checkpoint and draft and resumes it; all must agree. On GPUs
    the same script checks FSDP2 (bench/results/train_h200_202611.md)."""
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([sys.executable, str(REPO / "bench" / "train_dist.py"), "--cpu", "--parts", "check",
                        "--modes", "ddp", "--check-steps", "4", "--keep", str(tmp_path / "runs")],
                       env=dict(_env(), OUT=str(out)), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (row,) = json.loads((out / "bench_train_dist.json").read_text())["check"][1:]
    assert row["mode"] == "ddp" and row["processes"] == 2 and row["steps"] == 4 and row["ok"]
    assert row["resumed_steps_logged"] == 4 and row["resumed_draft_max_abs_diff"] < 1e-5
    log = (tmp_path / "runs" / "launch.log").read_text()
    assert "accelerate.commands.launch --num_processes 2" in log and "--multi_gpu" in log


def test_step_metrics_log_under_the_keys_dashboards_read():
    """StepMetrics.to_log (eagle3.contracts) writes the flat keys metrics.jsonl and wandb have always had (notebooks
    and dashboards read them), with the values of the summed statistics."""
    from eagle3.train.metrics import step_metrics

    names = ("ce_sum", "scored", "counted", "correct", "cond_correct", "cond_total")
    assert STAT_NAMES == names
    stats = torch.tensor([[8.0, 4, 5, 2, 2, 4], [9.0, 3, 4, 3, 1, 2], [0.0, 0, 3, 0, 0, 0]], dtype=torch.float64)
    m = step_metrics(stats, decay=0.5)
    assert m.loss == pytest.approx(8 / 5 + 0.5 * 9 / 4 + 0.25 * 0 / 3)
    log = m.to_log("eval")
    assert set(log) == {"eval/loss", "eval/scored_positions", *(f"eval/{k}_step_{j}" for k in ("loss", "acc", "cond_acc")
                                                                for j in range(3)), "eval/accept_len_k1",
                        "eval/accept_len_k2", "eval/accept_len_k3"}
    assert log["eval/loss_step_0"] == 2.0 and log["eval/acc_step_1"] == 1.0 and np.isnan(log["eval/acc_step_2"])
    assert log["eval/cond_acc_step_1"] == 0.5 and log["eval/cond_acc_step_2"] == 0.0
    assert [log[f"eval/accept_len_k{k}"] for k in (1, 2, 3)] == pytest.approx([1.5, 1.75, 1.75])
    assert log["eval/scored_positions"] == 4.0 and log["eval/loss"] == m.loss


# -- Muon ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["fast", "torch"])
def test_muon_with_adamw_steps_as_the_two_optimizers_and_restores_exactly(impl):
    """train.optimizer=muon: Muon on the hidden path's 2-D weights, AdamW on lm_head and the norms;
    one optimizer whose steps equal the Muon (train.muon_impl: FastMuon or torch's) and AdamW
    stepped side by side, both scaled by the LR schedule, and whose state_dict resumes bit for bit."""
    import copy

    from eagle3.kernels.muon import FastMuon
    from eagle3.train.optim import MuonWithAdamW, build_optimizer, lr_schedule, split_for_muon

    cfg = _small_cfg()
    cfg.fc_norm = True
    tcfg = TrainConfig(optimizer="muon", lr=1e-3, muon_lr=2e-2, weight_decay=0.01, warmup_steps=2, max_steps=8,
                       muon_impl=impl)
    muon, rest = split_for_muon(Eagle3Draft(cfg).named_parameters())
    assert {n for n, _ in muon} == {"fc.weight"} | {f"midlayer.self_attn.{x}_proj.weight" for x in "qkvo"} | {
        f"midlayer.mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
    assert {n for n, _ in rest} == {"lm_head.weight", "norm.weight", "fc_norm.0.weight", "fc_norm.1.weight",
                                    "fc_norm.2.weight"} | {f"midlayer.{x}.weight" for x in (
                                        "input_layernorm", "hidden_norm", "post_attention_layernorm")}

    def grads(model, i):
        g = torch.Generator().manual_seed(i)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)

    torch.manual_seed(0)
    a = Eagle3Draft(cfg)
    b = copy.deepcopy(a)
    opt = build_optimizer(a, tcfg, torch.device("cpu"))
    assert isinstance(opt, MuonWithAdamW)
    sched = lr_schedule(opt, tcfg, 8)
    names = dict(b.named_parameters())
    ref_m = (FastMuon if impl == "fast" else torch.optim.Muon)(
        [names[n] for n, _ in muon], lr=2e-2, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    assert type(opt.muon) is type(ref_m)
    ref_a = torch.optim.AdamW([names[n] for n, _ in rest], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    ref_s = [lr_schedule(o, tcfg, 8) for o in (ref_m, ref_a)]
    for i in range(4):
        grads(a, i)
        grads(b, i)
        opt.step()
        ref_m.step()
        ref_a.step()
        sched.step()
        for s_ in ref_s:
            s_.step()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-6), n
    assert [g["lr"] for g in opt.param_groups] == [ref_m.param_groups[0]["lr"], ref_a.param_groups[0]["lr"]]

    # resume: a fresh optimizer loaded from the state dict continues exactly as the original
    c = copy.deepcopy(a)
    opt2 = build_optimizer(c, tcfg, torch.device("cpu"))
    sched2 = lr_schedule(opt2, tcfg, 8)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    sched2.load_state_dict(sched.state_dict())
    assert opt2.muon.state is opt2.state and opt2.muon.param_groups[0] is opt2.param_groups[0]
    for i in range(4, 8):
        for m_, o_, s_ in ((a, opt, sched), (c, opt2, sched2)):
            grads(m_, i)
            o_.step()
            s_.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_muon_resume_logs_the_same_losses(store_dir, target_dir, tmp_path):
    """The loop with train.optimizer=muon, resumed from its step-10 checkpoint, logs exactly the losses
    (and gradient norms) of the uninterrupted run (the kill -9 itself is AdamW's test above)."""
    import shutil

    from eagle3.train.loop import train

    tcfg = TrainConfig(optimizer="muon", ttt_steps=2, max_steps=20, lr=1e-3, warmup_steps=3, batch_size=2,
                       max_seq_len=128, log_every=1, save_every=10, eval_every=100, keep_last=2)
    whole = tmp_path / "whole"
    train(tcfg, make_inputs(store_dir, target_dir, eval_split=None), whole, progress=False)
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    shutil.rmtree(cut / "checkpoints" / "step-00000020")  # as if killed after step 10's checkpoint
    for f in cut.glob("draft*"):
        f.unlink()
    lines = (cut / "metrics.jsonl").read_text().splitlines()
    lines[0] = json.dumps({**json.loads(lines[0]), "kept_by_the_resume": True})  # a fresh run would drop it
    (cut / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    train(tcfg, make_inputs(store_dir, target_dir, eval_split=None), cut, progress=False)
    assert json.loads((cut / "metrics.jsonl").read_text().splitlines()[0])["kept_by_the_resume"]
    assert _losses(cut) == _losses(whole) and len(_losses(whole)) == 20
    assert len({x for _, x, _ in _losses(whole)}) > 10  # the model did change


def test_fast_muon_trains_the_loss_curve_of_torchs_muon(store_dir, target_dir, tmp_path):
    """The train loop with train.muon_impl=fast (FastMuon) logs the losses of torch's Muon within
    bf16 rounding of the update: a short run, fc and the MLP on the Gram form, the rest standard."""
    from eagle3.train.loop import train

    runs = {}
    for impl in ("torch", "fast"):
        tcfg = TrainConfig(optimizer="muon", muon_impl=impl, ttt_steps=2, max_steps=20, lr=1e-3, muon_lr=2e-2,
                           warmup_steps=3, batch_size=2, max_seq_len=128, log_every=1, save_every=100,
                           eval_every=100)
        train(tcfg, make_inputs(store_dir, target_dir, eval_split=None), tmp_path / impl, progress=False)
        runs[impl] = _losses(tmp_path / impl)
    lt, lf = ([x for _, x, _ in runs[k]] for k in ("torch", "fast"))
    assert len(lt) == len(lf) == 20 and lt[0] == lf[0]  # the first step's loss precedes any update
    assert lt[-1] < 0.9 * lt[0]  # it learned something
    print("loss torch", lt[0], lt[-1], "max |fast/torch - 1|", max(abs(a / b - 1) for a, b in zip(lf, lt)))
    assert np.allclose(lf, lt, rtol=2e-3), max(abs(a / b - 1) for a, b in zip(lf, lt))


def test_muon_is_refused_under_fsdp():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from eagle3.train.optim import check_optimizer_distribution

    fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP)
    with pytest.raises(ValueError, match="not supported with FSDP.*use train.optimizer=adamw"):
        check_optimizer_distribution(fsdp, TrainConfig(optimizer="muon"))
    check_optimizer_distribution(fsdp, TrainConfig())  # AdamW shards as before
    check_optimizer_distribution(SimpleNamespace(distributed_type=DistributedType.MULTI_GPU), TrainConfig(optimizer="muon"))


# -- the target head's in_vocab cache ------------------------------------------------------------------

def test_target_head_given_in_vocab_skips_the_other_rows_and_returns_it():
    """targets(in_vocab=...) returns the same probabilities and the mask it was given, without
    multiplying the lm_head rows outside the draft vocabulary."""
    head, x = _random_head(0, 40, (2, 23), vocab_chunk=7, row_chunk=5)
    probs, in_vocab = head.targets(x)
    rows = []
    head.head_rows = _RowWatch(head.head_rows, rows)  # records which rows each matmul reads
    probs2, given = head.targets(x, in_vocab=~in_vocab)
    assert torch.equal(probs2, probs) and torch.equal(given, ~in_vocab)
    assert rows and all(stop <= head.draft_vocab_size for stop in rows), rows


class _RowWatch(torch.Tensor):
    """A tensor that records the stop row of every slice taken from it (what the head multiplies)."""

    @staticmethod
    def __new__(cls, t, log):
        r = t.as_subclass(cls)
        r._log = log
        return r

    def __getitem__(self, key):
        if isinstance(key, slice):
            self._log.append(key.stop if key.stop is not None else self.shape[0])
        return torch.Tensor.__getitem__(self.as_subclass(torch.Tensor), key)


def test_in_vocab_cache_gives_a_repacked_batch_what_the_head_computes():
    """Samples scored in one packing, looked up in another (other rows, other offsets, one sample
    cut shorter): the cached bits equal the head's own on every token; a batch with a sample not yet
    scored, or with more of a sample's tokens than were scored, is a miss."""
    from eagle3.train.target_head import InVocabCache, model_inputs

    g = torch.Generator().manual_seed(1)
    V, H = 61, 8
    kept = torch.randperm(V, generator=g)[:20].sort().values
    head = TargetHead(torch.randn(V, H, generator=g), torch.ones(H), torch.randn(V, H, generator=g), 1e-6, kept)
    lengths = [5, 7, 4, 9]
    items = [{"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.bool),
              "aux_hidden_states": torch.zeros(n, 3, H), "last_hidden_state": torch.randn(n, H, generator=g)}
             for n in lengths]

    def batch(rows, max_len=16):
        return collate([[items[i] for i in r] for r in rows], max_len, pad_to_multiple=4, ids=rows)

    cache = InVocabCache(lengths, 16, "cpu")
    first = batch([[0, 1], [2]])
    model_inputs(head, first, torch.float32, cache)  # a miss: computed and stored
    assert (cache.hits, cache.misses) == (0, 1)
    again = batch([[2, 1], [0]])
    assert again["docs"] == (((2, 4), (1, 7)), ((0, 5),))
    cached = cache.lookup(again)
    _, fresh = head.targets(again["last_hidden_state"])
    real = again["doc_ids"] >= 0
    assert cached is not None and torch.equal(cached[real], fresh[real])
    assert 0 < fresh[real].float().mean() < 1  # both values occur
    assert cache.lookup(batch([[0, 3]])) is None  # sample 3 never scored
    short = batch([[2, 1]], max_len=8)  # sample 1 cut to 4 tokens: known
    assert short["docs"] == (((2, 4), (1, 4)),) and cache.lookup(short) is not None
    mi = model_inputs(head, again, torch.float32, cache)
    assert torch.equal(mi["in_vocab"][real], fresh[real])
    assert (cache.hits, cache.misses) == (3, 2)


def test_in_vocab_cache_trains_the_same_model_and_is_used_from_the_second_epoch(store_dir, target_dir, tmp_path,
                                                                                 caplog):
    """A run of several epochs with train.target_cache (the default) logs the losses and writes the
    weights of the same run without it; its later epochs took in_vocab from the cache."""
    import logging

    from safetensors.torch import load_file

    from eagle3.train.loop import train

    tcfg = dict(ttt_steps=2, max_steps=8, lr=1e-3, warmup_steps=2, batch_size=2, max_seq_len=128, log_every=1,
                eval_every=100, save_every=100)
    with caplog.at_level(logging.INFO, logger="eagle3.train"):
        for name, on in (("cached", True), ("plain", False)):
            train(TrainConfig(**tcfg, target_cache=on), make_inputs(store_dir, target_dir, eval_split=None),
                  tmp_path / name, progress=False)
    said = [r.getMessage() for r in caplog.records if r.name == "eagle3.train"]
    used = [m for m in said if m.startswith("train: the target head took in_vocab from its cache")]
    assert len(used) == 1 and not used[0].startswith("train: the target head took in_vocab from its cache for 0 "), said
    assert sum(m.startswith("train: caching the target head's in_vocab bit") for m in said) == 1, said
    assert _losses(tmp_path / "cached") == _losses(tmp_path / "plain")
    a, b = load_file(tmp_path / "cached" / "draft.safetensors"), load_file(tmp_path / "plain" / "draft.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- the draft head on the loss rows only (train.loss_rows_only) -----------------------------------

def _masked_batch(cfg, B=2, T=37, seed=0, dtype=torch.float64):
    """A batch with prompts (spans without loss), two documents in a row and right padding."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.tensor([[0] * 15 + [1] * 22, [0] * 30 + [-1] * 7])[:B, :T]
    pos = torch.cat([torch.arange(15), torch.arange(22)]).expand(B, T).clone()
    pos[1] = torch.arange(T)
    loss_mask = torch.ones(B, T, dtype=torch.long)
    loss_mask[0, :6] = loss_mask[0, 15:24] = loss_mask[1, :11] = 0  # the prompts
    loss_mask[1, 30:] = 0
    args = dict(aux=torch.randn(B, T, 3 * cfg.hidden_size, generator=g, dtype=dtype),
                embeds=torch.randn(B, T, cfg.hidden_size, generator=g, dtype=dtype),
                target_probs=torch.softmax(3 * torch.randn(B, T, cfg.draft_vocab_size, generator=g, dtype=dtype), -1),
                in_vocab=torch.rand(B, T, generator=g) > 0.2, loss_mask=loss_mask, position_ids=pos, doc_ids=doc)
    return args


def test_head_rows_are_each_steps_loss_positions_padded_with_a_row_without_loss():
    from eagle3.train.ttt import HEAD_ROWS_MULTIPLE, head_rows, step_masks

    cfg = _small_cfg()
    b = _masked_batch(cfg)
    S = 4
    rows = head_rows(b["loss_mask"], b["doc_ids"], S)
    counted, _ = step_masks(b["loss_mask"].bool() & (b["doc_ids"] >= 0), b["doc_ids"],
                            torch.ones_like(b["in_vocab"]), S)
    want = counted.flatten().nonzero().squeeze(1)
    assert rows.dtype == torch.long and len(rows) % HEAD_ROWS_MULTIPLE == 0 and len(rows) >= len(want)
    assert torch.equal(rows[:len(want)], want)  # every loss position, in order
    assert not counted.flatten()[rows[len(want):]].any()  # the padding: rows without loss
    assert 0 < len(want) < counted.numel()  # prompts and padding were left out
    # a batch whose every position has loss leaves no row out once padded: the head takes every position
    full = torch.ones(1, 125, dtype=torch.long)
    assert head_rows(full, torch.zeros_like(full), S) is None
    assert len(head_rows(full, torch.zeros_like(full), S, multiple=8)) == 4 * 125 - (2 + 3 + 4 + 5) + 2


def test_remap_rows_follows_right_padding():
    from eagle3.train.ttt import remap_rows

    S, B, T, T2 = 3, 2, 5, 8
    x = torch.arange(S * B * T).view(S, B, T)
    xp = torch.cat([x, x.new_full((S, B, T2 - T), -1)], dim=2)
    rows = torch.randperm(S * B * T)[:17]
    assert torch.equal(xp.flatten()[remap_rows(rows, B, T, T2)], x.flatten()[rows])


@pytest.mark.parametrize("architecture", ["llama", "deepseek"])
def test_ttt_on_head_rows_gives_every_positions_loss_statistics_and_gradients(architecture):
    """train.loss_rows_only: the head and the loss on the loss rows only give the loss, every
    statistic and every parameter's gradient of the head on every position (float64)."""
    from eagle3.train.ttt import head_rows

    torch.manual_seed(0)
    cfg = _small_cfg()
    if architecture == "deepseek":
        cfg = dataclasses.replace(cfg, architecture="deepseek", num_key_value_heads=2, head_dim=48, q_lora_rank=24,
                                  kv_lora_rank=40, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24)
    draft = Eagle3Draft(cfg).double()
    S = 4
    b = _masked_batch(cfg)
    model = TTTModel(draft, num_steps=S, attention="sdpa")
    params = [p for p in draft.parameters() if p.requires_grad]
    results = []
    gathered = head_rows(b["loss_mask"], b["doc_ids"], S)
    assert gathered is not None and len(gathered) < S * b["loss_mask"].numel()  # the gather leaves rows out
    for rows in (None, gathered):
        loss, stats = model(**b, head_rows=rows)
        results.append((loss, stats, torch.autograd.grad(loss, params)))
    (l0, s0, g0), (l1, s1, g1) = results
    assert torch.allclose(l1, l0, rtol=1e-12, atol=0)
    assert torch.allclose(s1, s0, rtol=1e-12, atol=0)
    assert float(s0[:, STAT_NAMES.index("scored")].sum()) > 0
    for p, a, r in zip(params, g1, g0):
        assert torch.allclose(a, r, rtol=1e-10, atol=1e-14 * float(r.abs().max())), p.shape


def test_ttt_on_head_rows_compiles_one_graph_for_every_row_count():
    """Compiled, the row count is a dynamic dimension: batches with other numbers of loss rows run
    in the first graph (fullgraph, traced through AOTAutograd) and equal the eager forward."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from eagle3.train.ttt import head_rows

    torch._dynamo.reset()
    counters.clear()
    cfg = _small_cfg()
    draft = Eagle3Draft(cfg)
    S = 3
    eager = TTTModel(draft, num_steps=S, attention="sdpa")
    compiled = TTTModel(draft, num_steps=S, attention="sdpa", compile=True)
    compiled._compiled_core = torch.compile(compiled._core, fullgraph=True, backend="aot_eager", dynamic=False)
    lens = set()
    for seed, cut in ((0, 8), (1, 12), (2, 26)):
        b = _masked_batch(cfg, seed=seed, dtype=torch.float32)
        b["loss_mask"][0, :cut] = 0
        rows = head_rows(b["loss_mask"], b["doc_ids"], S, multiple=1)
        lens.add(len(rows))
        loss, stats = compiled(**b, head_rows=rows)
        loss.backward()
        ref_loss, ref_stats = eager(**b)
        assert torch.allclose(loss, ref_loss, rtol=1e-5) and torch.allclose(stats, ref_stats, rtol=1e-5)
    assert len(lens) == 3  # three row counts
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_loss_rows_only_trains_the_model_of_every_position(store_dir, target_dir, tmp_path, monkeypatch):
    """The train loop with train.loss_rows_only (the default) logs the losses and writes the weights
    of the same run with the head on every position, up to float32 rounding; it gathered rows for
    most batches, and the run without it never did."""
    from safetensors.torch import load_file

    from eagle3.train.loop import train

    given = []
    real = TTTModel.forward

    def spy(self, *args, head_rows=None, **kw):
        given.append(head_rows is not None)
        return real(self, *args, head_rows=head_rows, **kw)
    monkeypatch.setattr(TTTModel, "forward", spy)
    tcfg = dict(ttt_steps=2, max_steps=6, lr=1e-3, warmup_steps=2, batch_size=2, max_seq_len=128, log_every=1,
                eval_every=3, save_every=100)
    seen = {}
    for name, on in (("rows", True), ("all", False)):
        given.clear()
        train(TrainConfig(**tcfg, loss_rows_only=on), make_inputs(store_dir, target_dir), tmp_path / name,
              progress=False)
        seen[name] = list(given)
    # most batches here leave rows out; a batch whose padded rows would be all of them runs whole
    assert sum(seen["rows"]) > len(seen["rows"]) / 2 and not any(seen["all"]), seen
    a, b = _losses(tmp_path / "rows"), _losses(tmp_path / "all")
    assert len(a) == len(b) == 8, (a, b)  # 6 training steps, evals at 3 and 6
    for (sa, la, ga), (sb, lb, gb) in zip(a, b):
        assert sa == sb and la == pytest.approx(lb, rel=1e-4), (a, b)
        assert (ga is None) == (gb is None) and (ga is None or ga == pytest.approx(gb, rel=1e-3)), (a, b)
    wa, wb = load_file(tmp_path / "rows" / "draft.safetensors"), load_file(tmp_path / "all" / "draft.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        if wa[k].is_floating_point():
            assert torch.allclose(wa[k].float(), wb[k].float(), rtol=1e-3, atol=1e-5), k


def test_logs_write_windows_in_order_once_their_numbers_arrive():
    """The loop's deferred logs: a window is written once its numbers have arrived, never before an
    earlier one; flush(wait=True) writes every pending one (before an eval, a checkpoint, the end)."""
    from eagle3.train.loop import ClosedWindow, Logs

    written = []

    class Window(ClosedWindow):
        def __init__(self, step):
            super().__init__([], None, None, {"step": step}, None)
            self.arrived = False

        def ready(self):
            return self.arrived

        def record(self, decay, flops_per_token, num_processes):
            self.arrived = True  # a wait
            return {"step": self.fields["step"]}, SimpleNamespace(loss=1.0, acc_per_step=[0.5])

    class Sink:
        def log(self, record):
            written.append(record["step"])

    accelerator = SimpleNamespace(is_main_process=True, num_processes=1)
    bar = SimpleNamespace(set_postfix=lambda **kw: None)
    logs = Logs(accelerator, (Sink(), None), bar, 0.8, 1.0)
    a, b, c = Window(5), Window(10), Window(15)
    for w in (a, b, c):
        logs.add(w)
    b.arrived = True
    logs.flush()
    assert written == []  # 10 waits for 5
    a.arrived = True
    logs.flush()
    assert written == [5, 10]
    logs.flush(wait=True)
    assert written == [5, 10, 15] and not logs.pending and logs.last.loss == 1.0
