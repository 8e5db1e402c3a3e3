"""benchmarks/concurrency.py: its requests (first turns in file order, `--short` keeps short ones,
`--prompts mixed` shuffles them), its rows and summaries, closed-loop and Poisson."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import concurrency  # noqa: E402

from adaspark.bench.conversations import Conversation  # noqa: E402

CONVERSATIONS = [
    Conversation("chat", "0", "c", ("hello there",)),
    Conversation("long", "1", "c", ("x" * 600,)),
    Conversation("sys", "2", "c", ("short",), system="y" * 495),  # 500 with the system prompt
    Conversation("chat", "3", "c", ("bye",)),
]


def test_short_keeps_only_first_turns_within_the_characters():
    every = concurrency.first_turns(CONVERSATIONS)
    short = concurrency.first_turns(CONVERSATIONS, short=500)
    assert len(every) == len(CONVERSATIONS)
    assert [messages[-1]["content"] for messages, _ in short] == ["hello there", "short", "bye"]
    assert all(concurrency.prompt_chars(r) <= 500 for r in short)
    assert concurrency.first_turns(CONVERSATIONS, short=499)[1][0][-1]["content"] == "bye"


def test_prompt_chars_counts_the_messages_and_the_tools():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    messages = [{"role": "system", "content": "abc"}, {"role": "user", "content": "de"}]
    assert concurrency.prompt_chars((messages, None)) == 5
    assert concurrency.prompt_chars((messages, tools)) == 5 + len(json.dumps(tools))


def test_summary_keeps_each_requests_time_to_first_token_in_order():
    def reply(ttft, text):
        return SimpleNamespace(ttft_s=ttft, tok_s=10.0, completion_tokens=4, text=text)

    replies = [reply(0.3, "a"), None, reply(0.1, "c"), reply(0.2, "d")]
    row = concurrency.summarise(4, replies, 2.0, [reply(0.1, "a"), None, reply(0.1, "x"),
                                                  reply(0.1, "d")])
    assert row["ttft_s"] == [0.3, None, 0.1, 0.2]  # the failed one kept its place
    assert row["ttft_median_s"] == 0.2 and row["failed"] == 1 and row["same_as_solo"] == 2
    assert row["aggregate_tok_s"] == 6.0


def test_waves_of_prompts_wait_for_the_shorter_ones_before_them():
    # fixed part 0.1 (the fastest solo first token); waves of two in queue order, shortest first
    predicted = concurrency.wave_ttft([0.1, 0.3, 0.2, 0.1, 0.5], 2)
    assert predicted == pytest.approx([0.1, 0.3, 0.1, 0.2, 0.5])
    assert concurrency.wave_ttft([0.2, None, 0.4], 1) == pytest.approx([0.2, 0.4])
    assert concurrency.wave_ttft([None], 4) == []


def test_summary_predicts_the_waves_tail_from_the_solo_first_tokens():
    def reply(ttft):
        return SimpleNamespace(ttft_s=ttft, tok_s=10.0, completion_tokens=4, text="t")

    solo = [reply(t) for t in (0.1, 0.2, 0.3, 0.4)]
    row = concurrency.summarise(4, [reply(0.5)] * 4, 1.0, solo)
    # one wave of four: 0.1, 0.2, 0.4, 0.7; its p95 by linear interpolation
    assert row["ttft_p95_waves_s"] == pytest.approx(0.4 + 0.85 * 0.3)
    assert concurrency.summarise(1, solo, 1.0, None)["ttft_p95_waves_s"] is None


def test_mixed_order_is_a_reproducible_shuffle_of_every_first_turn():
    every = concurrency.first_turns(CONVERSATIONS)
    mixed = concurrency.mixed_order(every, seed=3)
    assert mixed == concurrency.mixed_order(every, seed=3)
    assert sorted(map(repr, mixed)) == sorted(map(repr, every))  # the same prompts, all of them
    orders = {tuple(m[-1]["content"] for m, _ in concurrency.mixed_order(every, s))
              for s in range(20)}
    assert len(orders) > 1  # the seed chooses the order


def test_poisson_arrivals_need_a_concurrency_and_keep_the_clients_mode_as_it_was():
    closed = concurrency.parse_args([])
    assert closed.arrivals == "clients" and closed.clients == "1,2,4,8"
    assert closed.prompts == "file-order"
    args = concurrency.parse_args(["--arrivals", "poisson", "--concurrency", "4", "--prompts",
                                   "mixed", "--requests", "45"])
    assert (args.concurrency, args.clients, args.prompts, args.rate) == (4, None, "mixed", None)
    for bad in (["--arrivals", "poisson"],
                ["--arrivals", "poisson", "--concurrency", "0"],
                ["--arrivals", "poisson", "--concurrency", "4", "--clients", "1,4"],
                ["--arrivals", "poisson", "--concurrency", "4", "--rate", "-1"],
                ["--concurrency", "4"], ["--rate", "2"]):
        with pytest.raises(SystemExit):
            concurrency.parse_args(bad)


def streamed(ttft, tok_s, tokens, text="t"):
    return SimpleNamespace(ttft_s=ttft, tok_s=tok_s, completion_tokens=tokens, text=text)


def test_the_poisson_row_is_computed_from_its_requests_leaving_the_failed_out():
    replies = [streamed(0.1, 20.0, 10, "a"), None, streamed(0.3, 10.0, 30, "c"),
               streamed(0.2, 30.0, 20, "d")]
    spans = [(0.0, 2.0), (0.5, 0.6), (1.2, 4.2), (2.5, 5.0)]  # sent, done; the second failed
    solo = [streamed(0.1, 25.0, 10, "a"), streamed(0.1, 25.0, 5, "b"),
            streamed(0.1, 25.0, 30, "x"), streamed(0.1, 25.0, 20, "d")]
    row = concurrency.summarise_arrivals(4, replies, spans, 5.0, solo, [0.0, 0.4, 1.0, 2.5],
                                         rate_per_s=0.8, seed=0)
    assert row["failed"] == 1 and row["requests"] == 4 and row["tokens"] == 60
    assert row["aggregate_tok_s"] == 60 / 5.0
    assert row["decode_tok_s_median"] == 20.0
    assert row["ttft_median_s"] == pytest.approx(0.2)
    assert row["ttft_p95_s"] == pytest.approx(0.2 + 0.9 * 0.1)  # of 0.1, 0.2, 0.3
    assert row["ttft_s"] == [0.1, None, 0.3, 0.2]
    assert row["same_as_solo"] == 2 and row["ttft_p95_waves_s"] is None
    # 2 + 0.1 + 3 + 2.5 s of requests over 5 s; the failed one held the server too
    assert row["in_flight_mean"] == pytest.approx(7.6 / 5.0)
    assert row["late_max_s"] == pytest.approx(0.2)  # the third was sent at 1.2, due at 1.0
    assert (row["arrivals"], row["clients"], row["rate_per_s"]) == ("poisson", 4, 0.8)
    assert concurrency.table_row({"arm": "ar", **row}).split()[1] == "~4"


def test_each_arm_is_compared_with_its_solo_pass_and_with_llama_server():
    def row(arm, aggregate, decode, median, p95, **more):
        return {"arm": arm, "aggregate_tok_s": aggregate, "decode_tok_s_median": decode,
                "ttft_median_s": median, "ttft_p95_s": p95, **more}

    poisson = {"arrivals": "poisson", "clients": 4, "in_flight_mean": 3.5}
    rows = [row("ar", 100.0, 50.0, 0.1, 0.2, clients=1),
            row("ar", 250.0, 40.0, 0.2, 0.5, **poisson),
            {"arm": "ar", "mixed": 12, "clients": 4},  # a mixed run's row: no figures
            row("llama-server", 80.0, 40.0, 0.1, 0.3, clients=1),
            row("llama-server", 125.0, 20.0, 0.4, 0.9, **poisson)]
    ar, llama = concurrency.compare_arrivals(rows)
    assert ar == {"arm": "ar", "concurrency": 4, "in_flight_mean": 3.5,
                  "aggregate_tok_s_over_solo": 2.5, "decode_tok_s_median_over_solo": 0.8,
                  "ttft_median_s_over_solo": 2.0, "ttft_p95_s_over_solo": 2.5,
                  "aggregate_over_llama_server": 2.0}
    assert llama["aggregate_tok_s_over_solo"] == pytest.approx(125 / 80)
    assert llama["aggregate_over_llama_server"] is None
    assert "2.00x llama-server's" in concurrency.comparison_line(ar)
    # without llama-server there is nothing to compare with; without a solo row, no ratio
    alone = concurrency.compare_arrivals([rows[1]])
    assert alone[0]["aggregate_over_llama_server"] is None
    assert alone[0]["aggregate_tok_s_over_solo"] is None


def test_warm_up_prompts_are_the_requests_lengths_but_none_of_their_prefixes():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    requests = [*concurrency.first_turns(CONVERSATIONS), ([{"role": "user", "content": "q"}],
                                                          tools)]
    warm = concurrency.warm_up_requests(requests, 5)
    assert len(warm) == 5
    for (messages, tools_sent), (original, original_tools) in zip(warm, requests, strict=True):
        assert tools_sent == original_tools and len(messages) == len(original)
        assert messages[1:] == original[1:] and messages[0]["role"] == original[0]["role"]
        # the prompt differs from its first message's first character on: no shared prefix
        assert messages[0]["content"][0] != original[0]["content"][0]
        assert messages[0]["content"].endswith(original[0]["content"])
    assert requests[0][0][0]["content"] == "hello there"  # the requests themselves unchanged


def test_interleave_sends_each_request_to_every_arm_in_turn_the_first_rotating():
    calls = []

    class Chat:
        def __init__(self, arm, speed):
            self.arm, self.speed = arm, speed

        def stream_chat(self, messages, max_tokens, tools=None):
            calls.append((self.arm, messages))
            if self.arm == "y" and messages == "m1":
                raise RuntimeError("down")
            return SimpleNamespace(text=messages, tok_s=self.speed, completion_tokens=4,
                                   ttft_s=0.1)

    chats = {"ar": Chat("ar", 10.0), "x": Chat("x", 20.0), "y": Chat("y", 5.0)}
    replies, seconds = concurrency.interleaved_pass(chats, [("m0", None), ("m1", None),
                                                            ("m2", None)], cap=8)
    assert calls == [("ar", "m0"), ("x", "m0"), ("y", "m0"), ("x", "m1"), ("y", "m1"),
                     ("ar", "m1"), ("y", "m2"), ("ar", "m2"), ("x", "m2")]
    assert [r is None for r in replies["y"]] == [False, True, False]  # the others went on
    assert set(seconds) == set(chats) and all(s >= 0.0 for s in seconds.values())
    assert concurrency.paired_ratio(replies["x"], replies["ar"]) == pytest.approx(2.0)
    # only the requests both answered are paired
    assert concurrency.paired_ratio(replies["y"], replies["ar"]) == pytest.approx(0.5)
    assert concurrency.paired_ratio([None], replies["ar"][:1]) is None


def test_interleave_is_one_client_in_closed_loop():
    assert concurrency.parse_args(["--interleave", "--clients", "1"]).interleave
    for bad in (["--clients", "1,4"], ["--mixed", "3"], ["--arrivals", "poisson",
                                                         "--concurrency", "2"]):
        with pytest.raises(SystemExit):
            concurrency.parse_args(["--interleave", *bad])
