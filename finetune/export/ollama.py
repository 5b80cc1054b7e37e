"""An Ollama ``Modelfile`` for the exported GGUF: ``FROM ./<file>.gguf``, a ``TEMPLATE`` in Ollama's Go-template
messages form derived from the tokenizer's chat template, and ``PARAMETER stop`` for its end-of-turn tokens.

The template is derived, not translated: the chat template is rendered on probe conversations whose contents are
sentinels, which gives each role's text before and after its content, the default system turn the template adds
when a conversation has none, and the generation prompt. The derivation is checked by re-rendering the probes from
those parts; a chat template that is not a concatenation of per-message turns (one that reorders, drops or
transforms messages) is refused with one ``error:`` line rather than approximated."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.errors import FinetuneError

ROLES = ("system", "user", "assistant")
_SENTINEL = "\x00{}\x00"  # no chat template writes a NUL of its own


@dataclass(frozen=True)
class ChatParts:
    """A per-message chat template: ``wrap[role]`` = (text before the content, text after it); ``default_system``:
    the text a conversation without a system message starts with ('' for none); ``generation_prompt``."""

    wrap: dict
    default_system: str
    generation_prompt: str

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """What the chat template renders for ``messages`` (roles in ``ROLES``), from these parts."""
        text = self.default_system if messages and messages[0]["role"] != "system" else ""
        for message in messages:
            before, after = self.wrap[message["role"]]
            text += before + message["content"] + after
        return text + (self.generation_prompt if add_generation_prompt else "")


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)


def _probes() -> list[list[dict]]:
    """Conversations the derivation is checked on: with and without a system turn, several turns each."""
    s, u, a = ({"role": r, "content": _SENTINEL.format(f"{r}{i}")} for r, i in (("system", 0), ("user", 0),
                                                                                 ("assistant", 0)))
    u1, a1 = {"role": "user", "content": _SENTINEL.format("user1")}, {"role": "assistant",
                                                                       "content": _SENTINEL.format("assistant1")}
    return [[u], [s, u], [u, a, u1], [s, u, a, u1, a1], [s, u, a, u1]]


def chat_parts(tokenizer) -> ChatParts:
    """The ``ChatParts`` of ``tokenizer.chat_template``. Raises ``FinetuneError`` for a tokenizer without a chat
    template, or one the parts do not reproduce on every probe conversation."""
    if not getattr(tokenizer, "chat_template", None):
        raise FinetuneError("--ollama needs the model's chat template, and its tokenizer has none. Train from a chat "
                            "model (or set one), or drop --ollama.")
    u, u1, a, s = ({"role": role, "content": _SENTINEL.format(name)} for role, name in
                   (("user", "user0"), ("user", "user1"), ("assistant", "assistant0"), ("system", "system0")))
    try:
        renders = {name: _render(tokenizer, convo, add) for name, convo, add in (
            ("u", [u], False), ("u+", [u], True), ("ua", [u, a], False), ("uau", [u, a, u1], False),
            ("su", [s, u], False))}
        parts = _split(renders, u["content"], u1["content"], a["content"], s["content"])
    except FinetuneError:
        raise
    except Exception as err:  # noqa: BLE001 - jinja's and transformers' errors: the template cannot be probed
        raise FinetuneError(f"--ollama: the chat template could not be rendered on probe conversations "
                            f"({type(err).__name__}: {err}). Drop --ollama, or write the Modelfile by hand.") from None
    for messages in _probes():
        for add in (True, False):
            if parts.render(messages, add) != _render(tokenizer, messages, add):
                raise FinetuneError("--ollama: the chat template is not a concatenation of per-message turns (its "
                                    "rendering of a probe conversation could not be reproduced), so no Ollama "
                                    "TEMPLATE equals it. Drop --ollama, or write the Modelfile's TEMPLATE by hand.")
    return parts


def _split(renders: dict, user: str, user1: str, assistant: str, system: str) -> ChatParts:
    """``ChatParts`` from renderings of [user] (``renders["u"]``, with the generation prompt ``"u+"``), [user,
    assistant] (``"ua"``), [user, assistant, user1] (``"uau"``) and [system, user] (``"su"``), each content a
    sentinel. Raises ``FinetuneError`` when a sentinel is missing or the pieces do not line up."""
    def cut(text: str, mark: str) -> tuple[str, str]:
        head, found, tail = text.partition(mark)
        if not found:
            raise FinetuneError("--ollama: the chat template drops or changes a message's content, so no Ollama "
                                "TEMPLATE equals it. Drop --ollama, or write the Modelfile's TEMPLATE by hand.")
        return head, tail

    default_and_user_prefix, user_suffix = cut(renders["u"], user)
    generation_prompt = renders["u+"][len(renders["u"]):] if renders["u+"].startswith(renders["u"]) else ""
    before_assistant, assistant_suffix = cut(renders["ua"], assistant)
    assistant_prefix = cut(before_assistant, user)[1][len(user_suffix):]
    user_prefix = cut(cut(renders["uau"], assistant)[1], user1)[0][len(assistant_suffix):]
    system_prefix, after_system = cut(renders["su"], system)
    system_suffix_and_user_prefix = cut(after_system, user)[0]
    if not (default_and_user_prefix.endswith(user_prefix) and system_suffix_and_user_prefix.endswith(user_prefix)):
        raise FinetuneError("--ollama: the chat template's user turn does not start the same way everywhere, so no "
                            "Ollama TEMPLATE equals it. Drop --ollama, or write the Modelfile's TEMPLATE by hand.")
    wrap = {"system": (system_prefix, system_suffix_and_user_prefix[: len(system_suffix_and_user_prefix)
                                                                    - len(user_prefix)]),
            "user": (user_prefix, user_suffix), "assistant": (assistant_prefix, assistant_suffix)}
    return ChatParts(wrap=wrap, default_system=default_and_user_prefix[: len(default_and_user_prefix) - len(user_prefix)],
                     generation_prompt=generation_prompt)


def _literal(text: str, what: str) -> str:
    """``text`` as literal template text; refuses what Go's template parser or the Modelfile's triple quotes would
    read as syntax."""
    if "{{" in text or "}}" in text or '"""' in text:
        raise FinetuneError(f"--ollama: the chat template's {what} holds '{{{{', '}}}}' or '\"\"\"', which a Modelfile "
                            "TEMPLATE cannot hold literally. Drop --ollama, or write the Modelfile by hand.")
    return text


