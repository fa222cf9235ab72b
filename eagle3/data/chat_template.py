"""Assistant-only loss masks for any chat template.

``tokenize_conversation`` renders a conversation with the tokenizer's own chat template, tokenizes
the rendered text once, and marks the tokens of every assistant turn: the reply plus the
end-of-turn marker the template emits right after it (``<|im_end|>`` for ChatML, ``<|eot_id|>``
for Llama-3), never the assistant header (``<|im_start|>assistant\\n``) nor the newline after the
marker.

Finding the assistant spans (character offsets in the full rendering R), without per-model regexes:

- Templates with ``{% generation %}`` markers: transformers' own renderer reports the marked spans
  (the same code ``apply_chat_template(return_assistant_tokens_mask=True)`` uses). Template authors
  differ in whether the block includes the end-of-turn marker, so a span not already ending with it
  is extended over it when the marker follows directly.
- Other templates, by prefix diffing: for assistant message i, the rendering of ``messages[:i]``
  with ``add_generation_prompt=True`` must be a prefix of R; the reply starts where that prefix
  ends and ends at the first end-of-turn marker after it. The prefix must really be a prefix
  (templates that rewrite earlier turns once later turns exist, e.g. strip reasoning, fail here
  with an error instead of giving a wrong mask), and the reply's content must end right before the
  marker (verbatim or whitespace-trimmed, as Llama-3's ``| trim`` renders it).
- The end-of-turn marker is learnt once per template from a probe conversation
  (user, assistant): what the template emits after the reply, up to and including the first run of
  special tokens (``<|im_end|>`` but not the ``\\n`` after it). Whatever the template emits between
  the generation prompt and the content (e.g. an empty ``<think></think>`` block) is masked too: the
  model generates it after the prompt.

Cost: 1 + (number of assistant turns) renders (~20 us each) and one batched tokenizer call per
batch of conversations.

Characters to tokens: the full rendering is tokenized once, with offsets (fast tokenizers), exactly
as ``apply_chat_template(tokenize=True)`` tokenizes it, so ids match what the target sees
elsewhere. Tokenizing segments separately would avoid tokens that straddle a span boundary but
changes the ids (SentencePiece tokenizers prepend a space to every segment). A token is masked when
its character range overlaps an assistant span (transformers' rule for generation spans). The end
of a span is always clean (the marker is an atomic special token); at the start, a reply beginning
with whitespace can merge with the header's trailing newline into one token, which is then masked
and carries that header whitespace too.
"""
from __future__ import annotations

import json
import re
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from functools import lru_cache

from ..errors import Eagle3Error

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Probe conversations that learn the end-of-turn marker; the second for templates that demand a
# system message first.
_PROBE_REPLY = "Probe reply from eagle3."
_PROBES = (
    [{"role": "user", "content": "Probe question from eagle3?"},
     {"role": "assistant", "content": _PROBE_REPLY}],
    [{"role": "system", "content": "Probe system prompt."},
     {"role": "user", "content": "Probe question from eagle3?"},
     {"role": "assistant", "content": _PROBE_REPLY}],
)
_SUPPLY = ("Supply a template with target.chat_template=PATH_OR_TEXT (ideally one that wraps each "
           "assistant reply in {% generation %}...{% endgeneration %}).")


def generation_prompt_ids(tokenizer, messages) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template and the assistant header, as a
    served request sends them."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


class ChatTemplateError(Eagle3Error, ValueError):
    """The chat template cannot give a trustworthy assistant mask for this conversation."""


# --------------------------------------------------------------------------- input records


def normalize_messages(record: dict) -> list[dict]:
    """OpenAI ``messages`` or ShareGPT ``conversations`` -> [{"role", "content": str}, ...]."""
    if not isinstance(record, dict):
        raise ValueError(f"a record must be a JSON object, got {type(record).__name__}")
    if "messages" in record:
        turns, role_key, content_key, roles, kind = record["messages"], "role", "content", \
            {r: r for r in ROLES}, "messages"
    elif "conversations" in record:
        turns, role_key, content_key, roles, kind = record["conversations"], "from", "value", \
            SHAREGPT_ROLES, "conversations"
    else:
        raise ValueError(f"record has neither 'messages' (OpenAI style) nor 'conversations' "
                         f"(ShareGPT style); keys are {sorted(record)}")
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"'{kind}' must be a non-empty list")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ValueError(f"{kind}[{i}] must be an object, got {type(turn).__name__}")
        role = turn.get(role_key)
        if role not in roles:
            raise ValueError(f"{kind}[{i}] has unknown role {role!r} in '{role_key}'; "
                             f"allowed: {sorted(roles)}")
        content = _text_of(turn.get(content_key), f"{kind}[{i}].{content_key}")
        out.append({"role": roles[role], "content": content})
    return out


