"""The TTT prefix attention on a library kernel (eagle3.train.prefix_kernels): causal, the documents
apart by an additive bias, and the log-sum-exp's gradient folded into the output the kernel's
backward reads. Run here through torch's real CPU flash kernel (the ``cpu`` kernel), which reads the
output in its backward as cuDNN's does; cuDNN's own runs are tests/gpu."""
from __future__ import annotations

import pytest
import torch

from eagle3.train.attention import KernelPrefix, TTTMask, naive_ttt_attention, resolve_backend, ttt_attention
from eagle3.train.prefix_kernels import MASKED, doc_bias, fold_lse_grad, prefix_attention
from eagle3.train.ttt import TTTModel

DOCS = [[0] * 10 + [1] * 14, [0] * 5 + [1] * 7 + [2] * 8 + [-1] * 4]


def _reference(q, k, v, doc, go, gl, scale):
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    T = q.shape[2]
    s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) * scale
    i = torch.arange(T)
    s = s.masked_fill(~((doc[:, :, None] == doc[:, None, :]) & (i[:, None] >= i[None, :]))[:, None], float("-inf"))
    out, lse = torch.softmax(s, -1) @ v.repeat_interleave(g, 1), torch.logsumexp(s, -1)
    return [out, lse, *torch.autograd.grad((out, lse), (q, k, v), (go.double(), gl.double()))]


def _inputs(dtype, B=2, H=4, Hk=2, T=24, D=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # q, k, v as the draft makes them: [B, T, H, D] in memory, [B, H, T, D] as seen
    q, k, v = (torch.randn(B, T, h, D, generator=gen).to(dtype).transpose(1, 2).requires_grad_() for h in (H, Hk, Hk))
    return q, k, v, torch.randn(B, H, T, D, generator=gen).to(dtype), torch.randn(B, H, T, generator=gen)


def test_doc_bias_keeps_documents_apart():
    doc = torch.tensor(DOCS)
    b = doc_bias(doc, torch.bfloat16)
    assert b.shape == (2, 1, 24, 24) and b.dtype == torch.bfloat16
    assert b[0, 0, 3, 9] == 0 and b[0, 0, 3, 10] == torch.tensor(MASKED).bfloat16() and b[1, 0, 22, 20] == 0
    # the bias leaves nothing of another document: exp(MASKED + a large score) is 0 in float32
    assert torch.exp(torch.tensor(MASKED + 100.0)) == 0


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_prefix_attention_and_its_lse_gradient_match_the_reference(dtype, tol):
    """out, lse and the gradients of q, k, v through both (GQA, three documents and padding in a
    row) against float64; float32 shows the fold exact, bf16 within bf16's reach."""
    q, k, v, go, gl = _inputs(dtype)
    doc = torch.tensor(DOCS)
    out, lse = prefix_attention(q, k, v, doc_bias(doc, dtype), 0.25, "cpu")
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    got = [out, lse, *torch.autograd.grad((out, lse), (q, k, v), (go, gl))]
    for name, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, _reference(q, k, v, doc, go, gl, 0.25)):
        assert (a.double() - r).abs().max() <= tol * r.abs().max(), name


def test_without_the_fold_the_lse_gradient_would_be_lost():
    """The fold is what carries dlse: the same backward handed the plain output gives dq of the
    output's gradient alone (the reference with dlse = 0), not the one with dlse."""
    q, k, v, go, gl = _inputs(torch.float32)
    doc = torch.tensor(DOCS)
    out, lse = prefix_attention(q, k, v, doc_bias(doc, q.dtype), 0.25, "cpu")
    with_lse = torch.autograd.grad((out, lse), q, (go, gl), retain_graph=True)[0]
    out_only = torch.autograd.grad(out, q, go)[0]
    ref_out_only = _reference(q, k, v, doc, go, torch.zeros_like(gl), 0.25)[2]
    assert (out_only.double() - ref_out_only).abs().max() <= 1e-5 * ref_out_only.abs().max()
    assert (with_lse - out_only).abs().max() > 0.1 * out_only.abs().max()


def test_fold_lse_grad_moves_rowsum_by_dlse_and_keeps_rows_without_gradient():
    gen = torch.Generator().manual_seed(1)
    out, dout = torch.randn(2, 3, 6, 8, generator=gen), torch.randn(2, 3, 6, 8, generator=gen)
    dout[1, 2, 1] = 0
    dlse = torch.randn(2, 3, 6, generator=gen)
    dlse[1, 2, 1] = 0  # a token without output gradient has none through lse either (the merge's)
    folded = fold_lse_grad(out, dout, dlse)
    assert torch.allclose((dout * folded).sum(-1), (dout * out).sum(-1) - dlse, atol=1e-5)
    assert torch.equal(folded[1, 2, 1], out[1, 2, 1])


def test_one_document_rows_need_no_bias():
    """Rows of one document each: no bias and the all-zero bias give the same attention."""
    q, k, v, go, gl = _inputs(torch.float32)
    none = prefix_attention(q, k, v, None, 0.25, "cpu")
    zero = prefix_attention(q, k, v, doc_bias(torch.zeros(2, 24, dtype=torch.long), q.dtype), 0.25, "cpu")
    for a, b in zip(none, zero):
        assert torch.allclose(a, b, atol=1e-6)


