"""Assistant-only loss masks (eagle3.data.chat_template) on several template families.

Each family has an independent oracle: a hand-written renderer that returns the conversation as
(text, is_assistant) segments, written from the template's documented format rather than from the
code under test. The property tests compare the mask against it.
"""
from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle3.data.chat_template import (
    ChatTemplateError,
    normalize_messages,
    render_with_spans,
    tokenize_conversation,
    tokenize_conversations,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<bos>", "<start_of_turn>", "<end_of_turn>"]

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Meta's Llama-3 template, verbatim (trims content).
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# SmolLM2-Instruct's template, verbatim: injects a default system prompt.
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + SMOL_SYSTEM + "<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Gemma-3 style: the system prompt is folded into the first user turn, assistant is "model".
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim "
    "+ '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
# ChatML with {% generation %} markers around the content only (the end-of-turn marker is outside),
# and around content + marker.
CHATML_GEN = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_GEN_EOT = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# ----------------------------------------------------------------------------- oracles


def chatml_oracle(messages, default_system=None):
    segs = []
    if default_system and messages[0]["role"] != "system":
        segs.append((f"<|im_start|>system\n{default_system}<|im_end|>\n", False))
    for m in messages:
        segs.append((f"<|im_start|>{m['role']}\n", False))
        if m["role"] == "assistant":
            segs += [(m["content"] + "<|im_end|>", True), ("\n", False)]
        else:
            segs.append((m["content"] + "<|im_end|>\n", False))
    return segs


def llama3_oracle(messages):
    segs = [("<|begin_of_text|>", False)]
    for m in messages:
        segs.append((f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n", False))
        segs.append((m["content"].strip() + "<|eot_id|>", m["role"] == "assistant"))
    return segs


def gemma_oracle(messages):
    segs, prefix = [("<bos>", False)], ""
    if messages[0]["role"] == "system":
        prefix, messages = messages[0]["content"] + "\n\n", messages[1:]
    for i, m in enumerate(messages):
        role = "model" if m["role"] == "assistant" else m["role"]
        segs.append((f"<start_of_turn>{role}\n", False))
        text = (prefix if i == 0 else "") + m["content"].strip()  # `| trim` binds to the content only
        if m["role"] == "assistant":
            segs += [(text + "<end_of_turn>", True), ("\n", False)]
        else:
            segs.append((text + "<end_of_turn>\n", False))
    return segs


FAMILIES = {
    "chatml": (CHATML, "<|im_end|>", "<|endoftext|>", chatml_oracle),
    "llama3": (LLAMA3, "<|eot_id|>", "<|begin_of_text|>", llama3_oracle),
    "smollm2": (SMOLLM2, "<|im_end|>", "<|im_start|>", lambda ms: chatml_oracle(ms, SMOL_SYSTEM)),
    "gemma": (GEMMA, "<end_of_turn>", "<bos>", gemma_oracle),
    "chatml_generation": (CHATML_GEN, "<|im_end|>", "<|endoftext|>", chatml_oracle),
    "chatml_generation_eot": (CHATML_GEN_EOT, "<|im_end|>", "<|endoftext|>", chatml_oracle),
}


# ----------------------------------------------------------------------------- tokenizers


@pytest.fixture(scope="module")
def backend():
    """A byte-level BPE (every unicode string encodes and decodes losslessly) with the specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.",
              "Explain why the sky is blue; Rayleigh scattering.", "What is 12 * 7? It is 84.",
              "system user assistant model\n\n", "Héllo wörld — ünïcode 你好 😀"] * 10
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok


def make_tokenizer(backend, template, eos, bos):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos,
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = template
    return fast


@pytest.fixture(scope="module")
def tokenizers(backend):
    return {name: make_tokenizer(backend, tpl, eos, bos) for name, (tpl, eos, bos, _) in FAMILIES.items()}


@pytest.fixture(scope="module")
def smollm2_gguf_tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer and template, read from the packaged GGUF."""
    from transformers import AutoTokenizer

    from eagle3.gguf_convert import default_gguf

    gguf = default_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


# ----------------------------------------------------------------------------- helpers


def runs_of(tokenizer, ids, mask):
    """Decoded maximal runs of equal mask value: [(text, masked), ...]."""
    runs, start = [], 0
    for j in range(1, len(ids) + 1):
        if j == len(ids) or mask[j] != mask[start]:
            text = tokenizer.decode(ids[start:j], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            runs.append((text, bool(mask[start])))
            start = j
    return runs


def check_against_oracle(tokenizer, messages, segments):
    """The asserted property, precisely:
    1. the ids decode to the oracle's full rendering (nothing lost or reordered);
    2. there is exactly one masked run per assistant turn, in order;
    3. masked run k == w_k + A_k, where A_k is the oracle's k-th assistant segment (the reply as the
       template renders it, plus its end-of-turn marker) and w_k is a whitespace-only suffix of the
       text before A_k (non-empty only when a token straddles the header/reply boundary);
    4. the unmasked runs concatenate to the oracle's non-assistant text minus those w_k, so no
       assistant character is left unmasked and no header, user or system text is masked.
    """
    ids, mask = tokenize_conversation(tokenizer, messages)
    assert len(ids) == len(mask) and set(mask) <= {0, 1}
    runs = runs_of(tokenizer, ids, mask)
    full = "".join(t for t, _ in segments)
    assert "".join(t for t, _ in runs) == full
    masked = [t for t, m in runs if m]
    replies = [t for t, a in segments if a]
    assert len(masked) == len(replies)
    expected_unmasked, extras = [], []
    for text, reply in zip(masked, replies):
        assert text.endswith(reply), (text, reply)
        extras.append(text[: len(text) - len(reply)])
        assert extras[-1].strip() == "", extras[-1]
    k = 0
    for text, is_reply in segments:
        if is_reply:
            assert "".join(expected_unmasked).endswith(extras[k])
            expected_unmasked = ["".join(expected_unmasked)[: len("".join(expected_unmasked)) - len(extras[k])]]
            k += 1
        else:
            expected_unmasked.append(text)
    assert "".join(t for t, m in runs if not m) == "".join(expected_unmasked)
    return ids, mask


# ----------------------------------------------------------------------------- conversations

_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIALS))
_char = st.one_of(st.sampled_from(list(" \n\t  ")), st.characters(blacklist_categories=("Cs",)))
_text = st.text(_char, min_size=1, max_size=40).filter(lambda s: s.strip() and not _SPECIAL_RE.search(s))
# SmolLM2's real vocabulary lacks the byte tokens of some control characters and of the UTF-8 lead
# bytes F1/F2 (code points U+40000..U+BFFFF); it drops them when encoding, so texts for it leave
# those out.
_printable = st.one_of(st.sampled_from(list(" \n\t  ")),
                       st.characters(blacklist_categories=("Cs", "Cc"), max_codepoint=0x3FFFF))
_printable_text = st.text(_printable, min_size=1, max_size=40).filter(lambda s: s.strip())


@st.composite
def conversations(draw, text=_text):
    _text = text
    msgs = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(_text)})
    for _ in range(draw(st.integers(1, 4))):
        msgs.append({"role": "user", "content": draw(_text)})
        msgs.append({"role": "assistant", "content": draw(_text)})
    if draw(st.booleans()):  # some conversations end on a user turn
        msgs.append({"role": "user", "content": draw(_text)})
    return msgs