def _text_of(content, where: str) -> str:
    if isinstance(content, list):  # OpenAI content parts: concatenated as the templates render them
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}[{j}] is not a text part {{'type': 'text', 'text': ...}} "
                                 f"(only text is supported): {str(part)[:80]}")
            texts.append(part["text"])
        content = "".join(texts)
    if content is None:
        raise ValueError(f"{where} is missing")
    if not isinstance(content, str):
        raise ValueError(f"{where} must be a string or a list of text parts, got {type(content).__name__}")
    if not content.strip():
        raise ValueError(f"{where} is empty")
    return content


def _check_messages(messages: list[dict]) -> None:
    if not messages:
        raise ValueError("conversation has no messages")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise ValueError(f"message {i} has unknown role {m.get('role')!r}; allowed: {list(ROLES)} "
                             f"(normalize_messages maps ShareGPT roles)")
        c = m.get("content")
        if not isinstance(c, str) or not c.strip():
            raise ValueError(f"message {i} ({m['role']}) has empty or missing content")


# --------------------------------------------------------------------------- the template


@dataclass(frozen=True)
class _Template:
    text: str
    kwargs_json: str          # special tokens passed to the template (bos_token, eos_token, ...)
    has_generation_tags: bool
    # End-of-turn markers, longest first: the full run the probe saw and its shorter leading runs
    # (a template may emit an extra token only after the very last message). () = none.
    end_of_turn: tuple[str, ...]

    def render(self, messages, add_generation_prompt=False, with_indices=False):
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            out, indices = render_jinja_template(
                [messages], chat_template=self.text, add_generation_prompt=add_generation_prompt,
                return_assistant_tokens_mask=with_indices, **json.loads(self.kwargs_json))
        except Exception as e:  # jinja's TemplateError, raise_exception(...) in templates, ...
            raise ChatTemplateError(f"the chat template failed to render the conversation: "
                                    f"{type(e).__name__}: {e}") from e
        return (out[0], indices[0]) if with_indices else out[0]


def _template_of(tokenizer) -> _Template:
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("the tokenizer has no chat template. " + _SUPPLY)
    if not getattr(tokenizer, "is_fast", False):
        raise ChatTemplateError(f"{type(tokenizer).__name__} is not a fast tokenizer: assistant masks "
                                f"need character offsets (a tokenizer.json)")
    specials = {str(t) for t in tokenizer.all_special_tokens}
    specials |= {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return _learn_template(tokenizer.get_chat_template(),
                           json.dumps(tokenizer.special_tokens_map, sort_keys=True),
                           tuple(sorted(specials)))


@lru_cache(maxsize=32)
def _learn_template(text: str, kwargs_json: str, specials: tuple[str, ...]) -> _Template:
    has_tags = bool(_GENERATION_TAG.search(text))
    bare = _Template(text, kwargs_json, has_tags, ())
    special_re = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
                            or r"(?!)")
    errors = []
    for probe in _PROBES:
        try:
            prompt = bare.render(probe[:-1], add_generation_prompt=True)
            full = bare.render(probe)
        except ChatTemplateError as e:
            errors.append(str(e))
            continue
        if not full.startswith(prompt):
            raise ChatTemplateError(
                "non-prefix rendering: the chat template's generation prompt is not a prefix of the "
                "rendered reply "
                f"(prompt ends {prompt[-60:]!r}, conversation ends {full[-80:]!r}); " + _SUPPLY)
        at = full.find(_PROBE_REPLY, len(prompt))
        if at < 0:
            raise ChatTemplateError("the chat template does not render an assistant reply verbatim; " + _SUPPLY)
        tail = full[at + len(_PROBE_REPLY):]
        runs, m = [], special_re.search(tail)
        while m and (not runs or m.start() == runs[-1]):
            runs.append(m.end())
            m = special_re.match(tail, m.end())
        return _Template(text, kwargs_json, has_tags, tuple(tail[:end] for end in reversed(runs)))
    raise ChatTemplateError("the chat template cannot render a plain user/assistant exchange: "
                            + " | ".join(errors))


# --------------------------------------------------------------------------- spans


def _reply_end(tpl: _Template, full: str, content: str, start: int, bound: int, i: int) -> int:
    """End (exclusive) of assistant message i's span in ``full``; its span starts at ``start``."""
    candidates = (content, content.strip()) if content.strip() != content else (content,)
    eots = tpl.end_of_turn
    if not eots:
        for c in candidates:
            at = full.find(c, start, bound)
            if at >= 0 and not full[start:at].strip():
                return at + len(c)
        raise ChatTemplateError(
            f"assistant message {i}: its content is not rendered verbatim after its header "
            f"(the template rewrites it). " + _SUPPLY)
    shortest = eots[-1]
    for c in candidates:
        if shortest in c:
            raise ChatTemplateError(f"assistant message {i} contains the end-of-turn marker text "
                                    f"{shortest!r}; remove it from the data")
    pos = full.find(shortest, start, bound)
    if pos < 0:
        raise ChatTemplateError(
            f"assistant message {i} is not followed by the end-of-turn marker {shortest!r} that the "
            f"template emits after a reply. " + _SUPPLY)
    if not any(full.endswith(c, start, pos) for c in candidates):
        raise ChatTemplateError(
            f"assistant message {i}: its content does not appear verbatim (nor whitespace-trimmed) "
            f"right before its end-of-turn marker; the template rewrites assistant content (e.g. "
            f"strips or moves reasoning between <think> tags). Found {full[start:pos][-80:]!r}. " + _SUPPLY)
    eot = next(e for e in eots if full.startswith(e, pos))
    return pos + len(eot)


