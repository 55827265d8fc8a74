"""The shipped chat template (the packaged GGUF has none): what miner and reference both render."""

from __future__ import annotations

from neurons.model.chat_template import render


def test_user_turn_opens_the_model_turn() -> None:
    assert render([{"role": "user", "content": "Hi"}]) == "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_system_folds_into_the_first_user_turn_and_roles_map() -> None:
    text = render([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "TCP?"}]},
        {"role": "assistant", "content": "  A protocol.  "},
        {"role": "developer", "content": "Late instructions."},
        {"role": "user", "content": "More?"},
    ])
    assert text == ("<start_of_turn>user\nBe brief.\n\nWhat is TCP?<end_of_turn>\n"
                    "<start_of_turn>model\nA protocol.<end_of_turn>\n"
                    "<start_of_turn>user\nLate instructions.<end_of_turn>\n"
                    "<start_of_turn>user\nMore?<end_of_turn>\n"
                    "<start_of_turn>model\n")


def test_a_lone_system_message_becomes_the_user_turn() -> None:
    assert render([{"role": "system", "content": "Rules."}]).startswith("<start_of_turn>user\nRules.<end_of_turn>")
