"""The plain-decode engine and the generate/chat/fetch-model commands, on the real model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from adaspark import cli
from adaspark.engine import Engine
from adaspark.errors import UserError
from adaspark.model.sources import default_model_path
from adaspark.model.tokenizer import Tokenizer
from adaspark.request import Reply

pytestmark = pytest.mark.slow

HAIKU = [{"role": "user", "content": "Write a haiku about the sea."}]


@pytest.fixture(scope="module")
def tok(model_path):
    return Tokenizer.from_gguf(model_path)


@pytest.fixture(scope="module")
def engine(reference_model, model_path):
    """Plain decoding (the `ar` arm: no speculator) on the shared float32 reference model."""
    engine = Engine(reference_model, Tokenizer.from_gguf(model_path), model_path)
    engine.reset()
    return engine


def _reply(tok, text, max_tokens=100, stop=()):
    """Feed the tokens of `text` to a Reply; returns it and what it streamed."""
    streamed = []
    reply = Reply(tok, max_tokens, stop, streamed.append)
    for t in tok.encode(text):
        if reply.push(t):
            break
    return reply, streamed


# --- stops, applied token by token (no model needed) -------------------------------------------
def test_stop_token_ends_the_reply_and_is_not_in_the_ids(tok):
    reply, streamed = _reply(tok, "Hello there<|im_end|>ignored")
    assert (reply.text, reply.finish_reason, reply.stop_token_id) == ("Hello there", "stop", 2)
    assert reply.token_ids == tok.encode("Hello there")
    assert "".join(streamed) == "Hello there"


def test_stop_string_across_tokens_cuts_text_and_stream(tok):
    text = "The answer is 42. Goodbye now, and more after it."
    stop = ". Goodbye"
    assert len(tok.encode(stop)) > 1  # the stop string spans several tokens
    reply, streamed = _reply(tok, text, stop=[stop, "never"])
    assert reply.text == "The answer is 42"
    assert "".join(streamed) == "The answer is 42"
    assert reply.finish_reason == "stop" and reply.stop_token_id is None
    # the token that completed the stop string is the last one taken
    assert tok.decode(reply.token_ids).startswith("The answer is 42. Goodbye")
    assert not tok.decode(reply.token_ids[:-1]).endswith(". Goodbye")


def test_stop_string_inside_one_token(tok):
    reply, _ = _reply(tok, "one two three four", stop=["hre"])
    assert reply.text == "one two t"


def test_text_that_may_start_a_stop_is_held_back_then_released(tok):
    streamed = []
    reply = Reply(tok, 100, ["ENDX"], streamed.append)
    for t in tok.encode("abc END"):
        reply.push(t)
    assert "".join(streamed) == "abc "  # "END" might still become "ENDX"
    for t in tok.encode(" went on"):
        reply.push(t)
    assert "".join(streamed) == "abc END went on" == reply.text
    assert reply.finish_reason is None


def test_max_tokens_is_exact_and_releases_held_text(tok):
    ids = tok.encode("alpha beta gamma delta epsilon")
    streamed = []
    reply = Reply(tok, 3, ["gamma!"], streamed.append)
    finished = [reply.push(t) for t in ids[:3]]
    assert finished == [False, False, True]
    assert reply.token_ids == ids[:3] and reply.finish_reason == "length"
    assert "".join(streamed) == reply.text == tok.decode(ids[:3])


# --- the engine on the model ------------------------------------------------------------------
def test_greedy_reply_is_consistent(engine, tok):
    gen = engine.generate(HAIKU, max_tokens=24)
    assert gen.prompt_token_ids == tok.encode_chat(HAIKU)
    assert tok.decode(gen.token_ids) == gen.text
    assert 1 <= len(gen.token_ids) <= 24
    assert gen.finish_reason in ("stop", "length")
    t = gen.timings
    assert t.prompt_tokens == len(gen.prompt_token_ids) and t.prefill_s > 0
    assert t.decode_tokens == len(gen.token_ids) - (gen.finish_reason == "length")
    assert t.decode_tok_s > 0


def test_max_tokens_stop_strings_and_streaming(engine):
    engine.reset()
    free = engine.generate(HAIKU, max_tokens=20)
    assert len(free.token_ids) == 20 and free.finish_reason == "length"
    exact = engine.generate(HAIKU, max_tokens=7)
    assert exact.token_ids == free.token_ids[:7] and exact.finish_reason == "length"
    # a stop string taken from the middle of the free reply
    stop = free.text[len(free.text) // 2:][:4]
    cut = free.text.index(stop)
    streamed = []
    stopped = engine.generate(HAIKU, max_tokens=20, stop=[stop], on_text=streamed.append)
    assert stopped.text == free.text[:cut] == "".join(streamed)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:len(stopped.token_ids)]


def test_next_turn_reuses_the_cache_and_matches_a_fresh_prefill(engine):
    engine.reset()
    first = engine.generate(HAIKU, max_tokens=16)
    convo = HAIKU + [{"role": "assistant", "content": first.text},
                     {"role": "user", "content": "Now one about mountains."}]
    reused = engine.generate(convo, max_tokens=16)
    assert reused.timings.reused_tokens > len(first.prompt_token_ids)
    engine.reset()
    fresh = engine.generate(convo, max_tokens=16)
    assert fresh.timings.reused_tokens == 0
    assert reused.token_ids == fresh.token_ids


def test_cancel_between_forwards(engine):
    calls = []
    gen = engine.generate(HAIKU, max_tokens=50, should_stop=lambda: calls.append(1) or
                          len(calls) >= 3)
    assert gen.finish_reason == "cancelled" and len(gen.token_ids) == 3


def test_prompt_longer_than_the_context_is_a_user_error(engine):
    too_long = [{"role": "user", "content": "word " * (engine.context_length + 10)}]
    with pytest.raises(UserError, match="longer than the model's context"):
        engine.generate(too_long)


# --- commands ---------------------------------------------------------------------------------
def test_generate_json(capsys):
    assert cli.main(["generate", "--prompt", "Say hi.", "--max-tokens", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"text", "token_ids", "prompt_token_ids", "decode_tok_s"} <= out.keys()
    assert 1 <= len(out["token_ids"]) <= 5 and out["prompt_token_ids"][0] == 1


def test_generate_sampled_json_reproduces_with_its_seed(capsys):
    argv = ["generate", "--prompt", "Name a colour.", "--max-tokens", "6", "--json", "--arm",
            "ar", "--temperature", "0.9", "--top-p", "0.9", "--top-k", "40"]
    assert cli.main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert isinstance(first["seed"], int)
    assert cli.main([*argv, "--seed", str(first["seed"])]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["token_ids"] == first["token_ids"] and again["seed"] == first["seed"]
    assert cli.main(["generate", "--prompt", "Hi", "--max-tokens", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["seed"] is None  # greedy


@pytest.mark.parametrize("flag,value", [("--temperature", "2.5"), ("--top-p", "0"),
                                        ("--top-k", "-3"), ("--presence-penalty", "3")])
def test_generate_refuses_bad_sampling_options_before_loading(flag, value):
    done = subprocess.run([sys.executable, "-m", "adaspark.cli", "generate", "--prompt", "hi",
                           flag, value, "--model", "/nonexistent/model.gguf"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert flag[2:].replace("-", "_") in done.stderr  # named, before the missing model


def test_chat_repl_multi_turn_and_reset(monkeypatch, capsys):
    import io
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi!\nWhat did I just say?\n/reset\nBye.\n"))
    assert cli.main(["chat", "--max-tokens", "6", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.strip("\n").split("\n")) >= 3  # three replies
    assert "conversation reset" in captured.err


def test_fetch_model_prints_the_cached_path(capsys):
    assert cli.main(["fetch-model"]) == 0
    assert capsys.readouterr().out.strip() == str(default_model_path())


@pytest.mark.parametrize("model", ["/nonexistent/model.gguf", __file__])
def test_bad_model_is_one_line_exit_2(model):
    done = subprocess.run([sys.executable, "-m", "adaspark.cli", "generate", "--prompt", "hi",
                           "--model", model], capture_output=True, text=True)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert "not found" in done.stderr or "not a GGUF" in done.stderr