def test_prefix_attention_compiles_whole():
    """torch.compile(fullgraph=True) keeps both custom ops (their fake implementations trace): the
    compiled forward and backward equal the eager ones."""
    q, k, v, go, gl = _inputs(torch.float32)
    bias = doc_bias(torch.tensor(DOCS), q.dtype)

    def f(q, k, v):
        out, lse = prefix_attention(q, k, v, bias, 0.25, "cpu")
        return (out * go).sum() + (lse * gl).sum()
    eager = torch.autograd.grad(f(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(f, fullgraph=True, dynamic=False)(q, k, v), (q, k, v))
    for a, b in zip(eager, compiled):
        assert torch.allclose(a, b, atol=1e-5)


def test_ttt_attention_on_the_prefix_kernel_equals_the_key_by_key_reference():
    """Step j = 2's attention (prefix + two diagonals) through KernelPrefix: the naive reference's
    output, and sdpa's gradients for q and every step's k and v."""
    torch.manual_seed(0)
    B, H, Hk, T, D = 2, 4, 2, 24, 16
    doc = torch.tensor(DOCS)
    q = torch.randn(B, H, T, D, dtype=torch.float64, requires_grad=True)
    ks = [torch.randn(B, Hk, T, D, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    vs = [torch.randn(B, Hk, T, D, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    got = ttt_attention(q.float(), [k.float() for k in ks], [v.float() for v in vs],
                        KernelPrefix(doc_bias(doc, torch.float32), "cpu"), scale=0.3)
    ref = naive_ttt_attention(q, ks, vs, doc, scale=0.3)
    assert torch.allclose(got.double(), ref, atol=1e-5)
    go = torch.randn_like(ref)
    g_got = torch.autograd.grad(got, [q, *ks, *vs], go.float())
    sdpa = ttt_attention(q, ks, vs, TTTMask(doc, 3, "sdpa").dense(2), scale=0.3)
    g_ref = torch.autograd.grad(sdpa, [q, *ks, *vs], go)
    for a, b in zip(g_got, g_ref):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_the_kernel_backends_are_cuda_only_with_a_reason():
    assert resolve_backend("cudnn", torch.device("cuda")) == "cudnn"
    with pytest.raises(ValueError, match="CUDA kernel.*auto or sdpa"):
        resolve_backend("cudnn", torch.device("cpu"))
    with pytest.raises(ValueError, match="bf16 or fp16.*mixed_precision"):
        prefix_attention(*(torch.zeros(1, 2, 4, 8) for _ in range(3)), None, 1.0, "cudnn")
    with pytest.raises(ValueError, match="one head dim.*flex"):
        prefix_attention(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 6), None, 1.0, "cpu")


def test_the_collator_says_whether_every_row_is_one_document():
    """MicroBatches marks a batch whose rows are one document each (on the host: the cudnn backend
    then runs without a bias, and without a device sync to find that out)."""
    from eagle3.train.data import MicroBatches

    class Store:
        def __getitem__(self, i):
            n = (16, 16, 12)[i]
            return {"input_ids": torch.arange(n), "loss_mask": torch.ones(n), "aux_hidden_states": torch.zeros(n, 3, 4),
                    "last_hidden_state": torch.zeros(n, 4)}
    ds = MicroBatches(Store(), [[[0], [1]], [[0], [2]], [[2, 1]]], max_len=16)
    assert ds[0]["one_doc_rows"] is True
    assert ds[1]["one_doc_rows"] is False  # the shorter row's padding is a document of its own
    assert ds[2]["one_doc_rows"] is False  # two samples packed in one row


def test_ttt_model_on_the_kernel_path_compiled_equals_sdpa():
    """The TTT model's cudnn path end to end (padding to whole blocks, the document bias, the custom
    ops inside the compiled graph, the fold in its backward), the CPU kernel standing in for cuDNN
    (no GPU here), float32: sdpa's loss and every parameter's gradient; rows of one document each
    (no bias, one_doc_rows given or found) likewise."""
    import eagle3.train.prefix_kernels as pk
    import eagle3.train.ttt as ttt
    from eagle3.model.draft import Eagle3Draft, Eagle3DraftConfig

    torch.manual_seed(0)
    cfg = Eagle3DraftConfig(hidden_size=64, target_hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=128, rms_norm_eps=1e-5, vocab_size=256, draft_vocab_size=64,
                            aux_layer_ids=[1, 2, 3], rope_theta=10000.0)
    draft = Eagle3Draft(cfg)
    B, T = 2, 150  # padded to 256 on the kernel path
    doc = torch.tensor([[0] * 60 + [1] * 90, [0] * 130 + [-1] * 20])

    def batch(doc):
        pos = torch.cat([torch.arange(n) for row in doc.tolist()
                         for n in torch.unique_consecutive(torch.tensor(row), return_counts=True)[1].tolist()])
        return dict(aux=torch.randn(B, T, 3 * 64), embeds=torch.randn(B, T, 64),
                    target_probs=torch.softmax(torch.randn(B, T, 64), -1), in_vocab=torch.rand(B, T) < 0.9,
                    loss_mask=(doc >= 0).long(), position_ids=pos.view(B, T), doc_ids=doc)

    def loss_and_grads(model, inputs, **kw):
        loss, _ = model(**inputs, **kw)
        return [loss, *torch.autograd.grad(loss, list(draft.parameters()))]
    packed, single = batch(doc), batch(torch.zeros_like(doc))
    ref = {name: loss_and_grads(TTTModel(draft, num_steps=3, attention="sdpa"), b)
           for name, b in (("packed", packed), ("single", single))}
    real = pk.prefix_attention
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ttt, "resolve_backend", lambda name, device: "cudnn")
        mp.setattr(pk, "prefix_attention", lambda q, k, v, bias, scale, kernel: real(q, k, v, bias, scale, "cpu"))
        model = TTTModel(draft, num_steps=3, attention="cudnn", compile=True)
        got = {"packed": loss_and_grads(model, packed), "single": loss_and_grads(model, single),
               "told": loss_and_grads(model, single, one_doc_rows=True)}
    for name, vals in got.items():
        for a, r in zip(vals, ref["single" if name == "told" else name]):
            assert (a - r).abs().max() <= 1e-4 * r.abs().max(), name