def go_template(parts: ChatParts) -> str:
    """Ollama's messages-form TEMPLATE (Go ``text/template``) that renders what ``parts`` render with the generation
    prompt: the default system turn before a first message that is not a system one, each message wrapped by its
    role, and the generation prompt after a last message that is not the assistant's (Ollama continues an assistant
    message in place)."""
    branches = []
    for i, role in enumerate(ROLES):
        before, after = (_literal(t, f"{role} turn") for t in parts.wrap[role])
        branches.append(f'{{{{ {"if" if i == 0 else "else if"} eq $m.Role "{role}" }}}}{before}'
                        f"{{{{ $m.Content }}}}{after}")
    default = _literal(parts.default_system, "default system turn")
    prompt = _literal(parts.generation_prompt, "generation prompt")
    return ("{{ range $i, $m := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}"
            + (f'{{{{ if and (eq $i 0) (ne $m.Role "system") }}}}{default}{{{{ end }}}}' if default else "")
            + "".join(branches) + "{{ end }}"
            + (f'{{{{ if and $last (ne $m.Role "assistant") }}}}{prompt}{{{{ end }}}}' if prompt else "")
            + "{{ end }}")


def modelfile(gguf_name: str, tokenizer, stop_token_ids: list[int]) -> str:
    """The ``Modelfile`` text: ``FROM ./<gguf_name>``, ``TEMPLATE`` (``go_template`` of ``chat_parts``) and one
    ``PARAMETER stop`` per stop token (its text). Raises ``FinetuneError`` as ``chat_parts`` does."""
    template = go_template(chat_parts(tokenizer))
    stops = list(dict.fromkeys(tokenizer.convert_ids_to_tokens(i) for i in stop_token_ids))
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{template}"""']
    lines += [f'PARAMETER stop "{stop}"' for stop in stops if stop]
    return "\n".join(lines) + "\n"
