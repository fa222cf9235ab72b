"""The TTT prefix attention on cuDNN (train.attention=cudnn) on a CUDA device, against a float64
reference and against flex (the CUDA default): output, log-sum-exp and the gradients through both,
on rows of several documents (the bias) and of one (none), with GQA; and the TTT model's loss and
gradients on cudnn against flex, compiled. Skipped without a CUDA device (CI has none)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu


def _reference(q, k, v, doc, go, gl, scale):
    """float64 attention of the document-causal prefix and its gradients through out and lse."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    T = q.shape[2]
    s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) * scale
    i = torch.arange(T, device=q.device)
    allowed = (doc[:, :, None] == doc[:, None, :]) & (i[:, None] >= i[None, :])
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ v.repeat_interleave(g, 1)
    grads = torch.autograd.grad((out, lse), (q, k, v), (go.double(), gl.double()))
    return [out, lse, *grads]


@pytest.mark.parametrize("docs", ["packed", "one"])
def test_prefix_kernel_matches_the_float64_reference_like_flex(docs):
    """bf16, 2 rows of 3 and 4 documents (padding included) or of one each, 8/2 heads, head dim
    128: each of out, lse, dq, dk, dv within 2x flex's own distance from the float64 reference
    (+1e-3 of its scale)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    from eagle3.train.attention import TTTMask
    from eagle3.train.prefix_kernels import doc_bias, prefix_attention

    torch.manual_seed(0)
    dev, B, H, Hk, T, D = "cuda", 2, 8, 2, 512, 128
    doc = torch.tensor([[0] * 100 + [1] * 300 + [2] * 112, [0] * 128 + [1] * 60 + [2] * 260 + [-1] * 64], device=dev)
    if docs == "one":
        doc = torch.zeros_like(doc)
    q = torch.randn(B, T, H, D, device=dev).bfloat16().transpose(1, 2).requires_grad_()
    k = torch.randn(B, T, Hk, D, device=dev).bfloat16().transpose(1, 2).requires_grad_()
    v = torch.randn(B, T, Hk, D, device=dev).bfloat16().transpose(1, 2).requires_grad_()
    go = torch.randn(B, H, T, D, device=dev).bfloat16()
    gl = torch.randn(B, H, T, device=dev)
    scale = D ** -0.5
    ref = _reference(q, k, v, doc, go, gl, scale)
    out, lse = prefix_attention(q, k, v, doc_bias(doc, q.dtype) if docs == "packed" else None, scale, "cudnn")
    got = [out, lse, *torch.autograd.grad((out, lse), (q, k, v), (go, gl))]
    fx = torch.compile(flex_attention, dynamic=False)
    fo, aux = fx(q, k, v, block_mask=TTTMask(doc, 1, "flex").prefix_block(), scale=scale, enable_gqa=True,
                 return_aux=AuxRequest(lse=True))
    flex = [fo, aux.lse, *torch.autograd.grad((fo, aux.lse), (q, k, v), (go, gl))]
    for name, a, f, r in zip(("out", "lse", "dq", "dk", "dv"), got, flex, ref):
        assert a.shape == r.shape and a.dtype == f.dtype, (name, a.shape, a.dtype)
        err, flex_err = (a.double() - r).abs().max().item(), (f.double() - r).abs().max().item()
        assert err <= 2 * flex_err + 1e-3 * r.abs().max().item(), (name, err, flex_err)


def test_ttt_model_trains_the_same_on_cudnn_as_on_flex():
    """A small draft, bf16 compute, compiled, 3 TTT steps over rows of several documents: the loss
    within 1e-3 of flex's and every parameter's gradient within 3% (of its largest entry) of flex's;
    ``one_doc_rows`` given (as the collator gives it) or found by the model: the same loss."""
    from eagle3.model.draft import Eagle3Draft, Eagle3DraftConfig
    from eagle3.train.ttt import TTTModel

    torch.manual_seed(0)
    H, Vd, B, T, dev = 256, 512, 2, 384, "cuda"
    cfg = Eagle3DraftConfig(hidden_size=H, target_hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=64, intermediate_size=512, rms_norm_eps=1e-5, vocab_size=4 * Vd,
                            draft_vocab_size=Vd, aux_layer_ids=[1, 2, 3], rope_theta=500000.0)
    draft = Eagle3Draft(cfg).to(dev)
    doc = torch.tensor([[0] * 100 + [1] * 200 + [2] * 84, [0] * 300 + [-1] * 84], device=dev)
    pos = torch.cat([torch.arange(n) for row in doc.tolist() for n in torch.unique_consecutive(
        torch.tensor(row), return_counts=True)[1].tolist()]).view(B, T).to(dev)
    batch = dict(aux=torch.randn(B, T, 3 * H, device=dev).bfloat16(), embeds=torch.randn(B, T, H, device=dev).bfloat16(),
                 target_probs=torch.softmax(torch.randn(B, T, Vd, device=dev), -1).bfloat16(),
                 in_vocab=torch.rand(B, T, device=dev) < 0.9, loss_mask=(doc >= 0).long(), position_ids=pos, doc_ids=doc)
    res = {}
    kernel = "cudnn"
    for backend in ("flex", kernel):
        model = TTTModel(draft, num_steps=3, attention=backend, compile=True)
        draft.zero_grad(set_to_none=True)
        loss, _ = model(**batch)
        loss.backward()
        res[backend] = (loss.item(), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None})
    (lf, gf), (lk, gk) = res["flex"], res[kernel]
    assert abs(lk - lf) <= 1e-3 * abs(lf), (lk, lf)
    assert gf.keys() == gk.keys() and len(gf) > 5
    for n in gf:
        assert (gk[n] - gf[n]).abs().max() <= 0.03 * gf[n].abs().max(), n
    with torch.no_grad():
        given, _ = TTTModel(draft, num_steps=3, attention=kernel)(**batch, one_doc_rows=False)
        one = dict(batch, doc_ids=torch.zeros_like(doc), loss_mask=torch.ones_like(doc),
                   position_ids=torch.arange(T, device=dev).expand(B, T))
        found, _ = TTTModel(draft, num_steps=3, attention=kernel)(**one)
        told, _ = TTTModel(draft, num_steps=3, attention=kernel)(**one, one_doc_rows=True)
        flex_one, _ = TTTModel(draft, num_steps=3, attention="flex")(**one)
    assert abs(given.item() - lk) <= 1e-2 * abs(lk)
    assert found.item() == told.item() and abs(told.item() - flex_one.item()) <= 1e-3 * abs(flex_one.item())
