"""A chat prompt read back into its conversation (edge/chat_turns.py), so a drafting model with another
chat template sees the same conversation in its own: exact or nothing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specedge.edge.chat_turns import conversation_of
from specedge.edge.tokenizer import render_chat

CHATML = (  # SmolLM2's template: a default system turn when the conversation has none
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
GEMMA_TURNS = (  # Gemma 3's shape: BOS, the system text folded into the first user turn, contents trimmed
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n'"
    " + (first if loop.first else '') + m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
TEMPLATES = {"chatml": CHATML, "gemma": GEMMA_TURNS}


def renderer(name: str):
    return lambda turns: render_chat(TEMPLATES[name], turns, {"bos_token": "<bos>", "eos_token": "<eos>"})


CONTENT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x01\x02\x03"), max_size=30)
CONVERSATION = st.tuples(st.none() | CONTENT, st.lists(CONTENT, min_size=0, max_size=2), CONTENT).map(
    lambda t: ([{"role": "system", "content": t[0]}] if t[0] is not None else [])
    + [{"role": ("user", "assistant")[i % 2], "content": c} for i, c in enumerate(t[1][: len(t[1]) // 2 * 2])]
    + [{"role": "user", "content": t[2]}])


@settings(max_examples=200, deadline=None)
@given(CONVERSATION, st.sampled_from(sorted(TEMPLATES)))
def test_a_conversation_read_back_renders_to_the_same_prompt(conversation, template):
    render = renderer(template)
    prompt = render(conversation)
    turns = conversation_of(prompt, render)
    # None only where markers inside the contents make the prompt ambiguous; never a wrong conversation
    assert turns is None or render(turns) == prompt
    if all(m["content"] and m["content"] == m["content"].strip() and not set("<\n") & set(m["content"])
           for m in conversation):  # plain contents: always read back
        assert turns is not None


def test_the_turns_are_read_back_with_their_roles():
    render = renderer("chatml")
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a colour."}]
    assert conversation_of(render(conversation), render) == conversation
    gemma = renderer("gemma")
    assert conversation_of(gemma(conversation[1:]), gemma) == conversation[1:]


def test_a_plain_prompt_or_an_unfinished_turn_is_no_conversation():
    render = renderer("chatml")
    assert conversation_of("Once upon a time", render) is None
    closed = render([{"role": "user", "content": "Hi"}]).removesuffix("<|im_start|>assistant\n")
    assert conversation_of(closed, render) is None
