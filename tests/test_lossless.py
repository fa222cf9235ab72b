"""The export's lossless check: where a served greedy output parts from plain decoding, the target
(transformers, float32) scores both tokens, and only a near-tie of its two best tokens passes."""
from __future__ import annotations

import pytest
import torch

from eagle3.export.acceptance import AcceptanceStats
from eagle3.export.errors import VerificationError
from eagle3.export.verify import ReferenceScorer, check_lossless, tie_margin_for


def _greedy(model, prompt: list, n: int) -> tuple[list, list]:
    """``n`` greedy tokens and, per step, the sorted logits of the next token."""
    ids, out, tops = list(prompt), [], []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            tops.append(torch.sort(logits, descending=True))
            out.append(int(tops[-1].indices[0]))
            ids.append(out[-1])
    return out, tops


@pytest.fixture(scope="module")
def setup(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    prompts = [[1, 17, 42, 99, 7], [1, 5, 250, 3]]
    outs, tops = zip(*(_greedy(model, p, 12) for p in prompts))
    return tiny_llama_dir, prompts, list(outs), list(tops)


def _stats(outputs) -> AcceptanceStats:
    return AcceptanceStats(k=3, outputs=[list(o) for o in outputs])


def _swapped(outs, prompt: int, j: int, token: int) -> list:
    """``outs`` with prompt ``prompt``'s output taking ``token`` at position ``j`` (and stopping there)."""
    new = [list(o) for o in outs]
    new[prompt] = new[prompt][:j] + [token]
    return new


def test_equal_outputs_pass_without_loading_the_target(setup, tmp_path):
    _, prompts, outs, _ = setup
    scorer = ReferenceScorer(tmp_path / "no-such-target", prompts, "cpu")  # loading it would raise
    assert check_lossless(_stats(outs), _stats(outs), "same", scorer) == []


def test_a_near_tie_passes_and_is_reported(setup):
    path, prompts, outs, tops = setup
    j = 3
    second, gap = int(tops[1][j].indices[1]), float(tops[1][j].values[0] - tops[1][j].values[1])
    spec = _swapped(outs, 1, j, second)
    rows = check_lossless(_stats(spec), _stats(outs), "k=3", ReferenceScorer(path, prompts, "cpu"),
                          margin=gap * 1.5 + 1e-6)
    assert len(rows) == 1
    assert rows[0]["prompt"] == 1 and rows[0]["token"] == j and rows[0]["ranks"] == [0, 1]
    assert rows[0]["plain"] == outs[1][j] and rows[0]["speculative"] == second
    assert rows[0]["gap"] == pytest.approx(gap, abs=1e-4)


def test_the_second_best_token_beyond_the_margin_fails(setup):
    path, prompts, outs, tops = setup
    j = 3
    second, gap = int(tops[1][j].indices[1]), float(tops[1][j].values[0] - tops[1][j].values[1])
    with pytest.raises(VerificationError, match=r"not a near-tie .* within .* logits \(export.tie_margin\)") as e:
        check_lossless(_stats(_swapped(outs, 1, j, second)), _stats(outs), "k=3",
                       ReferenceScorer(path, prompts, "cpu"), margin=gap / 2)
    assert "ranks the tokens 0 and 1" in str(e.value) and "prompt 1, token 3" in str(e.value)


def test_a_token_outside_the_two_best_fails_whatever_the_margin(setup):
    path, prompts, outs, tops = setup
    j = 5
    fifth = int(tops[0][j].indices[4])
    with pytest.raises(VerificationError, match="ranks the tokens 0 and 4"):
        check_lossless(_stats(_swapped(outs, 0, j, fifth)), _stats(outs), "k=3",
                       ReferenceScorer(path, prompts, "cpu"), margin=1e9)


def test_an_output_that_stops_early_fails(setup):
    path, prompts, outs, _ = setup
    spec = [list(o) for o in outs]
    spec[0] = spec[0][:6]
    with pytest.raises(VerificationError, match="one output stops where the other goes on"):
        check_lossless(_stats(spec), _stats(outs), "k=3", ReferenceScorer(path, prompts, "cpu"), margin=1e9)


def test_without_a_scorer_any_difference_fails(setup):
    _, _, outs, tops = setup
    with pytest.raises(VerificationError, match="is not lossless: on 1 of 2 prompts"):
        check_lossless(_stats(_swapped(outs, 1, 3, int(tops[1][3].indices[1]))), _stats(outs), "k=3")


def test_the_margin_follows_the_served_dtype():
    assert tie_margin_for("float32") == 0.05
    assert tie_margin_for("bfloat16") == tie_margin_for("float16") == 0.5
    assert tie_margin_for("bfloat16", 0.2) == 0.2


def test_a_negative_margin_is_refused():
    from eagle3.config import ExportConfig

    with pytest.raises(ValueError, match="export.tie_margin must be >= 0"):
        ExportConfig(tie_margin=-1.0)
