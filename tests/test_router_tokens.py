"""The router's local tokenizer (tokens.LocalTokens) on a tokenizer built here: a client's own chat template is never
run in the router, and the client's template arguments cannot change what it returns."""

from __future__ import annotations

import asyncio

import pytest

from pdpush.router import tokens

TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant :{% endif %}")
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "w1 w2 x3 y4 w5"}]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([f"w{i} x{i % 7} y{i % 13} user assistant :" for i in range(500)],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = TEMPLATE
    d = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(d)
    return tokens.LocalTokens(str(d))


def ids(local, body):
    return asyncio.run(local.ids(None, "", CHAT, {"model": "m", "messages": MESSAGES, **body}))


def test_the_configured_template_gives_the_ids(local):
    got = ids(local, {})
    assert got and all(isinstance(t, int) for t in got)
    assert ids(local, {"chat_template_kwargs": {"tokenize": False, "return_dict": True}}) == got  # (a 400 before)
    assert ids(local, {"chat_template_kwargs": {"enable_thinking": False}}) == got  # a template's own argument


@pytest.mark.parametrize("where", ["body", "kwargs"])
def test_a_clients_own_template_is_not_run_here_and_routes_by_load(local, where):
    """A template is a program: one of the client's (two nested loops of 10^5) held a tokenizer thread each, and six
    such requests stopped the routing of every request. Its engine renders it or refuses it."""
    ran = "{{ raise_exception('the client template ran in the router') }}"
    body = {"chat_template": ran} if where == "body" else {"chat_template_kwargs": {"chat_template": ran}}
    assert ids(local, body) is None


def test_template_arguments_that_are_not_an_object_are_a_bad_prompt(local):
    with pytest.raises(tokens.PromptError):
        ids(local, {"chat_template_kwargs": ["x"]})