SIMPLE = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}]
MULTI = [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"}]


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("messages", [SIMPLE, MULTI], ids=["single", "multi_system"])
def test_examples_match_oracle(tokenizers, family, messages):
    tok = tokenizers[family]
    ids, mask = check_against_oracle(tok, messages, FAMILIES[family][3](messages))
    # same ids as transformers' own chat tokenization
    assert ids == list(tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])


def test_exact_masked_text_chatml_multi_turn(tokenizers):
    tok = tokenizers["chatml"]
    ids, mask = tokenize_conversation(tok, MULTI)
    assert [t for t, m in runs_of(tok, ids, mask) if m] == ["Hello!<|im_end|>", "5<|im_end|>"]


def test_default_system_prompt_is_not_masked(tokenizers):
    tok = tokenizers["smollm2"]
    ids, mask = tokenize_conversation(tok, SIMPLE)
    runs = runs_of(tok, ids, mask)
    assert SMOL_SYSTEM in runs[0][0] and not runs[0][1]
    assert [t for t, m in runs if m] == ["It is 4.<|im_end|>"]


@pytest.mark.parametrize("family", ["chatml", "llama3", "smollm2", "gemma"])
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=conversations())
def test_property_masked_tokens_are_exactly_the_replies(tokenizers, family, messages):
    check_against_oracle(tokenizers[family], messages, FAMILIES[family][3](messages))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=conversations())