def _spans_by_prefix(tpl: _Template, messages: list[dict], full: str) -> list[tuple[int, int]]:
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    prompt_ends = []
    for i in turns:
        prompt = tpl.render(messages[:i], add_generation_prompt=True)
        if not full.startswith(prompt):
            k = next((j for j, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
            raise ChatTemplateError(
                f"non-prefix rendering: the template renders the conversation up to assistant message "
                f"{i} differently from the full conversation (first difference at character {k}: "
                f"{prompt[k:k + 40]!r} vs {full[k:k + 40]!r}). It changes earlier turns when later "
                f"turns exist (e.g. strips reasoning, or depends on the number of messages), so the "
                f"assistant spans cannot be located by prefix diffing. " + _SUPPLY)
        prompt_ends.append(len(prompt))
    bounds = prompt_ends[1:] + [len(full)]
    return [(start, _reply_end(tpl, full, messages[i]["content"], start, bound, i))
            for i, start, bound in zip(turns, prompt_ends, bounds)]


def _spans_by_generation_tags(tpl: _Template, messages, full, indices) -> list[tuple[int, int]]:
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if len(indices) != len(turns):
        raise ChatTemplateError(f"the template's {{% generation %}} blocks marked {len(indices)} spans "
                                f"for {len(turns)} assistant messages")
    spans = []
    for i, (s, e) in zip(turns, indices):
        content = messages[i]["content"]
        if content not in full[s:e] and content.strip() not in full[s:e]:
            raise ChatTemplateError(f"the {{% generation %}} block of assistant message {i} does not "
                                    f"contain its content: {full[s:e][:80]!r}")
        if not any(full.endswith(eot, s, e) for eot in tpl.end_of_turn):
            e += len(next((eot for eot in tpl.end_of_turn if full.startswith(eot, e)), ""))
        spans.append((s, e))
    return spans


def _mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    # A token counts as covering [start, max(end, start + 1)) so zero-width tokens still land.
    starts = [a for a, _ in offsets]
    ends = [max(b, a + 1) for a, b in offsets]
    mask = [0] * len(offsets)
    for s, e in spans:
        lo, hi = bisect_right(ends, s), bisect_left(starts, e)
        mask[lo:hi] = [1] * (hi - lo)
    return mask


# --------------------------------------------------------------------------- public API


def render_with_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns."""
    _check_messages(messages)
    tpl = _template_of(tokenizer)
    return _render_spans(tpl, messages)


def _render_spans(tpl: _Template, messages):
    if tpl.has_generation_tags:
        full, indices = tpl.render(messages, with_indices=True)
        return full, _spans_by_generation_tags(tpl, messages, full, indices)
    full = tpl.render(messages)
    return full, _spans_by_prefix(tpl, messages, full)


def tokenize_conversations(tokenizer, conversations: list[list[dict]], max_length: int | None = None,
                           errors: list | None = None) -> list[tuple[list[int], list[int]] | None]:
    """Batched ``tokenize_conversation`` (one tokenizer call for the whole batch).

    A conversation that cannot be masked raises (ValueError / ChatTemplateError), unless a list is
    passed as ``errors``: then its result is None and ``(index, exception)`` is appended there, so
    a caller can count and skip bad records without losing the batch.
    """
    tpl = _template_of(tokenizer)
    texts, all_spans, ok = [], [], []
    for k, messages in enumerate(conversations):
        try:
            _check_messages(messages)
            full, spans = _render_spans(tpl, messages)
        except ValueError as e:
            if errors is None:
                raise
            errors.append((k, e))
            continue
        texts.append(full)
        all_spans.append(spans)
        ok.append(k)
    out: list = [None] * len(conversations)
    if not texts:
        return out
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True,
                    return_attention_mask=False)
    for k, ids, offsets, spans in zip(ok, enc["input_ids"], enc["offset_mapping"], all_spans):
        mask = _mask(offsets, spans)
        if max_length is not None:
            ids, mask = ids[:max_length], mask[:max_length]
        out[k] = (list(ids), mask)
    return out


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int | None = None
                          ) -> tuple[list[int], list[int]]:
    """Token ids of the conversation rendered with the tokenizer's chat template, and a 0/1 mask
    that is 1 exactly on assistant tokens (content + end-of-turn marker, every assistant turn)."""
    return tokenize_conversations(tokenizer, [messages], max_length)[0]
