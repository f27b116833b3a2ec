"""Session keys and step ids (schemas/keys.py): a run's generation in every key it writes."""

from __future__ import annotations

import json
import re

from schemas import keys


def test_a_run_session_key_is_the_id_digest_and_its_generation() -> None:
    first = keys.run_session_key(keys.DEFAULT_NAMESPACE, "eval-17/0042", keys.new_generation())
    second = keys.run_session_key(keys.DEFAULT_NAMESPACE, "eval-17/0042", keys.new_generation())
    assert re.fullmatch(r"[0-9a-f]{24}", first) and re.fullmatch(r"[0-9a-f]{24}", second)
    assert first[:16] == second[:16] and first != second  # same id, new generation
    assert (
        keys.run_session_key(keys.DEFAULT_NAMESPACE, "eval-17/0043", first[16:])[:16] != first[:16]
    )
    # every step id and marker of a run carries its generation
    assert keys.step_state(keys.round_step(first, 0)) != keys.step_state(keys.round_step(second, 0))


def test_a_program_chat_key_is_the_same_on_replay_and_new_with_the_run() -> None:
    run = keys.run_session_key(keys.DEFAULT_NAMESPACE, "agent/1", "00000001")
    rerun = keys.run_session_key(keys.DEFAULT_NAMESPACE, "agent/1", "00000002")
    assert keys.chat_session_key(run, 0) == keys.chat_session_key(run, 0)
    assert keys.chat_session_key(run, 0) != keys.chat_session_key(run, 1)
    assert keys.chat_session_key(run, 0) != keys.chat_session_key(rerun, 0)
    assert (
        keys.id_claim(keys.DEFAULT_NAMESPACE, "agent/1")
        == keys.id_claim(keys.DEFAULT_NAMESPACE, "agent/1")
        != keys.id_claim(keys.DEFAULT_NAMESPACE, "agent/2")
    )


def test_a_claim_holds_its_run_its_specs_digest_and_its_attempt() -> None:
    claim = keys.Claim("a" * 24, keys.content_digest(b'{"id":"x"}'), 3)
    assert keys.Claim.decode(claim.encode().encode()) == claim
    assert keys.Claim.decode("b" * 24) == keys.Claim("b" * 24)  # a chat's, or an older claim
    assert keys.content_digest(b"1") != keys.content_digest(b"2")


def test_a_stored_spec_says_when_and_in_which_batch_it_was_submitted() -> None:
    body = b'{"id":"a/b","model":"m"}'
    stored = json.loads(keys.with_submitted(body, 1234, 'b"1'))
    assert stored == {"submitted_ms": 1234, "batch": 'b"1', "id": "a/b", "model": "m"}
    assert json.loads(keys.with_submitted(body, 5)) == {
        "submitted_ms": 5,
        "id": "a/b",
        "model": "m",
    }


def test_a_program_runs_chats_name_their_run_by_their_batch() -> None:
    assert keys.run_of_batch(keys.run_batch("abc123")) == "abc123"
    assert keys.run_of_batch("0f3e9a1b2c3d") is None


def test_a_program_chat_spec_id_names_its_run_and_send_number() -> None:
    assert keys.chat_spec_id("runs/a#b", 3) == "runs/a#b#send3"
    assert keys.chat_of(keys.chat_spec_id("runs/a#b", 3)) == ("runs/a#b", 3)
    assert keys.chat_of("eval/0042") is None
    assert keys.chat_of("#send1") is None  # no run id
    assert keys.chat_of("run#sendx") is None


def test_an_id_is_claimed_in_its_namespace_and_a_batch_scope_is_its_own() -> None:
    default = keys.id_claim(keys.DEFAULT_NAMESPACE, "request-1")
    assert keys.id_claim("team-a", "request-1") != default
    assert keys.id_claim(keys.batch_scope("b1"), "request-1") != keys.id_claim(
        keys.batch_scope("b2"), "request-1"
    )
    # a namespace and an id never run together into another pair's claim
    assert keys.id_claim("a", "b\nc") != keys.id_claim("a\nb", "c")
    assert not re.fullmatch(keys.NAMESPACE_PATTERN, keys.batch_scope("b1"))
    runs = {keys.run_session_key(ns, "q1", "00000001")[:16] for ns in ("default", "team-a")}
    assert len(runs) == 2