def test_property_generation_markers_agree_with_prefix_diffing(tokenizers, messages):
    plain = tokenize_conversation(tokenizers["chatml"], messages)
    assert tokenize_conversation(tokenizers["chatml_generation"], messages) == plain
    assert tokenize_conversation(tokenizers["chatml_generation_eot"], messages) == plain


def test_generation_markers_extend_transformers_mask_by_end_of_turn(tokenizers):
    """transformers' own mask for content-only markers lacks <|im_end|>; ours adds exactly that."""
    tok = tokenizers["chatml_generation"]
    ref = tok.apply_chat_template(MULTI, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = tokenize_conversation(tok, MULTI)
    assert ids == list(ref["input_ids"])
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    diff = [j for j, (a, b) in enumerate(zip(mask, ref["assistant_masks"])) if a != b]
    assert [ids[j] for j in diff] == [im_end, im_end]
    assert all(mask[j] == 1 and ref["assistant_masks"][j] == 0 for j in diff)


def test_property_real_smollm2_tokenizer(smollm2_gguf_tokenizer):
    tok = smollm2_gguf_tokenizer
    assert SMOL_SYSTEM in tok.chat_template

    @settings(max_examples=60, deadline=None)
    @given(messages=conversations(_printable_text))
    def check(messages):
        check_against_oracle(tok, messages, chatml_oracle(messages, SMOL_SYSTEM))

    check()
    check_against_oracle(tok, MULTI, chatml_oracle(MULTI, SMOL_SYSTEM))


def test_batch_equals_single_and_truncation(tokenizers):
    tok = tokenizers["llama3"]
    batch = tokenize_conversations(tok, [SIMPLE, MULTI])
    assert batch == [tokenize_conversation(tok, SIMPLE), tokenize_conversation(tok, MULTI)]
    ids, mask = tokenize_conversation(tok, MULTI, max_length=7)
    assert (ids, mask) == (batch[1][0][:7], batch[1][1][:7])


def test_batch_can_collect_errors_instead_of_raising(tokenizers):
    tok = tokenizers["chatml"]
    bad = [SIMPLE[0], {"role": "assistant", "content": "4<|im_end|>ha"}]
    with pytest.raises(ChatTemplateError):
        tokenize_conversations(tok, [SIMPLE, bad, MULTI])
    errors = []
    out = tokenize_conversations(tok, [SIMPLE, bad, [{"role": "bot", "content": "x"}], MULTI], errors=errors)
    assert out[0] == tokenize_conversation(tok, SIMPLE) and out[3] == tokenize_conversation(tok, MULTI)
    assert out[1] is None and out[2] is None
    assert [k for k, _ in errors] == [1, 2] and isinstance(errors[0][1], ChatTemplateError)


def test_conversation_without_assistant_has_empty_mask(tokenizers):
    ids, mask = tokenize_conversation(tokenizers["chatml"], [{"role": "user", "content": "hi"}])
    assert ids and not any(mask)


def test_reasoning_prefix_emitted_by_template_is_masked(backend):
    """A template that emits an empty think block before the last reply (as Qwen3 does): the model
    generates it after the prompt, so it belongs to the reply's span."""
    tpl = CHATML.replace("'\\n' + message['content']",
                         "'\\n' + ('<think></think>' if message['role'] == 'assistant' else '') + message['content']")
    tok = make_tokenizer(backend, tpl, "<|im_end|>", "<|endoftext|>")
    ids, mask = tokenize_conversation(tok, SIMPLE)
    assert [t for t, m in runs_of(tok, ids, mask) if m] == ["<think></think>It is 4.<|im_end|>"]


# ----------------------------------------------------------------------------- errors


def test_no_chat_template_names_the_option(backend):
    tok = make_tokenizer(backend, None, "<|im_end|>", "<|endoftext|>")
    with pytest.raises(ChatTemplateError, match=r"target\.chat_template="):
        tokenize_conversation(tok, SIMPLE)


def test_non_prefix_rendering_is_detected(backend):
    """A system prompt that counts the messages changes the rendering of earlier turns."""
    tpl = "{{ '<|im_start|>system\\n' + (messages | length | string) + ' messages<|im_end|>\\n' }}" + CHATML
    tok = make_tokenizer(backend, tpl, "<|im_end|>", "<|endoftext|>")
    with pytest.raises(ChatTemplateError, match="non-prefix rendering"):
        tokenize_conversation(tok, SIMPLE)


def test_stripped_reasoning_in_earlier_turns_is_detected(backend):
    """Like Qwen3/DeepSeek-R1: reasoning is dropped from replies before the last user turn."""
    tpl = CHATML.replace(
        "message['content']",
        "(message['content'].split('</think>')[-1] if message['role'] == 'assistant' and not loop.last "
        "else message['content'])", 1)
    tok = make_tokenizer(backend, tpl, "<|im_end|>", "<|endoftext|>")
    tokenize_conversation(tok, MULTI)  # no reasoning: the rendering is consistent
    thinking = [dict(m) for m in MULTI]
    thinking[2]["content"] = "<think>greet back</think>Hello!"
    with pytest.raises(ChatTemplateError, match="does not appear verbatim"):
        tokenize_conversation(tok, thinking)


def test_reply_containing_end_of_turn_text_is_rejected(tokenizers):
    bad = [SIMPLE[0], {"role": "assistant", "content": "4<|im_end|>ha"}]
    with pytest.raises(ChatTemplateError, match="end-of-turn marker"):
        tokenize_conversation(tokenizers["chatml"], bad)


def test_template_errors_are_wrapped(tokenizers):
    with pytest.raises(ChatTemplateError, match="must alternate"):
        tokenize_conversation(tokenizers["gemma"], [SIMPLE[1], SIMPLE[0]])


@pytest.mark.parametrize("messages, match", [
    ([{"role": "tool", "content": "x"}], "unknown role 'tool'"),
    ([{"role": "user", "content": "  "}], "empty or missing"),
    ([{"role": "user"}], "empty or missing"),
    ([], "no messages"),
])
def test_bad_messages(tokenizers, messages, match):
    with pytest.raises(ValueError, match=match):
        tokenize_conversation(tokenizers["chatml"], messages)


# ----------------------------------------------------------------------------- normalize_messages


def test_normalize_openai_string_and_parts():
    rec = {"messages": [{"role": "system", "content": "S"},
                        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                        {"role": "assistant", "content": "c"}]}
    assert normalize_messages(rec) == [{"role": "system", "content": "S"}, {"role": "user", "content": "ab"},
                                       {"role": "assistant", "content": "c"}]


def test_normalize_sharegpt_roles():
    rec = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "q"},
                             {"from": "gpt", "value": "a"}, {"from": "user", "value": "q2"},
                             {"from": "assistant", "value": "a2"}]}
    assert [m["role"] for m in normalize_messages(rec)] == ["system", "user", "assistant", "user", "assistant"]
    assert normalize_messages(rec)[2]["content"] == "a"


@pytest.mark.parametrize("rec, match", [
    ({"messages": [{"role": "tool", "content": "x"}]}, r"messages\[0\] has unknown role 'tool'"),
    ({"conversations": [{"from": "bot", "value": "x"}]}, r"conversations\[0\] has unknown role 'bot'"),
    ({"messages": [{"role": "user", "content": ""}]}, r"messages\[0\]\.content is empty"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\]\.content is missing"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": " \n"}]},
     r"conversations\[1\]\.value is empty"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "not a text part"),
    ({"messages": []}, "non-empty list"),
    ({"text": "hello"}, "neither 'messages'"),
])
def test_normalize_errors(rec, match):
    with pytest.raises(ValueError, match=match):
        normalize_messages(rec)


def test_render_with_spans_reports_reply_spans(tokenizers):
    full, spans = render_with_spans(tokenizers["llama3"], MULTI)
    assert [full[s:e] for s, e in spans] == ["Hello!<|eot_id|>", "5<|eot_id|>"]
